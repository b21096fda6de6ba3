"""The memory backend: the shared contract, named stores, and its own closing and corruption rules."""

from __future__ import annotations

import gc
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator

import pytest
from contract import BackendContract, Corrupt, ReadGate, Reopen, empty_pages, make_keys, make_pages
from hostile import HostileStorage, RawStore

from storage_backends.memory import MemoryBackend, drop_named_store
from storage_backends.page_format import HEADER_SIZE
from storage_backends.protocol import PageStatus

NS = bytes(range(16))


@pytest.fixture
def store_name() -> Iterator[str]:
    """A fresh process-wide store name, dropped after the test."""
    name = f"test-{uuid.uuid4().hex}"
    yield name
    drop_named_store(name)


class TestMemoryBackend(BackendContract, HostileStorage):
    @pytest.fixture
    async def backend(self, namespace_digest: bytes, store_name: str) -> AsyncIterator[MemoryBackend]:
        async with MemoryBackend.from_url(f"memory://{store_name}", namespace_digest=namespace_digest) as b:
            yield b

    @pytest.fixture
    def reopen(self, store_name: str) -> Reopen:
        async def open_again(digest: bytes) -> MemoryBackend:
            return MemoryBackend(namespace_digest=digest, name=store_name)

        return open_again

    @pytest.fixture
    def corrupt_page(self, backend: MemoryBackend) -> Corrupt:
        return backend.corrupt

    @pytest.fixture
    def raw_store(self, backend: MemoryBackend) -> RawStore:
        pages = backend._pages  # the named store every `reopen` shares

        class Raw:
            async def read(self, key: str) -> bytes:
                return pages[key]

            async def write(self, key: str, data: bytes) -> None:
                pages[key] = data

        return Raw()

    @pytest.fixture
    def hold_reads(self, backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadGate]:
        gate = ReadGate()
        monkeypatch.setattr(backend, "_read_group", gate.in_thread(backend._read_group))
        yield gate
        gate.open()


async def test_private_stores_are_isolated() -> None:
    """`memory://` gives each backend its own pages."""
    keys, pages = make_keys(1), make_pages(1, 128)
    async with (
        MemoryBackend.from_url("memory://", namespace_digest=NS) as a,
        MemoryBackend(namespace_digest=NS) as b,
    ):
        await a.put(keys, pages)
        assert await b.exists(keys) == 0
        assert await a.exists(keys) == 1


async def test_dropping_a_named_store_starts_the_next_backend_empty(store_name: str) -> None:
    """drop_named_store forgets the pages for backends opened afterwards."""
    keys, pages = make_keys(1), make_pages(1, 128)
    async with MemoryBackend(namespace_digest=NS, name=store_name) as a:
        await a.put(keys, pages)
    assert drop_named_store(store_name) is True
    assert drop_named_store(store_name) is False
    async with MemoryBackend(namespace_digest=NS, name=store_name) as b:
        assert await b.exists(keys) == 0


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate_payload", "truncate_header"])
async def test_damaged_pages_are_misses_and_counted(damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every kind of damage is a miss, logged at warning and counted as a checksum failure."""
    keys, pages = make_keys(2), make_pages(2, 1024)
    async with MemoryBackend(namespace_digest=NS) as b:
        await b.put(keys, pages)
        if damage == "flip_payload":
            b.corrupt(keys[0], offset=HEADER_SIZE + 17)
        elif damage == "flip_header":
            b.corrupt(keys[0], offset=50)  # the checksum field
        elif damage == "truncate_payload":
            b.corrupt(keys[0], truncate=HEADER_SIZE + 100)
        else:
            b.corrupt(keys[0], truncate=HEADER_SIZE - 1)
        out = empty_pages(2, 1024, fill=7)
        assert await b.get(keys, out) == [PageStatus.CORRUPT, PageStatus.HIT]
        assert bytes(out[0]) == b"\x07" * 1024, "a bad page must not be copied into the buffer"
        stats = b.statistics()
        assert stats.checksum_failures == 1
        assert stats.pages_read == 1
        assert stats.bytes_read == 1024
    assert "discarding page" in caplog.text


async def test_statistics_and_repr() -> None:
    """Counters follow every outcome and the repr says what the backend holds."""
    keys, pages = make_keys(3), make_pages(3, 256)
    b = MemoryBackend(namespace_digest=NS, name=None)
    await b.put(keys[:2], pages[:2])
    await b.get(keys, empty_pages(3, 256))
    stats = b.statistics()
    assert (stats.pages_written, stats.bytes_written) == (2, 512)
    assert (stats.pages_read, stats.bytes_read, stats.misses) == (2, 512, 1)
    assert "open" in repr(b)
    assert "pages=2" in repr(b)
    await b.aclose()
    assert "closed" in repr(b)


def abandon_backend() -> None:
    """Open a backend and drop it without closing it."""
    MemoryBackend(namespace_digest=NS)


def test_unclosed_backend_warns() -> None:
    """A backend dropped without aclose warns with ResourceWarning; a closed one does not."""
    with pytest.warns(ResourceWarning, match="unclosed"):
        abandon_backend()


async def test_closed_backend_does_not_warn() -> None:
    """Closing is enough to silence the ResourceWarning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = MemoryBackend(namespace_digest=NS)
        await b.aclose()
        del b
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.mark.parametrize("url", ["file:///x", "memory://name/path", "memory://name?x=1"])
def test_from_url_rejects_other_urls(url: str) -> None:
    """Only memory://name opens a memory backend."""
    with pytest.raises(ValueError, match="url"):
        MemoryBackend.from_url(url, namespace_digest=NS)


@pytest.mark.parametrize("digest", [b"short", b"x" * 17])
def test_bad_namespace_digest_is_rejected(digest: bytes) -> None:
    """The namespace digest is exactly 16 bytes."""
    with pytest.raises(ValueError, match="namespace_digest"):
        MemoryBackend(namespace_digest=digest)


@pytest.mark.parametrize("key", ["../../etc", "ABCD", "ab", "abcd\nabcd", ""])
async def test_malformed_keys_are_rejected(key: str) -> None:
    """Keys are lowercase hex, as page_key makes them; anything else is a ValueError naming keys."""
    async with MemoryBackend(namespace_digest=NS) as b:
        with pytest.raises(ValueError, match="keys"):
            await b.put([key], make_pages(1, 64))
        with pytest.raises(ValueError, match="keys"):
            await b.exists(["abcd", key])
