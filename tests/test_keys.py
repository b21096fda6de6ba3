"""Token keys: every accepted form converts to the same int64 bytes, and the bytes are a reusable key.

Issue 12: numpy integer arrays were refused as tokens; a list was converted on every call that took it. Now
numpy arrays of any integer dtype are accepted (bad dtype or shape raise naming the argument), and the
converted bytes are accepted everywhere tokens are, without another conversion.
"""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes, chained_page_keys

INT64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)


@given(st.lists(INT64, max_size=300))
def test_every_form_converts_to_the_same_bytes(ids: list[int]) -> None:
    """A list, a tuple, `array('q')`, a tensor, a numpy array and the bytes themselves agree."""
    expected = array("q", ids).tobytes()
    assert as_key_bytes(ids) == expected
    assert as_key_bytes(tuple(ids)) == expected
    assert as_key_bytes(array("q", ids)) == expected
    assert as_key_bytes(torch.tensor(ids, dtype=torch.int64)) == expected
    assert as_key_bytes(np.array(ids, dtype=np.int64)) == expected
    assert as_key_bytes(expected) is expected, "a converted key is taken as it is, not copied or converted"


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
)
def test_numpy_arrays_of_every_integer_dtype_are_accepted(dtype: type[np.integer]) -> None:
    """Tokens as a numpy array of any integer dtype, contiguous or strided, give the list's key."""
    ids = [random.Random(7).randrange(100) for _ in range(64)]
    arr = np.array(ids, dtype=dtype)
    assert as_key_bytes(arr) == as_key_bytes(ids)
    strided = np.array([x for i in ids for x in (i, 0)], dtype=dtype)[::2]
    assert as_key_bytes(strided) == as_key_bytes(ids)


def test_numpy_scalars_inside_a_list_are_ints() -> None:
    assert as_key_bytes([np.int64(5), np.int32(6), 7]) == array("q", [5, 6, 7]).tobytes()


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [
        (np.zeros((2, 4), dtype=np.int64), ValueError, r"^tokens: expected a 1-D array, got shape \(2, 4\)"),
        (np.zeros(4, dtype=np.float32), TypeError, r"^tokens: expected an integer array, got dtype float32"),
        (np.zeros(4, dtype=bool), TypeError, r"^tokens: expected an integer array, got dtype bool"),
        (np.array([1, 1 << 63], dtype=np.uint64), ValueError, r"^tokens: token ids must fit in int64"),
        ([1, 2.5], TypeError, r"^tokens: expected a sequence of ints"),
        (["1"], TypeError, r"^tokens: expected a sequence of ints"),
        ((1, 1 << 64), ValueError, r"^tokens: token ids must fit in int64"),
        ("abc", TypeError, r"^tokens: expected token ids, got str"),
        (b"1234567", ValueError, r"^tokens: bytes length must be a multiple of 8"),
    ],
    ids=["2-d", "float", "bool", "uint64-high", "list-float", "list-str", "tuple-2**64", "str", "bytes-7"],
)
def test_bad_tokens_raise_naming_the_argument(tokens: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        as_key_bytes(tokens, name="tokens")  # type: ignore[arg-type]


def test_keys_of_many_lengths_stay_correct() -> None:
    """The per-length packers are bounded and rebuilt: keys of many lengths all convert right."""
    for n in range(0, 5000, 7):
        ids = list(range(n))
        assert as_key_bytes(ids) == array("q", ids).tobytes()


async def test_the_cache_takes_numpy_tokens_and_a_converted_key_alike() -> None:
    """`acquire`, `match` and `insert` take a list, a numpy array or the converted bytes, with one result."""
    config = HiCacheConfig(layout=KVLayout.flat(8, 4), device_pages=64, host_pages=64)
    ids = list(range(100, 132))
    key = as_key_bytes(ids, name="tokens")
    async with HiCache(config) as cache:
        lease = await cache.acquire("first", np.array(ids, dtype=np.int32))
        assert lease.key == key
        indices = await cache.alloc_device(len(ids))
        assert indices is not None
        await cache.insert(lease, key, indices)
        for i, tokens in enumerate((ids, np.array(ids, dtype=np.uint16), key, torch.tensor(ids))):
            assert cache.match(tokens).device_len == len(ids)
            hit = await cache.acquire(f"again-{i}", tokens)
            assert (hit.cached_len, hit.key) == (len(ids), key)
            cache.release(hit)
        cache.sanity_check()


async def test_the_cache_names_tokens_for_a_bad_numpy_array() -> None:
    config = HiCacheConfig(layout=KVLayout.flat(8, 4), device_pages=8, host_pages=8)
    async with HiCache(config) as cache:
        with pytest.raises(TypeError, match=r"^tokens: expected an integer array, got dtype float64"):
            await cache.acquire("r", np.zeros(8))
        with pytest.raises(ValueError, match=r"^tokens: expected a 1-D array"):
            await cache.acquire("r", np.zeros((2, 4), dtype=np.int64))
        cache.sanity_check()


@pytest.mark.parametrize("pages", [0, 1, 3, 1024])
def test_page_keys_are_the_page_hashes_in_hex(pages: int) -> None:
    """`chained_page_keys` (built in C with the hashes) gives exactly `chained_page_hashes` and, aligned with
    them, their lowercase hex: the storage keys every backend and every other instance look pages up by."""
    namespace = Namespace(model_id="keys")
    key = as_key_bytes(list(range(7, 7 + pages * 4 + 3)))  # a trailing partial page gets no hash
    prev = chained_page_hashes(as_key_bytes([1, 2, 3, 4]), 4, namespace)[0]
    for start in (ROOT_HASH, prev):
        hashes, keys = chained_page_keys(key, 4, namespace, start)
        assert hashes == chained_page_hashes(key, 4, namespace, start)
        assert keys == [h.hex() for h in hashes]
        assert all(type(k) is str and len(k) == 32 for k in keys)


def test_page_keys_refuse_what_page_hashes_refuse() -> None:
    """A bad page size or previous hash raises naming the argument, as for the hashes alone."""
    namespace = Namespace()
    with pytest.raises(ValueError, match="page_size"):
        chained_page_keys(b"", 0, namespace)
    with pytest.raises(ValueError, match="prev"):
        chained_page_keys(b"", 4, namespace, b"short")
