"""The contract and hostile-storage suites for a network store (Valkey, Mooncake), from a few hooks.

A store's test class names its backend class, the options its backends open with and the method a held
read waits in, and provides two fixtures, `url` (a fresh prefix per test) and `raw` (a plain client of the
store), plus `raw_get`/`raw_set` on that client; the backend, reopen, raw-store, corrupt-page and held-read
fixtures the suites need follow from those. `assert_pages_shared_across_processes` is the two-process
sharing scenario both stores run through the real controller.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio.to_thread
import pytest
from contract import BackendContract, Corrupt, ReadGate, Reopen
from hostile import HostileStorage, RawStore
from net_instance import run_instance

from storage_backends.lifecycle import BackendLifecycle


class NetworkStoreContract(BackendContract, HostileStorage):
    """`BackendContract` and `HostileStorage` for a network store's backend (see the module)."""

    backend_class: ClassVar[Any]
    """The backend class: opened with `from_url(url, namespace_digest=..., **options)`."""
    options: ClassVar[dict[str, Any]] = {}
    """Options every backend of the suite opens with."""
    held_read: ClassVar[str]
    """The backend method that `hold_reads` holds at its gate."""
    held_in_thread: ClassVar[bool]
    """Whether `held_read` runs in a worker thread (else it is a coroutine function)."""

    def raw_get(self, raw: Any, backend: Any, key: str) -> bytes:
        """The stored value of page `key`, read with the plain client `raw` (blocking)."""
        raise NotImplementedError

    def raw_set(self, raw: Any, backend: Any, key: str, data: bytes) -> None:
        """Store `data` as page `key`'s value with the plain client `raw` (blocking)."""
        raise NotImplementedError

    @pytest.fixture
    async def backend(self, url: str, namespace_digest: bytes) -> AsyncIterator[BackendLifecycle]:
        async with self.backend_class.from_url(url, namespace_digest=namespace_digest, **self.options) as b:
            yield b

    @pytest.fixture
    def reopen(self, url: str) -> Reopen:
        async def open_again(digest: bytes) -> Any:
            return self.backend_class.from_url(url, namespace_digest=digest, **self.options)

        return open_again

    @pytest.fixture
    def raw_store(self, raw: Any, backend: Any) -> RawStore:
        suite = self

        class Raw:
            async def read(self, key: str) -> bytes:
                return await anyio.to_thread.run_sync(suite.raw_get, raw, backend, key)

            async def write(self, key: str, data: bytes) -> None:
                await anyio.to_thread.run_sync(suite.raw_set, raw, backend, key, data)

        return Raw()

    @pytest.fixture
    def corrupt_page(self, raw: Any, backend: Any) -> Corrupt:
        def flip_last_byte(key: str) -> None:
            body = bytearray(self.raw_get(raw, backend, key))
            body[-1] ^= 0x01
            self.raw_set(raw, backend, key, bytes(body))

        return flip_last_byte

    @pytest.fixture
    def hold_reads(self, backend: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadGate]:
        gate = ReadGate()
        method = getattr(backend, self.held_read)
        monkeypatch.setattr(
            backend, self.held_read, gate.in_thread(method) if self.held_in_thread else gate.awaited(method)
        )
        yield gate
        gate.open()


def assert_pages_shared_across_processes(url: str, tmp_path: Path) -> None:
    """Instance A (its own process, the real controller) writes its pages through to the store at `url`;
    B, a fresh process, prefetches them byte-identical; C, another model's namespace, finds none of them."""
    a = run_instance("produce", url, tmp_path / "a.json")
    assert a["storage"]["pages_written"] == 12
    assert a["storage"]["errors"] == 0
    b = run_instance("consume", url, tmp_path / "b.json")
    assert b["requests"][0]["hits"]["storage"] == 128
    assert all(r["matches_payload"] for r in b["requests"])
    assert b["storage"]["pages_read"] == 12
    c = run_instance("consume", url, tmp_path / "c.json", model="other")
    assert all(r["hits"]["storage"] == 0 for r in c["requests"])
    assert c["storage"]["pages_read"] == 0
