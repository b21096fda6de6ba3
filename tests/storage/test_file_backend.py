"""The file backend: the shared contract plus what only files can get wrong.

Key escaping, truncated and flipped files, temporary files left by atomic writes, sharing pages with
another process, and the guarantee that a cancelled get waits for its worker thread.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import ParamSpec, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import xxhash
from contract import BackendContract, Corrupt, ReadGate, Reopen, empty_pages, make_keys, make_pages
from hostile import VARIANTS, HostileStorage, RawStore, base_config, v1_page
from hypothesis import given, settings
from hypothesis import strategies as st
from page_damage import flip_page_byte, group_file, page_bytes, rewrite_page

from hicache.errors import StorageAuthError, StorageError
from storage_backends import native
from storage_backends.file import FileBackend, default_concurrency
from storage_backends.file_pages import GROUP_ENTRY, GROUP_FOOTER, PageFiles
from storage_backends.page_format import FORMAT_VERSION, HEADER_SIZE, MAGIC, encode_header, key_digest
from storage_backends.protocol import PageStatus
from storage_backends.threads import stray_threads

NS = bytes(range(16))
P = ParamSpec("P")
T = TypeVar("T")


def _read_as_usual(keys: tuple[str, ...]) -> None:
    """The read threads' hook doing nothing: the read goes on as usual (a gate wraps it)."""


def files_under(root: Path) -> list[Path]:
    """Every regular file under `root`, hidden ones included."""
    return sorted(p for p in root.rglob("*") if p.is_file())


class TestFileBackend(BackendContract, HostileStorage):
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
            flip_page_byte(backend, key, backend.page_extent(key)[2] - 1)

        return flip_last_byte

    @pytest.fixture
    def raw_store(self, backend: FileBackend) -> RawStore:
        class Raw:
            """A page's stored bytes are its header and payload (`page_bytes`); a page written raw gets a
            group file of its own whose table names the key its header names (a page copied over another
            key's name), and bytes that are no v2 page are written as they are (an old one-file page)."""

            async def read(self, key: str) -> bytes:
                return page_bytes(backend, key)

            async def write(self, key: str, data: bytes) -> None:
                path = backend.path_of(key)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)  # never write into a group file other pages share
                if data[:4] == MAGIC and data[4:5] == bytes([FORMAT_VERSION]) and len(data) >= HEADER_SIZE:
                    data = group_file([(data[24:40], data)])
                path.write_bytes(data)

        return Raw()

    @pytest.fixture
    def hold_reads(self, backend: FileBackend, monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadGate]:
        gate = ReadGate()
        monkeypatch.setattr(backend, "_before_read", gate.in_thread(_read_as_usual))
        yield gate
        gate.open()


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


def test_pages_live_in_one_level_of_directories(tmp_path: Path) -> None:
    """root/ab/<key>.kvp: 256 directories, made once. The two-level layout (root/ab/cd/) made a fresh
    directory for nearly every page a filling store wrote, and each mkdir cost the writer as much kernel
    CPU as the page's own file (issue 25)."""
    b = FileBackend(tmp_path, namespace_digest=NS)
    try:
        key = "abcdef0123456789"
        assert b.path_of(key) == tmp_path / "ab" / f"{key}.kvp"
    finally:
        anyio.run(b.aclose)


async def test_writes_make_no_directory_per_page(backend: FileBackend) -> None:
    """Pages whose keys differ past their first hex pair share one directory: 64 pages under one pair
    make one directory, and every page is read back from it."""
    keys = [f"ab{i:02x}" + "0" * 28 for i in range(64)]
    pages = make_pages(64, 64)
    assert all(await backend.put(keys, pages))
    assert sorted(p.name for p in backend.root.iterdir()) == ["ab"]
    assert not [p for p in (backend.root / "ab").iterdir() if not p.is_file()]
    out = [memoryview(bytearray(64)) for _ in keys]
    assert await backend.get(keys, out) == [PageStatus.HIT] * 64
    assert [bytes(o) for o in out] == [bytes(p) for p in pages]


async def test_a_page_in_the_old_two_level_layout_is_a_miss(backend: FileBackend) -> None:
    """A page file a server of the two-level layout wrote (root/ab/cd/<key>.kvp) is absent for this one:
    `exists` counts 0 and `get` misses (no error, no read of the old file), and `put` writes the page at
    its new path, leaving the old file alone."""
    key = "abcd" + "0" * 28
    old = backend.root / "ab" / "cd" / f"{key}.kvp"
    old.parent.mkdir(parents=True)
    page = make_pages(1, 64)
    old.write_bytes(encode_header(page[0], NS, key) + bytes(page[0]))
    assert await backend.exists([key]) == 0
    out = [memoryview(bytearray(64))]
    assert await backend.get([key], out) == [PageStatus.MISS]
    assert all(await backend.put([key], page))
    assert await backend.exists([key]) == 1
    assert await backend.get([key], out) == [PageStatus.HIT]
    assert bytes(out[0]) == bytes(page[0])
    assert old.is_file()
    assert backend.path_of(key).is_file()


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
    with pytest.raises(ValueError, match=r"^key: "):
        backend.path_of(key)
    with pytest.raises(ValueError, match=r"^key: "):
        backend.page_extent(key)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize(
    "length", [0, 7, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 100, HEADER_SIZE + 4095]
)
async def test_truncated_files_are_misses_and_counted(
    backend: FileBackend, length: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A page cut short anywhere (a crashed copy, a full disk) is a miss, logged and counted; the page
    written beside it in its group still loads."""
    keys, pages = make_keys(2), make_pages(2, 4096)
    await backend.put(keys, pages)
    rewrite_page(backend, keys[0], lambda data: data[:length])
    assert await backend.get(keys, empty_pages(2, 4096)) == [PageStatus.CORRUPT, PageStatus.HIT]
    stats = backend.statistics()
    assert stats.checksum_failures == 1
    assert stats.pages_read == 1
    assert "discarding page" in caplog.text


async def test_flipped_bytes_at_random_pages_are_misses(backend: FileBackend) -> None:
    """One flipped byte anywhere in a page (header or payload) turns that page, and only it, into a miss,
    though its group file holds the others."""
    rng = random.Random(1234)
    n, size = 40, 4096
    keys, pages = make_keys(n), make_pages(n, size)
    await backend.put(keys, pages)
    damaged = sorted(rng.sample(range(n), 12))
    for i in damaged:
        flip_page_byte(backend, keys[i], rng.randrange(HEADER_SIZE + size))
    out = empty_pages(n, size)
    assert [bool(s) for s in await backend.get(keys, out)] == [i not in damaged for i in range(n)]
    assert all(bytes(out[i]) == bytes(pages[i]) for i in range(n) if i not in damaged)
    stats = backend.statistics()
    assert stats.checksum_failures + stats.foreign_pages + stats.old_format_pages == len(damaged)
    assert stats.pages_read == n - len(damaged)
    assert stats.misses == 0


async def test_writes_leave_no_temporary_files(backend: FileBackend) -> None:
    """Each group is a temporary file whose name goes once its pages are linked: afterwards only .kvp names
    remain (an overwrite's per-page temporary link is renamed over the old name)."""
    keys, pages = make_keys(20), make_pages(20, 1000)
    await backend.put(keys, pages)
    await backend.put(keys[:5], pages[:5])
    names = [p.name for p in files_under(backend.root)]
    assert sorted(names) == sorted(f"{k}.kvp" for k in keys)


async def test_failed_rename_reports_false_and_cleans_up(
    backend: FileBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """When a page's name cannot be given (a directory that is not empty sits at the page's path: the C
    writer's rename fails with EISDIR or ENOTEMPTY and its rmdir too) the page is False, counted as an
    error, and no temporary name is left; the rest of the group is written."""
    keys, pages = make_keys(3), make_pages(3, 512)
    for key in keys[1:]:
        backend.path_of(key).mkdir(parents=True)
        (backend.path_of(key) / "keep").write_bytes(b"")
    assert await backend.put(keys, pages) == [True, False, False]
    assert backend.statistics().errors == 2
    assert sorted(p.name for p in files_under(backend.root)) == sorted([f"{keys[0]}.kvp", "keep", "keep"])
    out = empty_pages(1, 512)
    assert await backend.get(keys[:1], out) == [PageStatus.HIT]
    assert bytes(out[0]) == bytes(pages[0])
    assert "cannot write page" in caplog.text


async def test_the_c_writer_writes_exactly_what_page_format_describes(backend: FileBackend) -> None:
    """A group the C writer (`native.write_group`) wrote is byte for byte each page's `encode_header` +
    payload, then the table and footer docs/storage.md describes, for pages of several sizes in one group
    (headers, key digests and the table's checksum are computed in C); every page's name is a link to it."""
    sizes = [0, 1, 4096, 65536 + 7]
    keys = make_keys(len(sizes))
    pages = [make_pages(1, size, seed=i)[0] for i, size in enumerate(sizes)]
    assert await backend.put(keys, pages) == [True] * len(keys)
    expected = group_file(
        [(key_digest(k), encode_header(p, NS, k) + bytes(p)) for k, p in zip(keys, pages, strict=True)]
    )
    assert {backend.path_of(k).read_bytes() for k in keys} == {expected}
    assert {backend.path_of(k).stat().st_ino for k in keys} == {backend.path_of(keys[0]).stat().st_ino}
    assert backend.path_of(keys[0]).stat().st_nlink == len(keys)


async def test_a_page_directory_removed_behind_the_writers_back_is_recreated(backend: FileBackend) -> None:
    """The writer remembers the directories it made; one removed since (ENOENT in the C writer) is made
    again and the page written."""
    keys, pages = make_keys(2), make_pages(2, 512)
    assert await backend.put(keys[:1], pages[:1]) == [True]
    shutil.rmtree(backend.root)
    assert await backend.put(keys, pages) == [True, True]
    out = empty_pages(2, 512)
    assert await backend.get(keys, out) == [PageStatus.HIT, PageStatus.HIT]


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
        "    print(sum(map(bool, ok)), *(xxhash.xxh3_64_hexdigest(buf) for buf in bufs))\n"
        "anyio.run(main)\n"
    )
    result = await anyio.run_process([sys.executable, "-c", script, str(backend.root), *keys])
    count, *digests = result.stdout.decode().split()
    assert int(count) == len(keys)
    assert digests == [xxhash.xxh3_64_hexdigest(p) for p in pages]


async def test_cancelled_get_returns_at_once_and_registers_its_stray_thread(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled get returns while its thread is stuck, and the buffer stays busy until the thread returns.

    The read is held at a gate inside the worker thread (a hung mount); the get is cancelled; it returns
    at once, `stray_threads` reports the caller's buffer busy (and no other), and once the gate opens and
    the thread finishes, the buffer is quiet again and holds what the thread wrote.
    """
    keys, pages = make_keys(1), make_pages(1, 4096)
    await backend.put(keys, pages)
    entered, gate = threading.Event(), threading.Event()

    def gated(keys: tuple[str, ...]) -> None:
        entered.set()
        assert gate.wait(timeout=30), "test gate never opened"

    monkeypatch.setattr(backend, "_before_read", gated)
    out = empty_pages(1, 4096)
    other = empty_pages(1, 4096)
    strays = stray_threads.count
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(backend.get, keys, out)
                await anyio.to_thread.run_sync(entered.wait)
                scope.cancel()
        assert scope.cancelled_caught
        assert stray_threads.busy(out), "the stuck thread's buffer is not reported busy"
        assert not stray_threads.busy(other)
        assert stray_threads.count == strays + 1
    finally:
        gate.set()
    with anyio.fail_after(30):
        await stray_threads.wait_quiet(out)
    assert stray_threads.count == strays
    assert bytes(out[0]) == bytes(pages[0]), "the thread's write landed before its buffer was quiet"


async def test_a_cancelled_get_withdraws_its_groups_not_started(tmp_path: Path) -> None:
    """With the only read thread held, a second get's group waits in the read queue; cancelling that get
    withdraws it: it never starts (the hook never sees its keys), no stray is registered, and its buffer is
    never written. The held read then finishes normally."""
    async with FileBackend(tmp_path / "pages", namespace_digest=NS, max_concurrency=1) as backend:
        keys, pages = make_keys(2), make_pages(2, 4096)
        await backend.put(keys, pages)
        entered, gate = threading.Event(), threading.Event()
        seen: list[tuple[str, ...]] = []

        def hook(group: tuple[str, ...]) -> None:
            seen.append(group)
            if keys[0] in group:
                entered.set()
                assert gate.wait(timeout=30), "test gate never opened"

        backend._before_read = hook
        held, queued = empty_pages(1, 4096), empty_pages(1, 4096)
        strays = stray_threads.count
        second = anyio.CancelScope()

        async def queued_get() -> None:
            with second:
                await backend.get(keys[1:], queued)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(backend.get, keys[:1], held)
                await anyio.to_thread.run_sync(entered.wait)
                tg.start_soon(queued_get)
                await anyio.wait_all_tasks_blocked()  # its group is queued behind the held one
                second.cancel()
                await anyio.wait_all_tasks_blocked()
                gate.set()
        assert second.cancelled_caught
        assert seen == [(keys[0],)]
        assert stray_threads.count == strays
        assert bytes(held[0]) == bytes(pages[0])
        assert bytes(queued[0]) == bytes(4096)


async def test_a_stuck_read_does_not_take_a_thread_from_the_others(tmp_path: Path) -> None:
    """A read stuck in its thread (a hung mount) and abandoned by its cancelled caller leaves the backend a
    thread short no longer: a worker is added meanwhile, so the next get loads while the stuck one still
    hangs; once it returns, its buffer is quiet and the extra worker leaves."""
    async with FileBackend(tmp_path / "pages", namespace_digest=NS, max_concurrency=1) as backend:
        keys, pages = make_keys(2), make_pages(2, 4096)
        await backend.put(keys, pages)
        entered, gate = threading.Event(), threading.Event()

        def hook(group: tuple[str, ...]) -> None:
            if keys[0] in group:
                entered.set()
                assert gate.wait(timeout=30), "test gate never opened"

        backend._before_read = hook
        stuck, other = empty_pages(1, 4096), empty_pages(1, 4096)
        try:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(backend.get, keys[:1], stuck)
                    await anyio.to_thread.run_sync(entered.wait)
                    scope.cancel()
            assert stray_threads.busy(stuck)
            with anyio.fail_after(30):
                assert await backend.get(keys[1:], other) == [PageStatus.HIT]
            assert bytes(other[0]) == bytes(pages[1])
            assert backend._workers.threads == 2
        finally:
            gate.set()
        with anyio.fail_after(30):
            await stray_threads.wait_quiet(stuck)
        assert backend._workers.stray == 0


async def test_spare_read_threads_are_capped_on_a_hung_mount(tmp_path: Path) -> None:
    """On a mount where every read hangs, each get abandoned while reading started one more worker, without
    bound (issue 22, item 4). Now spares stop at the base thread count: with one thread, the second stuck
    read gets no spare, a third get waits queued behind the stuck ones and is withdrawn when cancelled,
    and once the reads return, their spare retires and a get loads again."""
    async with FileBackend(tmp_path / "pages", namespace_digest=NS, max_concurrency=1) as backend:
        keys, pages = make_keys(4), make_pages(4, 4096)
        await backend.put(keys, pages)
        entered = {key: threading.Event() for key in keys}
        gate = threading.Event()

        def hang(group: tuple[str, ...]) -> None:
            if keys[3] not in group:
                entered[group[0]].set()
                assert gate.wait(timeout=30), "test gate never opened"

        backend._before_read = hang
        out = empty_pages(4, 4096)
        try:
            for i in range(2):  # two reads stuck in their threads, abandoned by their callers
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(backend.get, keys[i : i + 1], out[i : i + 1])
                        await anyio.to_thread.run_sync(entered[keys[i]].wait)
                        scope.cancel()
            reader = backend._workers
            assert (reader.threads, reader.spares, reader.stray) == (2, 1, 2)
            with anyio.CancelScope() as scope:  # every worker stuck: this one queues
                async with anyio.create_task_group() as tg:
                    tg.start_soon(backend.get, keys[2:3], out[2:3])
                    await anyio.wait_all_tasks_blocked()
                    assert not entered[keys[2]].is_set()
                    scope.cancel()
            assert (reader.threads, reader.spares, reader.stray) == (2, 1, 2)
            assert not stray_threads.busy(out[2:3])
            assert "spares=1/1" in repr(reader)
        finally:
            gate.set()
        with anyio.fail_after(30):
            await stray_threads.wait_quiet(out[:2])
            assert await backend.get(keys[3:], out[3:]) == [PageStatus.HIT]
        assert bytes(out[3]) == bytes(pages[3])
        assert (backend._workers.spares, backend._workers.stray) == (0, 0)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.sampled_from(["abandon", "release"]), max_size=8))
def test_spares_follow_the_stuck_reads_they_were_started_for(
    tmp_path_factory: pytest.TempPathFactory, ops: list[str]
) -> None:
    """Any sequence of reads abandoned while stuck and stuck reads returning, on two threads: a read that
    finds a free worker starts and, abandoned, gets a spare while fewer than two are alive; one that finds
    every worker stuck queues and is withdrawn; a returning read retires its own spare, if it had one. The
    spare count and the stray count follow that model after every step, and at the end both are 0."""
    root = tmp_path_factory.mktemp("spares")

    async def scenario() -> None:
        async with FileBackend(root, namespace_digest=NS, max_concurrency=2) as backend:
            keys, pages = make_keys(len(ops) + 1), make_pages(len(ops) + 1, 512)
            assert await backend.put(keys, pages) == [True] * len(keys)
            entered = {key: threading.Event() for key in keys}
            gates = {key: threading.Event() for key in keys}

            def hang(group: tuple[str, ...]) -> None:
                entered[group[0]].set()
                assert gates[group[0]].wait(timeout=30), "test gate never opened"

            backend._before_read = hang
            out = empty_pages(len(keys), 512)
            stuck: list[tuple[int, bool]] = []  # the model: (page, got a spare) of each stuck read
            spares = 0
            try:
                for i, op in enumerate(ops):
                    if op == "abandon":
                        starts = len(stuck) < 2 + spares
                        with anyio.CancelScope() as scope:
                            async with anyio.create_task_group() as tg:
                                tg.start_soon(backend.get, keys[i : i + 1], out[i : i + 1])
                                if starts:
                                    await anyio.to_thread.run_sync(entered[keys[i]].wait, 30)
                                else:
                                    await anyio.wait_all_tasks_blocked()
                                scope.cancel()
                        if starts:
                            stuck.append((i, spares < 2))
                            spares += spares < 2
                    elif stuck:
                        page, spared = stuck.pop(0)
                        gates[keys[page]].set()
                        with anyio.fail_after(30):
                            await stray_threads.wait_quiet(out[page : page + 1])
                        spares -= spared
                    reader = backend._workers
                    assert (reader.spares, reader.stray) == (spares, len(stuck)), (ops[: i + 1], reader)
                    assert reader.spares <= reader.max_spares == 2
            finally:
                for gate in gates.values():
                    gate.set()
            with anyio.fail_after(30):
                await stray_threads.wait_quiet(out)
                assert await backend.get(keys[-1:], out[-1:]) == [PageStatus.HIT]
            assert (backend._workers.spares, backend._workers.stray) == (0, 0)

    anyio.run(scenario)


async def test_a_cancelled_get_drops_its_finished_groups_and_abandons_only_the_reading_one(
    tmp_path: Path,
) -> None:
    """A get split into two groups, the first finished (uncollected: its set waits for the second) and the
    second stuck in its thread, is cancelled: only the stuck group is abandoned (its buffer busy, one worker
    added for it); the finished group's buffer is free at once and holds its page."""
    size = 1 << 20
    async with FileBackend(
        tmp_path / "pages",
        namespace_digest=NS,
        max_concurrency=1,
        group_bytes=size,  # a group per page
    ) as backend:
        keys, pages = make_keys(2), make_pages(2, size)
        await backend.put(keys, pages)
        entered, gate = threading.Event(), threading.Event()

        def hook(group: tuple[str, ...]) -> None:
            if keys[1] in group:  # one worker, in order: the first group has finished by now
                entered.set()
                assert gate.wait(timeout=30), "test gate never opened"

        backend._before_read = hook
        out = empty_pages(2, size)
        try:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(backend.get, keys, out)
                    await anyio.to_thread.run_sync(entered.wait)
                    scope.cancel()
            assert not stray_threads.busy(out[:1])
            assert stray_threads.busy(out[1:])
            assert backend._workers.threads == 2  # one replacement, for the stuck group only
            assert bytes(out[0]) == bytes(pages[0])
        finally:
            gate.set()
        with anyio.fail_after(30):
            await stray_threads.wait_quiet(out[1:])
        assert backend._workers.stray == 0


class CallsInThreads:
    """Counts the backend's threads inside blocking calls: how many at once (`peak`) and which (`threads`).

    Every instrumented call holds at `gate` until the test opens it, so each thread that may run one does
    so while the others are still inside theirs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside = 0
        self.peak = 0
        self.threads: set[int] = set()
        self.entered = threading.Semaphore(0)
        self.gate = threading.Event()

    def held(self) -> None:
        with self._lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
            self.threads.add(threading.get_ident())
        self.entered.release()
        try:
            assert self.gate.wait(timeout=30), "test gate never opened"
        finally:
            with self._lock:
                self.inside -= 1

    def wrap(self, func: Callable[P, T]) -> Callable[P, T]:
        def counted(*args: P.args, **kwargs: P.kwargs) -> T:
            self.held()
            return func(*args, **kwargs)

        return counted


async def test_every_blocking_call_shares_one_pool_of_max_concurrency_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gets (their page reads and the checked re-read of a flagged page), puts, deletes and exists running
    at once use at most `max_concurrency` threads, never more inside blocking calls at once.

    Guards against the two pools the backend once ran: its read threads for reads and `exists`, beside an
    anyio `CapacityLimiter` of the same size for put, delete and the re-read (up to twice the bound)."""
    counter = CallsInThreads()
    for name in ("write_group", "delete_group", "recheck"):
        monkeypatch.setattr(PageFiles, name, counter.wrap(getattr(PageFiles, name)))
    async with FileBackend(
        tmp_path / "pages", namespace_digest=NS, max_concurrency=2, group_bytes=4096
    ) as backend:
        keys, pages = make_keys(12), make_pages(12, 4096)
        counter.gate.set()
        assert await backend.put(keys[:8], pages[:8]) == [True] * 8
        rewrite_page(backend, keys[1], lambda data: data[:100])  # flagged by the C reader: re-read checked
        counter.gate.clear()
        counter.peak = 0
        counter.threads.clear()
        counter.entered = threading.Semaphore(0)
        backend._before_read = lambda group: counter.held()
        out = empty_pages(8, 4096)
        results: dict[str, object] = {}

        async def run(name: str, call: Callable[..., Awaitable[object]], *args: object) -> None:
            results[name] = await call(*args)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "get", backend.get, keys[:4], out[:4])
            tg.start_soon(run, "put", backend.put, keys[8:], pages[8:])
            tg.start_soon(run, "delete", backend.delete, keys[6:8])
            tg.start_soon(run, "exists", backend.exists, keys[:6])
            tg.start_soon(run, "get again", backend.get, keys[4:6], out[4:6])
            for _ in range(2):  # both threads held inside a call; every other call waits for one
                await anyio.to_thread.run_sync(counter.entered.acquire)
            await anyio.wait_all_tasks_blocked()
            assert counter.inside == 2
            counter.gate.set()
        assert counter.peak == 2, counter.peak
        assert len(counter.threads) <= 2, counter.threads
        assert backend._workers.threads == 2  # every job, `exists`' stat included, ran on these two
        assert results == {
            "get": [PageStatus.HIT, PageStatus.CORRUPT, PageStatus.HIT, PageStatus.HIT],
            "put": [True] * 4,
            "delete": None,
            "exists": 6,
            "get again": [PageStatus.HIT] * 2,
        }
        assert (
            await backend.get(keys[:6], out[:6])
            == [PageStatus.HIT, PageStatus.CORRUPT] + [PageStatus.HIT] * 4
        )
        assert await backend.exists(keys[8:]) == 4


async def test_a_cancelled_put_stuck_in_its_write_keeps_its_buffers_busy_until_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put whose write hangs (a hung mount) returns when cancelled; its buffers are a stray thread's
    until the write returns, through the same stray mechanism as reads (a spare thread meanwhile, so a get
    still loads), then quiet, and the page is stored."""
    counter = CallsInThreads()
    monkeypatch.setattr(PageFiles, "write_group", counter.wrap(PageFiles.write_group))
    async with FileBackend(tmp_path / "pages", namespace_digest=NS, max_concurrency=1) as backend:
        keys, pages = make_keys(2), make_pages(2, 4096)
        strays = stray_threads.count
        try:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(backend.put, keys[:1], pages[:1])
                    await anyio.to_thread.run_sync(counter.entered.acquire)
                    scope.cancel()
            assert scope.cancelled_caught
            assert stray_threads.busy(pages[:1])
            assert not stray_threads.busy(pages[1:])
            assert stray_threads.count == strays + 1
            assert (backend._workers.spares, backend._workers.stray) == (1, 1)
            assert await backend.get(keys[1:], empty_pages(1, 4096)) == [PageStatus.MISS]
        finally:
            counter.gate.set()
        with anyio.fail_after(30):
            await stray_threads.wait_quiet(pages[:1])
        assert stray_threads.count == strays
        assert (backend._workers.spares, backend._workers.stray) == (0, 0)
        out = empty_pages(1, 4096)
        assert await backend.get(keys[:1], out) == [PageStatus.HIT]
        assert bytes(out[0]) == bytes(pages[0])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads nice values through /proc")
async def test_read_threads_run_below_the_loops_priority(backend: FileBackend) -> None:
    """The worker threads' nice value is the process's + 10, so the loop thread takes a core from them
    whenever it wakes; the loop's own thread keeps the process's."""

    def nice_of(tid: int) -> int:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[16])  # field 19, counted after the command name

    keys, pages = make_keys(4), make_pages(4, 4096)
    await backend.put(keys, pages)  # threads start as work arrives
    ids = backend._workers.worker_ids()
    assert ids
    assert len(ids) == backend._workers.threads
    own = nice_of(threading.get_native_id())
    assert all(nice_of(tid) == min(19, own + 10) for tid in ids)


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


async def test_read_statistics_count_the_groups_read(backend: FileBackend) -> None:
    """`read_statistics()` counts every group the read threads finished (an `exists` chunk included) and
    the seconds spent reading them: what `bench/bench_io.py` turns into groups read at once."""
    keys, pages = make_keys(8), make_pages(8, 4096)
    await backend.put(keys, pages)
    before = backend.read_statistics()
    assert await backend.exists(keys) == 8
    after_exists = backend.read_statistics()
    assert after_exists.groups == before.groups + 1  # one chunk of 8 keys
    assert all(await backend.get(keys, empty_pages(8, 4096)))
    after = backend.read_statistics()
    assert after.groups > after_exists.groups
    assert after.reading_s > before.reading_s
    assert after.queued_s >= before.queued_s


async def test_buffers_of_any_format_round_trip(backend: FileBackend) -> None:
    """Buffers need not be bytes: a float32 2-D view of a page works, including short-read recovery."""
    import torch

    src = torch.arange(1024, dtype=torch.float32).reshape(32, 32)
    dst = torch.zeros_like(src)
    keys = make_keys(1)
    assert await backend.put(keys, [src.numpy().data]) == [True]
    assert await backend.get(keys, [dst.numpy().data]) == [PageStatus.HIT]
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


_REFUSED_FLAG = 1 << 30
"""A `preadv2` flag no kernel defines: every read asking for it fails with EOPNOTSUPP, as `RWF_NOWAIT` does on
filesystems that cannot tell (some FUSE mounts)."""


async def store_mixed(b: FileBackend) -> tuple[list[str], list[memoryview]]:
    """Eight 4 KiB pages stored in `b`: keys[5] absent, keys[7]'s last byte flipped, the rest valid; keys[:2]
    in one group file, the others in a second (so the second can be dropped from the page cache alone)."""
    keys, pages = make_keys(8), make_pages(8, 4096)
    assert await b.put(keys[:2], pages[:2]) == [True] * 2
    assert await b.put(keys[2:5] + keys[6:], pages[2:5] + pages[6:]) == [True] * 5
    flip_page_byte(b, keys[7], b.page_extent(keys[7])[2] - 1)
    return keys, pages


MIXED = [PageStatus.HIT] * 5 + [PageStatus.MISS, PageStatus.HIT, PageStatus.CORRUPT]


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="RWF_NOWAIT is Linux-only")
async def test_cold_pages_are_read_ahead_and_verified(tmp_path: Path) -> None:
    """Pages dropped from the page cache after two hot ones: the group switches from `RWF_NOWAIT` probing to
    readahead at the first cold page, and every page still lands verified, the absent one a miss and the
    corrupt one counted (the pages are synced, then dropped with `POSIX_FADV_DONTNEED`)."""
    async with FileBackend(tmp_path, namespace_digest=NS, max_concurrency=1) as b:
        keys, pages = await store_mixed(b)
        os.sync()
        for key in keys[2:5] + keys[6:]:
            fd = os.open(b.path_of(key), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        out = empty_pages(8, 4096)
        assert await b.get(keys, out) == MIXED
        assert [bytes(o) for o in out[:5]] == [bytes(p) for p in pages[:5]]
        assert bytes(out[6]) == bytes(pages[6])
        stats = b.statistics()
        assert (stats.pages_read, stats.misses, stats.checksum_failures) == (6, 1, 1)
        assert b._files.read_flags == native.READAHEAD | os.RWF_NOWAIT, (
            "a cold page is no reason to stop probing"
        )


async def test_a_filesystem_refusing_the_probe_keeps_its_readahead(tmp_path: Path) -> None:
    """A filesystem that rejects the `RWF_NOWAIT` probe (EOPNOTSUPP: NFS, some FUSE mounts) is read without
    it: the refused page and the rest of its group are read ahead, classified as usual, and no later read
    probes again. One flag meant both "probe" and "read ahead", so the first refusal switched readahead off
    for good on exactly the mounts it is for (issue 22, item 5); now only the probe is dropped and every
    later group is read ahead from its first page."""
    async with FileBackend(tmp_path, namespace_digest=NS, max_concurrency=1) as b:
        keys, pages = await store_mixed(b)
        b._files.read_flags = native.READAHEAD | _REFUSED_FLAG
        out = empty_pages(8, 4096)
        assert await b.get(keys, out) == MIXED
        assert [bytes(o) for o in out[:5]] == [bytes(p) for p in pages[:5]]
        assert bytes(out[6]) == bytes(pages[6])
        assert b._files.read_flags == native.READAHEAD, "the probe is dropped, the readahead kept"
        assert await b.get(keys, empty_pages(8, 4096)) == MIXED
        stats = b.statistics()
        assert (stats.pages_read, stats.misses, stats.checksum_failures) == (12, 2, 2)


READ_PATHS = {
    "probe": {},  # RWF_NOWAIT while the page cache holds the pages (where the kernel has it)
    "readahead": {"read_flags": native.READAHEAD | _REFUSED_FLAG},  # the probe refused: read ahead
    "readahead_unprobed": {"read_flags": native.READAHEAD},  # after a refusal: ahead from the first page
    "plain": {"readahead": False},
}


@pytest.mark.parametrize("path", list(READ_PATHS))
@pytest.mark.parametrize("page_bytes", [4096, 3 * native.CHUNK_BYTES // 2], ids=["one_read", "chunked"])
async def test_bytes_appended_to_a_page_are_corrupt_on_every_read_path(
    tmp_path: Path, path: str, page_bytes: int
) -> None:
    """A page one byte too long (its extent in its group's table), its header and checksum intact, is
    counted corrupt and not loaded, whichever way the C reader reads it (probing, reading ahead or
    plainly; in one read or in chunks)."""
    options = READ_PATHS[path]
    async with FileBackend(tmp_path, namespace_digest=NS, readahead=options.get("readahead", True)) as b:
        keys, pages = make_keys(3), make_pages(3, page_bytes)
        assert await b.put(keys, pages) == [True] * 3
        rewrite_page(b, keys[1], lambda data: data + b"\x00")
        if "read_flags" in options:
            b._files.read_flags = options["read_flags"]
        out = empty_pages(3, page_bytes)
        assert await b.get(keys, out) == [PageStatus.HIT, PageStatus.CORRUPT, PageStatus.HIT]
        assert (bytes(out[0]), bytes(out[2])) == (bytes(pages[0]), bytes(pages[2]))
        assert b.statistics().checksum_failures == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
async def test_reading_ahead_thousands_of_small_pages_keeps_few_files_open(tmp_path: Path) -> None:
    """2,000 small pages in one group, read ahead (the probe refused) while the process may open only 64
    more files: every page loads. The reader keeps a bounded window of files open ahead of the page it
    reads, never one per page of the group (which failed most of them with EMFILE)."""
    resource = pytest.importorskip("resource")
    n = 2000
    async with FileBackend(tmp_path, namespace_digest=NS, max_concurrency=1) as b:
        keys, pages = make_keys(n), make_pages(n, 512)
        assert await b.put(keys, pages) == [True] * n
        b._files.read_flags = native.READAHEAD | _REFUSED_FLAG
        out = empty_pages(n, 512)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
        try:
            statuses = await b.get(keys, out)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert statuses == [PageStatus.HIT] * n
        assert all(bytes(o) == bytes(p) for o, p in zip(out, pages, strict=True))
        assert b.statistics().errors == 0


_COLD_READ_UNDER_A_LOW_LIMIT = """
import asyncio, json, os, resource, sys
from storage_backends import native
from storage_backends.file import FileBackend
from storage_backends.protocol import PageStatus

async def main() -> None:
    n, size = 1000, 16384
    async with FileBackend(sys.argv[1], namespace_digest=bytes(16), max_concurrency=4) as b:
        keys = [f"{i:032x}" for i in range(n)]
        pages = [memoryview(bytearray([i % 251]) * size) for i in range(n)]
        assert all(await b.put(keys, pages))
        b._files.read_flags = native.READAHEAD | int(sys.argv[2])  # the probe refused: read ahead
        out = [memoryview(bytearray(size)) for _ in range(n)]
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        while int(sys.argv[3]):  # hold every descriptor but a few: the read-ahead budget cannot know
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        for fd in held[len(held) - int(sys.argv[3]) :]:
            os.close(fd)
        statuses = await b.get(keys, out)
        print(json.dumps({
            "hits": sum(s is PageStatus.HIT for s in statuses),
            "loaded": sum(bytes(o) == bytes(p) for o, p in zip(out, pages)),
            "errors": b.statistics().errors,
            "groups": b.read_statistics().groups,
        }))

asyncio.run(main())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux: RLIMIT_NOFILE and the C reader")
@pytest.mark.parametrize("free", [0, 3], ids=["limit_64", "all_but_3_descriptors_taken"])
def test_cold_reads_on_four_threads_succeed_under_a_low_descriptor_limit(tmp_path: Path, free: int) -> None:
    """With `RLIMIT_NOFILE` 64, a cold 1,000-page get spread over four read threads failed hundreds of pages
    with EMFILE: each thread kept 32 files open ahead, 128 in all, whatever the limit (issue 22, item 11).
    Now the threads share a read-ahead budget of a quarter of the limit; a page whose open ahead hits
    EMFILE is opened at its own turn, and one whose own open hits it (other threads' read-ahead holding the
    last descriptors) is re-read plainly after the batch: every page loads, as plain reads would, also with
    all but three descriptors taken by the process. (A subprocess: the limit is the whole process's.)"""
    import json
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", _COLD_READ_UNDER_A_LOW_LIMIT, str(tmp_path), str(_REFUSED_FLAG), str(free)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["groups"] == 4, "the get is spread over the four threads"
    assert outcome == {"hits": 1000, "loaded": 1000, "errors": 0, "groups": 4}


async def test_readahead_off_never_probes(tmp_path: Path) -> None:
    """`readahead=False` reads every page plainly: no probe flags reach the reader, and results are the same."""
    async with FileBackend(tmp_path, namespace_digest=NS, readahead=False) as b:
        assert b._files.read_flags == 0
        keys, pages = await store_mixed(b)
        out = empty_pages(8, 4096)
        assert await b.get(keys, out) == MIXED
        assert [bytes(o) for o in out[:5]] == [bytes(p) for p in pages[:5]]
        assert b._files.read_flags == 0


async def test_a_failed_read_is_an_error_named_in_the_log(
    backend: FileBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A page whose file cannot be read (here: a directory where the file should be, EISDIR) is an ERROR,
    logged with the errno, counted, and its neighbours still load."""
    keys, pages = make_keys(3), make_pages(3, 4096)
    await backend.put(keys, pages)
    path = backend.path_of(keys[1])
    path.unlink()
    path.mkdir()
    out = empty_pages(3, 4096)
    assert await backend.get(keys, out) == [PageStatus.HIT, PageStatus.ERROR, PageStatus.HIT]
    assert bytes(out[2]) == bytes(pages[2])
    assert backend.statistics().errors == 1
    assert "cannot read page" in caplog.text
    assert "EISDIR" in caplog.text


@pytest.mark.parametrize("readahead", [True, False], ids=["readahead", "plain"])
async def test_a_fifo_at_a_page_path_is_an_error_and_never_blocks_a_reader(
    tmp_path: Path, readahead: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO where a page file should be blocked the reader thread in `open` until some writer came: the
    read missed every deadline and its buffers stayed quarantined. Now the file is opened without blocking
    and refused before any read, in the C reader and in the Python re-read alike: an ERROR naming the
    FIFO, its neighbours load, and no thread is left behind. (No writer ever opens the FIFO: before the
    fix this test hung until pytest's timeout.)"""
    async with FileBackend(tmp_path / "pages", namespace_digest=NS, readahead=readahead) as backend:
        keys, pages = make_keys(3), make_pages(3, 4096)
        await backend.put(keys, pages)
        path = backend.path_of(keys[1])
        path.unlink()
        os.mkfifo(path)
        out = empty_pages(3, 4096)
        assert await backend.get(keys, out) == [PageStatus.HIT, PageStatus.ERROR, PageStatus.HIT]
        assert bytes(out[2]) == bytes(pages[2])
        assert backend.statistics().errors == 1
        assert "not a regular file (a FIFO)" in caplog.text
        assert stray_threads.count == 0
        assert not stray_threads.busy(out)
        # The Python re-read refuses it the same way, without blocking.
        assert backend._files.read_checked(keys[1], out[1]) == PageStatus.ERROR


def _break_stat(path: Path, errno_name: str) -> None:
    """Make `stat` of page file `path` fail with `errno_name`."""
    path.unlink()
    if errno_name == "ELOOP":
        path.symlink_to(path)
    elif errno_name == "ENOTDIR":  # a file where the page's sharding directory should be
        directory = path.parent
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()
        directory.write_bytes(b"not a directory")
    else:
        path.write_bytes(b"")
        path.parent.chmod(0o000)


@pytest.mark.parametrize("errno_name", ["ELOOP", "ENOTDIR", "EACCES"])
async def test_exists_raises_for_a_page_it_cannot_stat(
    backend: FileBackend, caplog: pytest.LogCaptureFixture, errno_name: str
) -> None:
    """A page path `stat` fails on for another reason than absence (a symlink loop, a file where its
    directory should be, a directory without permission) ended the present prefix like a miss, only logged
    (issue 22, item 12): the store cannot say what it holds, so `exists` raises, names the errno and counts
    the error, and the breaker hears of it. Absence stays a miss."""
    if errno_name == "EACCES" and os.geteuid() == 0:
        pytest.skip("root stats through any permission")
    keys, pages = make_keys(3), make_pages(3, 4096)
    await backend.put(keys, pages)
    assert await backend.exists(keys) == 3
    path = backend.path_of(keys[1])
    _break_stat(path, errno_name)
    try:
        expected = StorageAuthError if errno_name == "EACCES" else StorageError
        with pytest.raises(expected, match=errno_name):
            await backend.exists(keys)
        assert backend.statistics().errors == 1
        assert await backend.exists(keys[:1]) == 1  # the pages before it are fine
        assert "cannot stat page" in caplog.text
    finally:
        if errno_name == "EACCES":
            path.parent.chmod(0o755)
    if errno_name == "ELOOP":
        path.unlink()
        assert await backend.exists(keys) == 1  # gone: a miss again
        assert backend.statistics().errors == 1


def _no_page_at(path: Path, kind: str) -> None:
    """Put something at page file `path` that is not a page file."""
    path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket

        with socket.socket(socket.AF_UNIX) as sock:  # bound by a relative name: paths are long
            cwd = os.getcwd()
            os.chdir(path.parent)
            try:
                sock.bind(path.name)
            finally:
                os.chdir(cwd)
    else:
        path.symlink_to("/dev/null")


@pytest.mark.parametrize("kind", ["directory", "fifo", "socket", "symlink_to_a_device"])
async def test_something_at_a_page_path_that_is_no_file_is_absent_and_replaced(
    backend: FileBackend, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """`exists` counted a directory, FIFO, socket or symlink to a device at a page path as a stored page:
    `get` then failed on it every time and write-through never replaced it (issue 22, item 13). It is no
    page: `exists` ends the prefix there and says so in the log, and the next `put` replaces it."""
    keys, pages = make_keys(3), make_pages(3, 4096)
    await backend.put(keys, pages)
    path = backend.path_of(keys[1])
    _no_page_at(path, kind)
    assert await backend.exists(keys) == 1
    assert "no page at" in caplog.text
    assert backend.statistics().errors == 0
    assert await backend.put(keys[1:2], pages[1:2]) == [True]
    assert await backend.exists(keys) == 3
    out = empty_pages(3, 4096)
    assert await backend.get(keys, out) == [PageStatus.HIT] * 3
    assert [bytes(o) for o in out] == [bytes(p) for p in pages]


def test_default_concurrency_follows_the_cpus(tmp_path: Path) -> None:
    """By default one thread per usable CPU, between 4 and 16, and the repr says how many."""
    n = default_concurrency()
    assert 4 <= n <= 16
    b = FileBackend(tmp_path, namespace_digest=NS)
    try:
        assert f"max_concurrency={n}" in repr(b)
    finally:
        anyio.run(b.aclose)


async def test_small_batches_take_one_thread_hop(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight 4 KiB pages go to one worker-thread call, not eight (a hop costs more than 4 KiB of reading)."""
    keys, pages = make_keys(8), make_pages(8, 4096)
    await backend.put(keys, pages)
    groups: list[int] = []
    monkeypatch.setattr(backend, "_before_read", lambda keys: groups.append(len(keys)))
    assert await backend.get(keys, empty_pages(8, 4096)) == [PageStatus.HIT] * 8
    assert groups == [8]


@pytest.mark.parametrize(
    "target", ["same_root_other_key", "other_root_same_key_other_namespace", "old_format"]
)
async def test_symlinks_to_pages_elsewhere_are_never_loaded(tmp_path: Path, target: str) -> None:
    """A page file replaced by a symlink to a valid page elsewhere (another key's group file, the same key in
    another cache's root, a version 1 file) is followed, then refused by its group's table or its header:
    counted, not loaded. (The two keys are put apart: a group holding both would rightly serve each.)"""
    config = base_config()
    size = config.layout.page_nbytes
    keys, pages = make_keys(2, salt=7), make_pages(2, size, seed=6)
    elsewhere = tmp_path / "elsewhere"
    async with FileBackend(tmp_path / "pages", namespace_digest=config.namespace.digest) as backend:
        for key, page in zip(keys, pages, strict=True):
            assert await backend.put([key], [page]) == [True]
        if target == "same_root_other_key":
            source = backend.path_of(keys[1])
        elif target == "other_root_same_key_other_namespace":
            other = VARIANTS["model_id"].namespace.digest
            async with FileBackend(elsewhere, namespace_digest=other) as foreign:
                assert await foreign.put(keys[:1], make_pages(1, size, seed=7)) == [True]
                source = foreign.path_of(keys[0])
        else:
            elsewhere.mkdir()
            source = elsewhere / "v1.kvp"
            source.write_bytes(v1_page(bytes(make_pages(1, size, seed=8)[0]), config.namespace.digest))
        link = backend.path_of(keys[0])
        link.unlink()
        link.symlink_to(source)
        assert await backend.exists(keys) == 2
        expected = PageStatus.OLD_FORMAT if target == "old_format" else PageStatus.FOREIGN
        out = empty_pages(2, size)
        assert await backend.get(keys, out) == [expected, PageStatus.HIT]
        assert bytes(out[1]) == bytes(pages[1])
        s = backend.statistics()
        assert (s.pages_read, s.foreign_pages, s.old_format_pages) == (
            1,
            int(expected is PageStatus.FOREIGN),
            int(expected is PageStatus.OLD_FORMAT),
        )


# -- group files (issue 25): one file per put's share of a thread, a hard link per page ------------------


async def test_a_put_is_one_group_file_with_a_name_per_page(backend: FileBackend) -> None:
    """A put of pages in one worker-thread group writes one inode, linked once per page, and no file
    named for the group is left in the root (its temporary name goes once every page has its own)."""
    keys, pages = make_keys(6), make_pages(6, 4096)
    assert await backend.put(keys, pages) == [True] * 6
    inodes = {backend.path_of(k).stat().st_ino for k in keys}
    assert len(inodes) == 1
    assert backend.path_of(keys[0]).stat().st_nlink == 6
    assert [p for p in backend.root.iterdir() if p.is_file()] == []


async def test_a_group_is_never_read_half_written(backend: FileBackend) -> None:
    """Readers racing a writer see each page whole or not at all: a page's name exists only once its
    group file is complete (the writer links after the whole group is written), so a get never meets a
    torn page, only MISS or a verified HIT."""
    n, size, rounds = 16, 65536, 12
    every_key = make_keys(n * rounds)
    batches = [(every_key[r * n : (r + 1) * n], make_pages(n, size, seed=r)) for r in range(rounds)]
    seen: list[PageStatus] = []

    async def write_all() -> None:
        for keys, pages in batches:
            assert await backend.put(keys, pages) == [True] * n

    async def read_while_writing() -> None:
        for _ in range(rounds * 4):
            for keys, pages in batches:
                out = empty_pages(n, size)
                statuses = await backend.get(keys, out)
                seen.extend(statuses)
                for status, got, page in zip(statuses, out, pages, strict=True):
                    if status is PageStatus.HIT:
                        assert bytes(got) == bytes(page)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(write_all)
        tg.start_soon(read_while_writing)
    assert set(seen) <= {PageStatus.HIT, PageStatus.MISS}
    stats = backend.statistics()
    assert (stats.checksum_failures, stats.foreign_pages, stats.errors) == (0, 0, 0)


@pytest.mark.parametrize("damage", ["footer_cut", "table_flipped", "count_too_large", "count_past_the_pages"])
async def test_a_torn_group_table_is_a_miss_for_every_page_of_it(
    backend: FileBackend, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A group whose footer is cut off, whose table fails its checksum or whose count does not fit the
    file (its entries, or its entries and a header per page) says nowhere where its pages are: each is CORRUPT (a miss the cache deletes and writes again),
    never a hit and never an error; a page of another group still loads."""
    keys, pages = make_keys(4), make_pages(4, 4096)
    assert await backend.put(keys[:3], pages[:3]) == [True] * 3
    assert await backend.put(keys[3:], pages[3:]) == [True]
    path = backend.path_of(keys[0])
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    try:
        if damage == "footer_cut":
            os.truncate(fd, size - 5)
        elif damage == "table_flipped":
            at = size - GROUP_FOOTER.size - GROUP_ENTRY.size + 3  # the last entry's digest
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
        elif damage == "count_too_large":
            os.pwrite(fd, (10**6).to_bytes(8, "little"), size - GROUP_FOOTER.size + 8)
        else:  # as many entries as the file holds, but no room left for their pages' headers
            count = (size - GROUP_FOOTER.size) // GROUP_ENTRY.size
            os.pwrite(fd, count.to_bytes(8, "little"), size - GROUP_FOOTER.size + 8)
    finally:
        os.close(fd)
    out = empty_pages(4, 4096)
    assert await backend.get(keys, out) == [PageStatus.CORRUPT] * 3 + [PageStatus.HIT]
    assert bytes(out[3]) == bytes(pages[3])
    assert backend.statistics().checksum_failures == 3
    assert backend.statistics().errors == 0
    assert "discarding page" in caplog.text


async def test_deleting_one_page_of_a_group_keeps_the_others_and_the_last_frees_it(
    backend: FileBackend,
) -> None:
    """`delete` unlinks a page's name only: the rest of its group still loads; the filesystem frees the
    group file when its last name goes (an open descriptor sees its link count reach 0)."""
    keys, pages = make_keys(3), make_pages(3, 4096)
    assert await backend.put(keys, pages) == [True] * 3
    fd = os.open(backend.path_of(keys[0]), os.O_RDONLY)
    try:
        await backend.delete(keys[:1])
        assert await backend.exists(keys) == 0
        out = empty_pages(2, 4096)
        assert await backend.get(keys[1:], out) == [PageStatus.HIT] * 2
        assert [bytes(o) for o in out] == [bytes(p) for p in pages[1:]]
        assert os.fstat(fd).st_nlink == 2
        await backend.delete(keys[1:])
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)
    assert files_under(backend.root) == []


async def test_another_backend_on_the_same_root_reads_the_pages(backend: FileBackend) -> None:
    """A second server sharing the directory finds a page by its path and reads it through its group's
    table; what it deletes is gone for the first, and what it writes the first reads."""
    keys, pages = make_keys(6), make_pages(6, 4096)
    assert await backend.put(keys[:3], pages[:3]) == [True] * 3
    async with FileBackend(backend.root, namespace_digest=NS) as other:
        assert await other.exists(keys[:3]) == 3
        out = empty_pages(3, 4096)
        assert await other.get(keys[:3], out) == [PageStatus.HIT] * 3
        assert [bytes(o) for o in out] == [bytes(p) for p in pages[:3]]
        assert await other.put(keys[3:], pages[3:]) == [True] * 3
        await other.delete(keys[:1])
    out = empty_pages(6, 4096)
    assert await backend.get(keys, out) == [PageStatus.MISS] + [PageStatus.HIT] * 5
    assert [bytes(o) for o in out[1:]] == [bytes(p) for p in pages[1:]]


async def test_an_old_one_file_page_is_a_miss_the_next_put_replaces(
    backend: FileBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A page file of the layout before page groups (header + payload, no group footer), as a server of
    that layout left it, exists but loads as OLD_FORMAT; the next put names the page anew (the link is
    made over it) and it loads."""
    keys, pages = make_keys(2), make_pages(2, 4096)
    for key, page in zip(keys, pages, strict=True):
        path = backend.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_header(page, NS, key) + bytes(page))
    assert await backend.exists(keys) == 2
    assert await backend.get(keys, empty_pages(2, 4096)) == [PageStatus.OLD_FORMAT] * 2
    assert "before page groups" in caplog.text
    assert await backend.put(keys[:1], pages[:1]) == [True]
    out = empty_pages(2, 4096)
    assert await backend.get(keys, out) == [PageStatus.HIT, PageStatus.OLD_FORMAT]
    assert bytes(out[0]) == bytes(pages[0])


async def test_a_page_put_again_is_renamed_over_and_its_old_group_freed(backend: FileBackend) -> None:
    """Putting a stored key again (link fails with EEXIST) replaces its name with a link to the new group
    (a per-page temporary link renamed over it): the page reads the new bytes, the old group keeps its
    other pages, and loses a name; no temporary name is left."""
    keys = make_keys(2)
    old, new = make_pages(2, 4096, seed=1), make_pages(1, 4096, seed=2)
    assert await backend.put(keys, old) == [True, True]
    assert await backend.put(keys[:1], new) == [True]
    out = empty_pages(2, 4096)
    assert await backend.get(keys, out) == [PageStatus.HIT, PageStatus.HIT]
    assert (bytes(out[0]), bytes(out[1])) == (bytes(new[0]), bytes(old[1]))
    assert backend.path_of(keys[1]).stat().st_nlink == 1
    assert sorted(p.name for p in files_under(backend.root)) == sorted(f"{k}.kvp" for k in keys)


async def test_page_extent_names_the_page_bytes_in_its_group(backend: FileBackend) -> None:
    """`page_extent` says where a page's header and payload lie in its group file."""
    keys, pages = make_keys(3), make_pages(3, 1000)
    assert await backend.put(keys, pages) == [True] * 3
    for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
        path, offset, length = backend.page_extent(key)
        assert (path, offset, length) == (backend.path_of(key), i * (HEADER_SIZE + 1000), HEADER_SIZE + 1000)
        assert page_bytes(backend, key) == encode_header(page, NS, key) + bytes(page)
