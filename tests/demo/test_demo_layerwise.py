"""The demo model's layer-wise prefill: each layer's K/V is read just before that layer's attention, and
the result equals the whole prefill bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hicache.demo.model import DemoModel, ModelSpec

SPEC = ModelSpec(
    num_layers=3, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.fixture(scope="module")
def model() -> DemoModel:
    return DemoModel(SPEC)


def test_prefill_layerwise_equals_whole_prefill_bitwise(model: DemoModel) -> None:
    """The same prefix K/V given whole or layer by layer: identical logits, new K/V and restored K/V."""
    tokens = torch.randint(0, SPEC.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    past = model.prefill(tokens[:24], None).kv_new
    whole = model.prefill(tokens, past)
    layered, restored = model.prefill_layerwise(tokens, 24, lambda i: past[i].clone())
    assert torch.equal(layered.logits_last, whole.logits_last)
    assert torch.equal(layered.kv_new, whole.kv_new)
    assert torch.equal(restored, past)


def test_each_layer_is_read_just_before_its_attention(model: DemoModel) -> None:
    """Layer i's K/V is asked for after layer i-1's attention ran and before layer i's runs: the copy of a
    later layer can overlap the compute of the earlier ones, and no layer is read before it was asked."""
    tokens = torch.randint(0, SPEC.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    past = model.prefill(tokens[:12], None).kv_new
    events: list[str] = []

    def read(layer: int) -> torch.Tensor:
        events.append(f"read {layer}")
        return past[layer].clone()

    hooks = [
        layer.self_attn.register_forward_hook(lambda _m, _a, _o, i=i: events.append(f"attn {i}"))
        for i, layer in enumerate(model.model.model.layers)
    ]
    try:
        model.prefill_layerwise(tokens, 12, read)
    finally:
        for hook in hooks:
            hook.remove()
    assert events == ["read 0", "attn 0", "read 1", "attn 1", "read 2", "attn 2"]


def test_prefill_layerwise_refuses_a_bad_prefix_length(model: DemoModel) -> None:
    tokens = torch.arange(8)
    with pytest.raises(ValueError, match="past_len"):
        model.prefill_layerwise(tokens, 8, lambda i: torch.empty(0))
