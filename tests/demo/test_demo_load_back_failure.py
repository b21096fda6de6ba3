"""A failed layer-wise load-back in the demo: the request whose prefix failed to land is served again
(a second acquire finds what the cache still holds) and every output still matches recompute."""

from __future__ import annotations

import anyio
import pytest

pytest.importorskip("transformers")

from hicache.controller.movement.layered_load import LayeredLoader, LayerwiseLoad
from hicache.demo import llama_serve
from hicache.demo.llama_serve import run_demo
from hicache.demo.model import ModelSpec
from hicache.demo.records import DemoConfig
from hicache.demo.workload import WorkloadSpec
from hicache.tree import MatchResult

SMALL = DemoConfig(
    users=2,
    turns=3,
    page_size=16,
    device_pages=16,
    host_pages=48,
    prefetch_threshold=16,
    lockstep=True,
    model=ModelSpec(
        num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
    ),
    workload=WorkloadSpec(system_prompts=1, system_prompt_tokens=96, user_tokens=(16, 48), decode_tokens=4),
)


def test_a_request_whose_prefix_failed_to_load_back_is_served_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first layer-wise load-back's copy fails at layer 1: the model, waiting on layer 1, gets
    `LoadBackFailed`, the runner serves the request again, the cache's accounting holds at the end of the
    cached run (`run_serving` checks it) and every output is identical to recompute."""
    failed: list[int] = []
    load_back = LayeredLoader.load_back

    async def failing_once(self: LayeredLoader, match: MatchResult) -> LayerwiseLoad:
        def hook(layer: int) -> None:
            if layer == 1:
                failed.append(layer)
                raise RuntimeError("injected copy failure")

        self.before_layer = hook if not failed and match.host_len else None
        return await load_back(self, match)

    monkeypatch.setattr(LayeredLoader, "load_back", failing_once)
    runners: list[llama_serve.LlamaRunner] = []
    runner_class = llama_serve.LlamaRunner

    def recording_runner(*args: object) -> llama_serve.LlamaRunner:
        runner = runner_class(*args)  # type: ignore[arg-type]
        runners.append(runner)
        return runner

    monkeypatch.setattr(llama_serve, "LlamaRunner", recording_runner)
    result = anyio.run(run_demo, SMALL)
    assert failed == [1]
    assert runners[0].load_back_failures == 1
    assert result.all_identical, [r.request_id for r in result.records if not r.identical]
    assert sum(r.hits.get("host", 0) for r in result.records) > 0


def test_a_request_whose_load_back_fails_twice_is_served_again_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards against `ServingLoop._serve_one` retrying only once: the retry loads the prefix's host copy
    back layer-wise again, and when that copy failed too, `LoadBackFailed` ended the demo's task group
    (every user's conversation). Now the request is served again until its load-back lands (or
    recomputes), and the run completes with every output identical to recompute."""
    failed: list[int] = []
    load_back = LayeredLoader.load_back

    async def failing_twice(self: LayeredLoader, match: MatchResult) -> LayerwiseLoad:
        def hook(layer: int) -> None:
            if layer == 1:
                failed.append(layer)
                raise RuntimeError("injected copy failure")

        self.before_layer = hook if len(failed) < 2 and match.host_len else None
        return await load_back(self, match)

    monkeypatch.setattr(LayeredLoader, "load_back", failing_twice)
    runners: list[llama_serve.LlamaRunner] = []
    runner_class = llama_serve.LlamaRunner

    def recording_runner(*args: object) -> llama_serve.LlamaRunner:
        runner = runner_class(*args)  # type: ignore[arg-type]
        runners.append(runner)
        return runner

    monkeypatch.setattr(llama_serve, "LlamaRunner", recording_runner)
    result = anyio.run(run_demo, SMALL)
    assert failed == [1, 1]
    assert runners[0].load_back_failures == 2
    assert result.all_identical, [r.request_id for r in result.records if not r.identical]
