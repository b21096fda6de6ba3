"""The file backend: the shared contract plus what only files can get wrong.

Key escaping, truncated and flipped files, temporary files left by atomic writes, sharing pages with
another process, and the guarantee that a cancelled get waits for its worker thread.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import xxhash
from contract import BackendContract, Corrupt, Reopen, empty_pages, make_keys, make_pages

from storage_backends.file import FileBackend
from storage_backends.page_format import HEADER_SIZE

NS = bytes(range(16))


def files_under(root: Path) -> list[Path]:
    """Every regular file under `root`, hidden ones included."""
    return sorted(p for p in root.rglob("*") if p.is_file())


class TestFileBackend(BackendContract):
    @pytest.fixture
    async def backend(self, namespace_digest: bytes, tmp_path: Path) -> AsyncIterator[FileBackend]:
        async with FileBackend(tmp_path / "pages", namespace_digest=namespace_digest) as b:
            yield b

    @pytest.fixture
    def reopen(self, tmp_path: Path) -> Reopen:
        async def open_again(digest: bytes) -> FileBackend:
            return FileBackend.from_url(f"file://{tmp_path / 'pages'}", namespace_digest=digest)

        return open_again

    @pytest.fixture
    def corrupt_page(self, backend: FileBackend) -> Corrupt:
        def flip_last_byte(key: str) -> None:
            path = backend.path_of(key)
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))

        return flip_last_byte


class TestDurableFileBackend(TestFileBackend):
    """The same contract with fsync on every page and directory."""

    @pytest.fixture
    async def backend(self, namespace_digest: bytes, tmp_path: Path) -> AsyncIterator[FileBackend]:
        async with FileBackend(tmp_path / "pages", namespace_digest=namespace_digest, durable=True) as b:
            yield b


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[FileBackend]:
    """An open file backend under a temporary root."""
    async with FileBackend(tmp_path / "root", namespace_digest=NS, max_concurrency=4) as b:
        yield b


def test_pages_live_in_sharded_directories(tmp_path: Path) -> None:
    """root/ab/cd/<key>.kvp, so no directory holds more than 256 subdirectories."""
    b = FileBackend(tmp_path, namespace_digest=NS)
    try:
        key = "abcdef0123456789"
        assert b.path_of(key) == tmp_path / "ab" / "cd" / f"{key}.kvp"
    finally:
        anyio.run(b.aclose)


@pytest.mark.parametrize(
    "key",
    ["../../../../etc/passwd", "abcd/../../x", "/etc/passwd", "ABCDEF", "ab", "", "abcd\nef01", "abcd.kvp"],
)
async def test_keys_cannot_escape_the_root(backend: FileBackend, key: str, tmp_path: Path) -> None:
    """Every operation refuses a key that is not lowercase hex, before touching the filesystem."""
    page = make_pages(1, 64)
    with pytest.raises(ValueError, match="keys"):
        await backend.put([key], page)
    with pytest.raises(ValueError, match="keys"):
        await backend.get([key], empty_pages(1, 64))
    with pytest.raises(ValueError, match="keys"):
        await backend.exists(["abcd", key])
    with pytest.raises(ValueError, match="keys"):
        await backend.delete([key])
    assert files_under(tmp_path) == []


@pytest.mark.parametrize(
    "length", [0, 7, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 100, HEADER_SIZE + 4095]
)
async def test_truncated_files_are_misses_and_counted(
    backend: FileBackend, length: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A file cut short anywhere (a crashed copy, a full disk) is a miss, logged and counted."""
    keys, pages = make_keys(2), make_pages(2, 4096)
    await backend.put(keys, pages)
    os.truncate(backend.path_of(keys[0]), length)
    assert await backend.get(keys, empty_pages(2, 4096)) == [False, True]
    stats = backend.statistics()
    assert stats.checksum_failures == 1
    assert stats.pages_read == 1
    assert "discarding page" in caplog.text


async def test_flipped_bytes_at_random_pages_are_misses(backend: FileBackend) -> None:
    """One flipped byte anywhere in a file (header or payload) turns that page, and only it, into a miss."""
    rng = random.Random(1234)
    n, page_bytes = 40, 4096
    keys, pages = make_keys(n), make_pages(n, page_bytes)
    await backend.put(keys, pages)
    damaged = sorted(rng.sample(range(n), 12))
    for i in damaged:
        path = backend.path_of(keys[i])
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    out = empty_pages(n, page_bytes)
    assert await backend.get(keys, out) == [i not in damaged for i in range(n)]
    assert all(bytes(out[i]) == bytes(pages[i]) for i in range(n) if i not in damaged)
    stats = backend.statistics()
    assert stats.checksum_failures == len(damaged)
    assert stats.pages_read == n - len(damaged)
    assert stats.misses == 0


async def test_writes_leave_no_temporary_files(backend: FileBackend) -> None:
    """Each page is a temporary file renamed into place: afterwards only .kvp files remain."""
    keys, pages = make_keys(20), make_pages(20, 1000)
    await backend.put(keys, pages)
    await backend.put(keys[:5], pages[:5])
    names = [p.name for p in files_under(backend.root)]
    assert sorted(names) == sorted(f"{k}.kvp" for k in keys)


async def test_failed_rename_reports_false_and_cleans_up(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When the final rename fails the page is False, counted as an error, and its temp file is gone."""
    keys, pages = make_keys(3), make_pages(3, 512)
    await backend.put(keys[:1], pages[:1])

    def refuse(src: str, dst: str) -> None:
        raise PermissionError(13, "refused", dst)

    monkeypatch.setattr(os, "replace", refuse)
    assert await backend.put(keys, pages) == [False, False, False]
    monkeypatch.undo()
    assert backend.statistics().errors == 3
    assert [p.name for p in files_under(backend.root)] == [f"{keys[0]}.kvp"]
    out = empty_pages(1, 512)
    assert await backend.get(keys[:1], out) == [True]
    assert bytes(out[0]) == bytes(pages[0]), "the old version survives a failed overwrite"
    assert "cannot write page" in caplog.text


async def test_another_process_reads_the_pages_bitwise(backend: FileBackend) -> None:
    """A fresh interpreter opening the same root reads exactly the bytes this one wrote."""
    keys, pages = make_keys(6), make_pages(6, 65536, seed=5)
    await backend.put(keys, pages)
    script = (
        "import anyio, sys, xxhash\n"
        "from storage_backends.file import FileBackend\n"
        "async def main():\n"
        "    keys = sys.argv[2:]\n"
        "    bufs = [memoryview(bytearray(65536)) for _ in keys]\n"
        "    async with FileBackend(sys.argv[1], namespace_digest=bytes(range(16))) as b:\n"
        "        ok = await b.get(keys, bufs)\n"
        "    print(ok.count(True), *(xxhash.xxh3_64_hexdigest(buf) for buf in bufs))\n"
        "anyio.run(main)\n"
    )
    result = await anyio.run_process([sys.executable, "-c", script, str(backend.root), *keys])
    count, *digests = result.stdout.decode().split()
    assert int(count) == len(keys)
    assert digests == [xxhash.xxh3_64_hexdigest(p) for p in pages]


async def test_cancelled_get_waits_for_its_worker_thread(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled get does not return while its thread is still reading into the caller's buffer.

    The read is held at a gate inside the worker thread; the get is cancelled; it must stay pending
    until the gate opens and the thread finishes, so the buffer is final once get returns.
    """
    keys, pages = make_keys(1), make_pages(1, 4096)
    await backend.put(keys, pages)
    entered, gate = threading.Event(), threading.Event()
    real_read_one = backend._read_one

    def gated_read_one(key: str, buf: memoryview) -> int:
        entered.set()
        assert gate.wait(timeout=30), "test gate never opened"
        return real_read_one(key, buf)

    monkeypatch.setattr(backend, "_read_one", gated_read_one)
    out = empty_pages(1, 4096)
    returned = anyio.Event()
    scope = anyio.CancelScope()

    async def reader() -> None:
        with scope:
            await backend.get(keys, out)
        returned.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.to_thread.run_sync(entered.wait)
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert not returned.is_set(), "get returned while its thread was still reading"
        assert bytes(out[0]) == b"\x00" * 4096
        gate.set()
        await returned.wait()
    # The get may finish normally (the thread completed its work) or raise the cancellation; either way
    # the thread's write landed before get returned.
    assert bytes(out[0]) == bytes(pages[0]), "the thread finished its write before get returned"


async def test_statistics_and_repr(backend: FileBackend) -> None:
    """Counters follow every outcome; the repr names the root, the state and the counters."""
    keys, pages = make_keys(3), make_pages(3, 2048)
    await backend.put(keys[:2], pages[:2])
    await backend.get(keys, empty_pages(3, 2048))
    stats = backend.statistics()
    assert (stats.pages_written, stats.bytes_written) == (2, 4096)
    assert (stats.pages_read, stats.bytes_read, stats.misses, stats.errors) == (2, 4096, 1, 0)
    text = repr(backend)
    assert str(backend.root) in text
    assert "open" in text
    assert "misses=1" in text


async def test_buffers_of_any_format_round_trip(backend: FileBackend) -> None:
    """Buffers need not be bytes: a float32 2-D view of a page works, including short-read recovery."""
    import torch

    src = torch.arange(1024, dtype=torch.float32).reshape(32, 32)
    dst = torch.zeros_like(src)
    keys = make_keys(1)
    assert await backend.put(keys, [src.numpy().data]) == [True]
    assert await backend.get(keys, [dst.numpy().data]) == [True]
    assert torch.equal(src, dst)


def abandon_backend(root: Path) -> None:
    """Open a backend and drop it without closing it."""
    FileBackend(root, namespace_digest=NS)


def test_unclosed_backend_warns(tmp_path: Path) -> None:
    """A backend dropped without aclose warns with ResourceWarning."""
    with pytest.warns(ResourceWarning, match="unclosed"):
        abandon_backend(tmp_path)


async def test_closed_backend_does_not_warn(tmp_path: Path) -> None:
    """Closing is enough to silence the ResourceWarning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = FileBackend(tmp_path, namespace_digest=NS)
        await b.aclose()
        del b
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.mark.parametrize("url", ["memory://x", "file://host/tmp/x", "file:relative/path"])
def test_from_url_rejects_other_urls(url: str) -> None:
    """Only file:///absolute/path opens a file backend."""
    with pytest.raises(ValueError, match="url"):
        FileBackend.from_url(url, namespace_digest=NS)


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    """Misuse at construction raises ValueError naming the argument."""
    with pytest.raises(ValueError, match="max_concurrency"):
        FileBackend(tmp_path, namespace_digest=NS, max_concurrency=0)
    with pytest.raises(ValueError, match="namespace_digest"):
        FileBackend(tmp_path, namespace_digest=b"short")
