"""The demo model's K/V conversions and the bitwise guarantees the demo checks on every request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from hicache.demo.model import DemoModel, ModelSpec, cache_from_kv, kv_from_cache
from hicache.demo.oracle import KVOracle
from hicache.memory import KVLayout, KVPool

PAGE = 16
SPEC = ModelSpec(
    num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.fixture(scope="module")
def model() -> DemoModel:
    return DemoModel(SPEC)


@pytest.fixture
def pool() -> Iterator[KVPool]:
    layout = KVLayout(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, torch.float32, PAGE)
    p = KVPool(layout, 64, device="cpu", pin_memory=False, name="test-device")
    yield p
    p.close()


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def scattered_indices(pool: KVPool, num_tokens: int) -> torch.Tensor:
    """Allocate pages so that the request's pages are not one ascending run (as after evictions)."""
    first = pool.alloc(PAGE * 3)
    idx = pool.alloc(num_tokens)
    assert first is not None
    assert idx is not None
    pool.free(first)
    pages = idx.view(-1, PAGE).flip(0)
    return pages.reshape(-1).contiguous()


def test_pool_layout_round_trip_is_bitwise(model: DemoModel, pool: KVPool) -> None:
    """K/V written into a pool and read back rebuild the model's own DynamicCache bit for bit."""
    tokens = random_tokens(5 * PAGE, seed=1)
    own = model.prefill(tokens, None)
    assert own.kv_new.shape == (SPEC.num_layers, 2, tokens.numel(), SPEC.num_kv_heads, SPEC.head_dim)
    idx = scattered_indices(pool, tokens.numel())
    pool.write_tokens(idx, own.kv_new)
    back = pool.read_tokens(idx)
    assert torch.equal(back, own.kv_new)
    restored = cache_from_kv(back)
    for mine, theirs in zip(restored.layers, own.cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys)
        assert torch.equal(mine.values, theirs.values)
        assert mine.keys.is_contiguous()
    assert torch.equal(kv_from_cache(restored, PAGE, 3 * PAGE), own.kv_new[:, :, PAGE : 3 * PAGE])


@pytest.mark.parametrize("split_pages", [1, 3, 4])
def test_restored_prefix_continues_like_the_models_own_cache(
    model: DemoModel, pool: KVPool, split_pages: int
) -> None:
    """Logits after a prefix restored from the pool equal the in-memory continuation bit for bit.

    They also agree with a no-cache recompute of the whole sequence within 1e-4 (not bitwise: a
    recompute computes the prefix in a different chunk, which rounds differently).
    """
    tokens = random_tokens(5 * PAGE + 7, seed=2)
    split = split_pages * PAGE
    prefix = model.prefill(tokens[:split], None)
    idx = scattered_indices(pool, split)
    pool.write_tokens(idx, prefix.kv_new)

    from_pool = model.prefill(tokens, pool.read_tokens(idx))
    in_memory = model.continue_from(prefix.cache, tokens)
    recompute = model.full_logits(tokens)[-1]

    assert torch.equal(from_pool.logits_last, in_memory)
    assert float((from_pool.logits_last - recompute).abs().max()) < 1e-4
    assert from_pool.kv_new.shape[2] == tokens.numel() - split


def test_decode_continues_greedily_and_matches_recompute(model: DemoModel) -> None:
    """Greedy decode picks the argmax each step; a recompute over prompt and reply agrees within 1e-4."""
    tokens = random_tokens(3 * PAGE, seed=3)
    result = model.decode(model.prefill(tokens, None), steps=5)
    assert len(result.tokens) == 5
    assert result.kv.shape[2] == 4
    assert result.tokens == [int(t) for t in result.logits.argmax(dim=-1)]
    full = model.full_logits(torch.cat([tokens, torch.tensor(result.tokens[:-1])]))
    assert float((full[-5:] - result.logits).abs().max()) < 1e-4


def test_oracle_accepts_recorded_kv_and_rejects_a_flipped_bit(model: DemoModel) -> None:
    """The oracle finds restored pages among recorded versions and reports a page with one changed bit."""
    tokens = random_tokens(4 * PAGE + 5, seed=4)
    own = model.prefill(tokens, None)
    oracle = KVOracle(PAGE)
    assert oracle.record(tokens, own.cache, 0, tokens.numel()) == 4
    assert oracle.record(tokens, own.cache, 0, tokens.numel()) == 0  # identical bits are not duplicated

    good = oracle.check(tokens, cache_from_kv(own.kv_new[:, :, : 3 * PAGE]))
    assert good.ok
    assert good.pages == 3
    assert torch.equal(good.reference_cache.layers[0].keys, own.cache.layers[0].keys[:, :, : 3 * PAGE])

    corrupt = own.kv_new[:, :, : 3 * PAGE].clone()
    corrupt.view(torch.int32)[1, 1, PAGE + 2, 0, 0] ^= 1
    bad = oracle.check(tokens, cache_from_kv(corrupt))
    assert bad.mismatched_pages == (1,)
    assert not bad.ok


def test_oracle_keeps_a_second_version_computed_in_another_chunking(model: DemoModel) -> None:
    """K/V of the same tokens computed in two chunks may round differently: both versions are accepted."""
    tokens = random_tokens(16 * PAGE, seed=5)
    oracle = KVOracle(PAGE)
    whole = model.prefill(tokens, None)
    oracle.record(tokens, whole.cache, 0, tokens.numel())
    first = model.prefill(tokens[: 7 * PAGE], None)
    chunked = model.prefill(tokens, first.kv_new)
    oracle.record(tokens, chunked.cache, 7 * PAGE, tokens.numel())
    assert oracle.check(tokens, cache_from_kv(whole.kv_new)).ok
    assert oracle.check(tokens, cache_from_kv(kv_from_cache(chunked.cache, 0, tokens.numel()))).ok
