"""`HiCacheConnector` on a real vLLM engine (the CPU build, a tiny random-weight Llama written to a temp dir).

Every scenario runs the same multi-turn, shared-system-prompt workload through `LLM.generate` (greedy,
float32, vLLM's KV space 10 blocks of 32 tokens, so its own prefix cache evicts) and compares every request
with vLLM alone: token ids equal, logprobs within 1e-4. One engine per process (`vllm_workload.py`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from tiny_model import write_tiny_llama
from vllm_helpers import ROOT, assert_identical, hit_tokens, run_workload, vllm_python

from hicache.keys import Namespace, as_key_bytes, chained_page_keys
from storage_backends.page_format import key_digest

sys.path.insert(0, str(ROOT / "tests"))
from page_damage import flip_page_byte, group_file, page_bytes, pages_at, rewrite_page
from s3_servers import start_moto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="session")
def storage_root(engine_runs: Path) -> Path:
    root = engine_runs / "storage"
    root.mkdir()
    return root


@pytest.fixture(scope="session")
def first_engine(tiny_model: Path, engine_runs: Path, storage_root: Path) -> dict[str, Any]:
    """The workload through hicache with a file storage tier, on an empty storage root."""
    return run_engine(engine_runs / "first.json", tiny_model, storage_root)


def run_engine(out: Path, model: Path, root: Path, *args: str) -> dict[str, Any]:
    engine_id = f"test-{uuid.uuid4().hex[:12]}"
    return run_workload(
        out,
        "--model",
        str(model),
        "--connector",
        "hicache",
        "--engine-id",
        engine_id,
        "--storage-url",
        f"file://{root}",
        *args,
    )


def assert_clean(result: dict[str, Any]) -> None:
    """The worker's cache passed `sanity_check()` once its work settled, and holds no lookup."""
    assert result["sanity"]["ok"], result["sanity"]
    assert result["statistics"]["lookups_held"] == 0
    assert result["statistics"]["prefetches_in_flight"] == 0


def test_host_tier_serves_evicted_prefixes_with_identical_outputs(
    baseline: dict[str, Any], first_engine: dict[str, Any]
) -> None:
    """vLLM's own prefix cache evicts; hicache's host tier serves those blocks back, and every request's
    tokens and logprobs equal vLLM alone's (a wrong block copy or a block loaded short would change them)."""
    assert_identical(baseline, first_engine)
    assert hit_tokens(first_engine, "host") > 0
    assert first_engine["statistics"]["connector"]["failed_tokens"] == 0
    assert_clean(first_engine)


def test_second_engine_loads_the_first_ones_pages_from_storage(
    baseline: dict[str, Any],
    first_engine: dict[str, Any],
    tiny_model: Path,
    engine_runs: Path,
    storage_root: Path,
) -> None:
    """A fresh engine process on the same storage root starts with an empty host pool: the first
    engine's pages come from storage (async loads) and the outputs stay identical."""
    second = run_engine(engine_runs / "second.json", tiny_model, storage_root)
    assert hit_tokens(second, "storage") > 0
    assert_identical(baseline, second)
    assert_clean(second)


def test_a_different_dtype_or_model_config_loads_none_of_the_pages(
    first_engine: dict[str, Any], engine_runs: Path, storage_root: Path, tiny_model: Path
) -> None:
    """Pages are namespaced by model config, layout, dtype and block size: an engine of another dtype, and
    one of another model config (same shapes), on the same root find none of the first engine's pages."""
    other_dtype = run_engine(engine_runs / "bf16.json", tiny_model, storage_root, "--dtype", "bfloat16")
    assert hit_tokens(other_dtype, "storage") == 0
    assert_clean(other_dtype)
    other_model = write_tiny_llama(engine_runs / "other-model", intermediate_size=640)
    other_config = run_engine(engine_runs / "other-config.json", other_model, storage_root)
    assert hit_tokens(other_config, "storage") == 0
    assert_clean(other_config)


def test_damaged_pages_and_aborted_loads_leave_outputs_identical(
    baseline: dict[str, Any],
    first_engine: dict[str, Any],
    engine_runs: Path,
    storage_root: Path,
    tiny_model: Path,
) -> None:
    """Damaged pages in storage (a flipped payload byte, a truncated file, one page's bytes under another's
    name) fail their loads; vLLM recomputes those blocks (`get_block_ids_with_load_errors`), outputs stay
    identical, and 4 requests aborted right after they arrived (their storage lookup or async load in
    flight) leak no page and no prefetch."""
    damaged = engine_runs / "damaged"
    shutil.copytree(storage_root, damaged)
    # The root also holds the other-dtype and other-config engines' pages: damage the first engine's own,
    # chosen by key. Its namespace's fields and its system prompts come back in its result.
    namespace = Namespace(**first_engine["statistics"]["namespace"])
    system_pages = [
        [damaged / k[:2] / f"{k}.kvp" for k in chained_page_keys(as_key_bytes(s), 32, namespace)[1]]
        for s in first_engine["system_prompts"]
    ]
    assert all(p.is_file() for chain in system_pages for p in chain), system_pages
    # The first system prompt's first page is read by the first request (or an aborted one) to look it up:
    # the file is there and its header is whole, so only its read can find the flipped byte.
    corrupt, donor = system_pages[0][0], system_pages[0][1]
    foreign, truncated = system_pages[1][2], system_pages[1][3]
    # Each name is a link to its put's group file (docs/storage.md); copytree made each a file of its
    # own, and the damage goes to one page's bytes only (`page_damage`).
    pages = pages_at(damaged, namespace.digest)
    key_of = {p: p.name.removesuffix(".kvp") for chain in system_pages for p in chain}
    flip_page_byte(pages, key_of[corrupt], pages.page_extent(key_of[corrupt])[2] - 1)
    rewrite_page(pages, key_of[truncated], lambda data: data[:100])
    donor_page = page_bytes(pages, key_of[donor])
    foreign.unlink()
    foreign.write_bytes(group_file([(key_digest(key_of[donor]), donor_page)]))
    result = run_engine(engine_runs / "damaged.json", tiny_model, damaged, "--abort-first", "4")
    assert hit_tokens(result, "storage") > 0  # the undamaged pages still load
    assert result["statistics"]["storage_refused_pages"] >= 1
    assert_identical(baseline, result)
    assert_clean(result)


def test_s3_server_killed_mid_run_with_a_tiny_host_pool_leaves_outputs_identical(
    baseline: dict[str, Any], tiny_model: Path, engine_runs: Path
) -> None:
    """The S3 server (moto on loopback) is killed after the first turn: prefetches and writes fail or time
    out, the breaker opens, and vLLM computes what hicache cannot give; the host pool holds 4 pages, less
    than one prompt, so saves and prefetches run out of host room too. Nothing leaks."""
    workdir = engine_runs / "moto"
    workdir.mkdir()
    server = start_moto(workdir)
    try:
        url = f"s3://{server.bucket}/kv?endpoint={server.endpoint}&region={server.region}"
        options = {"access_key_id": server.access_key_id, "secret_access_key": server.secret_access_key}
        extra = {"storage_options": options, "storage_read_timeout_s": 2.0, "storage_write_timeout_s": 2.0}
        result = run_workload(
            engine_runs / "s3-killed.json",
            "--model",
            str(tiny_model),
            "--connector",
            "hicache",
            "--engine-id",
            f"test-{uuid.uuid4().hex[:12]}",
            "--storage-url",
            url,
            "--extra",
            json.dumps(extra),
            "--kill-pid",
            str(server.process.pid if server.process else 0),
            "--kill-after-turn",
            "1",
            "--host-pages",
            "4",
        )
    finally:
        server.stop()
    assert_identical(baseline, result)
    assert_clean(result)


def test_unknown_or_invalid_extra_config_keys_are_refused_naming_the_key() -> None:
    """A typo in `kv_connector_extra_config` is refused when the connector is built, naming the key."""
    script = textwrap.dedent(
        """
        from types import SimpleNamespace as NS
        from hicache.integrations.vllm import build_hicache_config
        class HF:
            def to_json_string(self, use_diff=False):
                return "{}"
        def config(extra):
            model = NS(use_mla=False, get_num_layers=lambda p: 4, get_num_kv_heads=lambda p: 2,
                       get_head_size=lambda: 64, dtype=__import__("torch").float32, max_model_len=256,
                       model="m", revision=None, hf_config=HF())
            return NS(model_config=model, parallel_config=NS(world_size=1), load_config=NS(load_format="dummy"),
                      cache_config=NS(block_size=32, cache_dtype="auto"),
                      kv_transfer_config=NS(kv_connector_extra_config=extra))
        build_hicache_config(config({"host_pages": 8}))
        for extra in ({"host_page": 8}, {"write_policy": "sometimes"}, {"host_pages": 0}):
            try:
                build_hicache_config(config(extra))
            except (ValueError, TypeError) as exc:
                print(type(exc).__name__, exc)
            else:
                print("accepted", extra)
        """
    )
    out = subprocess.run(
        [vllm_python(), "-c", script],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
        check=True,
    ).stdout.splitlines()
    assert len(out) == 3, out
    assert out[0].startswith("ValueError kv_connector_extra_config: unknown key 'host_page'")
    assert "write_policy" in out[1]
    assert out[1].startswith("ValueError")
    assert "host_pages" in out[2]
