"""The C extension `_hicache_native`: its checksum is page format v2's, its reader refuses misuse, and its
read queue runs, cancels, retires and closes as `storage_backends.threads.WorkerThreads` relies on.

The reader's behaviour on real page files (hits, misses, truncated, foreign, old-format, corrupt and cold
pages, cancellation) is covered by the backend contract and `test_file_backend.py`, which read through it.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from storage_backends import native

SIZES = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 4095, 4096, 4097, 65535, 65536, 65537, 1 << 20]


@pytest.mark.parametrize("size", SIZES)
def test_checksum_is_python_xxhash_xxh3_64(size: int) -> None:
    """Every length class of xxh3 (0, 1-3, 4-8, 9-16, 17-128, 129-240, long, around the GIL threshold)
    gives python-xxhash's digest, so pages written before the C extension still verify."""
    data = random.Random(size).randbytes(size)
    assert native.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)
    assert native.xxh3_64(memoryview(bytearray(data))) == xxhash.xxh3_64_intdigest(data)


@given(st.binary(max_size=3000))
def test_checksum_matches_on_any_bytes(data: bytes) -> None:
    """The same digest as python-xxhash for arbitrary bytes."""
    assert native.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


def test_checksum_refuses_a_non_contiguous_buffer() -> None:
    """A strided view is refused, not hashed as if it were contiguous."""
    with pytest.raises((BufferError, TypeError, ValueError)):
        native.xxh3_64(memoryview(bytearray(64))[::2])


def test_reader_refuses_misuse(tmp_path: object) -> None:
    """Bad arguments raise, naming the argument, before any file is opened."""
    ns = bytes(16)
    with pytest.raises(ValueError, match="namespace_digest"):
        native.read_pages("/nonexistent", ".kvp", ["abcd"], [bytearray(8)], b"short", 0)
    with pytest.raises(ValueError, match="buffers"):
        native.read_pages("/nonexistent", ".kvp", ["abcd", "abce"], [bytearray(8)], ns, 0)
    with pytest.raises(TypeError, match=r"keys\[0\]"):
        native.read_pages("/nonexistent", ".kvp", [b"abcd"], [bytearray(8)], ns, 0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"buffers\[0\]"):
        native.read_pages("/nonexistent", ".kvp", ["abcd"], [b"read-only"], ns, 0)


def test_reader_reports_absent_pages_as_misses() -> None:
    """Pages under a root that does not exist are misses, with no error listed."""
    codes, flags, errors = native.read_pages(
        "/nonexistent", ".kvp", ["abcd", "abce"], [bytearray(8)] * 2, bytes(16), 0
    )
    assert list(codes) == [native.MISS, native.MISS]
    assert (flags, errors) == (0, [])


@pytest.mark.parametrize("key", ["../../etc/passwd", "abc", "ABCD", "abcd/ef", "abcd\x00ef", "a" * 129])
def test_reader_refuses_a_key_that_is_not_a_page_key(key: str) -> None:
    """The reader builds paths from keys itself: a key that is not 4-128 lowercase hex characters (one that
    could leave the root, or be cut short by a NUL) raises naming it, and no file is opened."""
    with pytest.raises(ValueError, match=r"keys\[1\]"):
        native.read_pages("/nonexistent", ".kvp", ["abcd", key], [bytearray(8)] * 2, bytes(16), 0)


def test_reader_refuses_a_nul_in_the_root() -> None:
    """A NUL would cut every path short: refused."""
    with pytest.raises(ValueError, match="root"):
        native.read_pages("/tmp\x00/x", ".kvp", ["abcd"], [bytearray(8)], bytes(16), 0)


NS16 = bytes(range(16))


def _wait_readable(fd: int) -> None:
    import select

    ready, _, _ = select.select([fd], [], [], 30)
    assert ready, "no job finished"


def _collect(queue: native.ReadQueue, count: int) -> list[native.ReadJob]:
    """Collect finished jobs until `count` came back (a cancel's signal may wake with none finished)."""
    finished: list[native.ReadJob] = []
    while len(finished) < count:
        _wait_readable(queue.fileno())
        finished += queue.collect()
    return finished


def _start_and_collect(queue: native.ReadQueue, count: int) -> tuple[threading.Thread, list[native.ReadJob]]:
    """Start a worker thread on `queue` and collect finished jobs until `count` came back."""
    worker = threading.Thread(target=queue.work)
    worker.start()
    return worker, _collect(queue, count)


def test_read_queue_runs_cancels_and_closes(tmp_path: Path) -> None:
    """The queue's own contract, without the backend: a pending job can be cancelled (it never runs, and
    `collect` never returns it); a worker thread runs the others in order and signals `fileno()`; `result()`
    refuses a job that has not run; after `close()` submissions are refused and the worker leaves."""
    queue = native.ReadQueue()
    keys = ["abcd0001", "abcd0002"]
    bufs = [memoryview(bytearray(64)) for _ in keys]
    cancelled = queue.submit(str(tmp_path), ".kvp", keys[:1], bufs[:1], NS16, 0, None)
    kept = queue.submit(str(tmp_path), ".kvp", keys[1:], bufs[1:], NS16, 0, None)
    stat = queue.submit(str(tmp_path), ".kvp", keys, None, NS16, 0, None)
    with pytest.raises(RuntimeError, match="has not run"):
        kept.result()
    assert queue.cancel(cancelled) is True
    assert queue.cancel(cancelled) is False  # no longer pending
    worker, finished = _start_and_collect(queue, 2)
    assert finished == [kept, stat]
    for job in finished:  # queued, started and finished in that order, on the monotonic clock
        queued, started, done = job.times()
        assert 0 < queued <= started <= done <= time.monotonic_ns()
    assert cancelled.times()[1:] == (0, 0)  # never started
    assert kept.result() == (bytes([native.MISS]), 0, [])  # no such file: a miss
    assert stat.result()[0] == bytes([native.MISS, native.MISS])
    assert queue.cancel(kept) is False
    queue.close()
    worker.join(30)
    assert not worker.is_alive()
    assert queue.closed
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit(str(tmp_path), ".kvp", keys, bufs, NS16, 0, None)


def test_read_queue_calls_python_in_its_workers_and_drops_the_callable(tmp_path: Path) -> None:
    """A call job runs its callable in the worker, in order with the read jobs of its set; `result()` gives
    back what it returned or raises what it raised (traceback kept); a pending call can be cancelled (it
    never runs); the worker drops the callable once it ran, so what the callable held (a caller's buffer)
    is free as soon as the job finished. Misuse is refused by name."""
    queue = native.ReadQueue()
    ran: list[str] = []
    held = bytearray(16)
    buffer_ref = weakref.ref(held_obj := _Held(held))

    def boom() -> None:
        ran.append("boom")
        raise KeyError("from the worker")

    first = queue.call(lambda: ran.append("first") or 42)
    read = queue.submit(str(tmp_path), ".kvp", ["abcd0001"], [memoryview(bytearray(8))], NS16, 0, None, first)
    raised = queue.call(boom, first)
    holding = queue.call(held_obj.touch, first)
    cancelled = queue.call(lambda: ran.append("cancelled"), first)
    del held_obj
    assert (first.call, read.call) == (True, False)
    with pytest.raises(RuntimeError, match="has not run"):
        first.result()
    assert queue.cancel(cancelled) is True
    worker, finished = _start_and_collect(queue, 4)
    assert finished == [first, read, raised, holding]
    assert ran == ["first", "boom"]
    assert first.result() == 42
    assert read.result() == (bytes([native.MISS]), 0, [])
    with pytest.raises(KeyError, match="from the worker") as info:
        raised.result()
    assert info.traceback[-1].name == "boom"
    assert holding.result() == 16
    assert buffer_ref() is None, "the finished job still holds its callable"
    with pytest.raises(TypeError, match="func"):
        queue.call(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="leader"):
        queue.call(len, native.ReadQueue().call(len))
    queue.close()
    worker.join(30)
    assert not worker.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        queue.call(len)


class _Held:
    """A callable's owner that the test watches being freed."""

    def __init__(self, buffer: bytearray) -> None:
        self.buffer = buffer

    def touch(self) -> int:
        return len(self.buffer)


def test_read_queue_cancels_any_pending_job_in_place(tmp_path: Path) -> None:
    """`cancel` unlinks a pending job wherever it sits (head, middle, tail, alone; through its neighbours,
    no scan of the queue): the worker then runs exactly the others, in submission order, and a job can be
    queued behind a cancelled tail. A job from another queue is refused, not unlinked from this one."""
    queue = native.ReadQueue()
    submit = lambda i: queue.submit(str(tmp_path), ".kvp", [f"abcd{i:04x}"], None, NS16, 0, None)  # noqa: E731
    jobs = [submit(i) for i in range(6)]
    for i in (0, 3, 5):  # head, middle, tail
        assert queue.cancel(jobs[i]) is True
    late = submit(6)  # queued behind the cancelled tail
    other = native.ReadQueue()
    foreign = other.submit(str(tmp_path), ".kvp", ["abcd0007"], None, NS16, 0, None)
    with pytest.raises(ValueError, match="job"):
        queue.cancel(foreign)
    assert other.cancel(foreign) is True
    worker, finished = _start_and_collect(queue, 4)
    assert finished == [jobs[1], jobs[2], jobs[4], late]
    started, release, hook = _gate()
    busy = queue.submit(str(tmp_path), ".kvp", ["abcd0008"], None, NS16, 0, hook)
    assert started.wait(30)  # the worker holds `busy`: the queue is empty again
    lone = submit(9)  # alone in the queue: head and tail at once
    assert queue.cancel(lone) is True
    release.set()
    assert _collect(queue, 1) == [busy]
    assert lone.times()[1:] == (0, 0)  # never started
    queue.close()
    worker.join(30)
    assert not worker.is_alive()
    other.close()


def _readable_now(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def _gate() -> tuple[threading.Event, threading.Event, Callable[[tuple[str, ...]], object]]:
    """A hook that says when its job starts and holds the worker until released: (started, release, hook)."""
    started, release = threading.Event(), threading.Event()

    def hook(keys: tuple[str, ...]) -> None:
        started.set()
        assert release.wait(30)

    return started, release, hook


def test_a_set_of_jobs_signals_once_its_last_job_finishes(tmp_path: Path) -> None:
    """Jobs submitted with a leader form a set: the first two finish without waking the loop (fileno() not
    readable while the third still reads), the third's finish signals, and one collect() takes all three."""
    root = str(tmp_path)
    queue = native.ReadQueue()
    started, release, hook = _gate()
    first = queue.submit(root, ".kvp", ["abcd0000"], None, NS16, 0, None)
    second = queue.submit(root, ".kvp", ["abcd0001"], None, NS16, 0, None, first)
    third = queue.submit(root, ".kvp", ["abcd0002"], None, NS16, 0, hook, second)  # a follower's leader
    worker = threading.Thread(target=queue.work)
    worker.start()
    assert started.wait(30)  # one worker, FIFO: the first two are on the done list now
    assert not _readable_now(queue.fileno())
    assert (first.finished, second.finished, third.finished) == (True, True, False)
    release.set()
    _wait_readable(queue.fileno())
    assert queue.collect() == [first, second, third]
    assert third.finished
    queue.close()
    worker.join(30)
    assert not worker.is_alive()


def test_cancel_signals_so_a_cancelled_callers_finished_jobs_are_collected(tmp_path: Path) -> None:
    """A caller cancelled while one job of its set still reads withdraws them all: `cancel` of a finished
    job signals (so it is collected now, not when the slow one ends), a cancelled pending job no longer
    counts, and the reading job's finish still signals."""
    root = str(tmp_path)
    queue = native.ReadQueue()
    started, release, hook = _gate()
    done = queue.submit(root, ".kvp", ["abcd0000"], None, NS16, 0, None)
    reading = queue.submit(root, ".kvp", ["abcd0001"], None, NS16, 0, hook, done)
    pending = queue.submit(root, ".kvp", ["abcd0002"], None, NS16, 0, None, done)
    worker = threading.Thread(target=queue.work)
    worker.start()
    assert started.wait(30)
    assert not _readable_now(queue.fileno())
    assert queue.cancel(done) is False  # finished: not cancellable, but now signalled
    assert _readable_now(queue.fileno())
    assert queue.collect() == [done]
    assert queue.cancel(pending) is True
    assert queue.collect() == []  # the cancel's signal: nothing else finished
    release.set()
    _wait_readable(queue.fileno())
    assert queue.collect() == [reading]
    assert pending.times()[1:] == (0, 0)
    queue.close()
    worker.join(30)
    assert not worker.is_alive()


def test_submit_refuses_a_leader_of_another_queue(tmp_path: Path) -> None:
    root = str(tmp_path)
    queue, other = native.ReadQueue(), native.ReadQueue()
    foreign = other.submit(root, ".kvp", ["abcd0000"], None, NS16, 0, None)
    for leader in (foreign, "abcd"):
        with pytest.raises(ValueError, match="leader"):
            queue.submit(root, ".kvp", ["abcd0001"], None, NS16, 0, None, leader)  # type: ignore[arg-type]
    assert other.cancel(foreign) is True
    queue.close()
    other.close()


def test_a_job_outliving_its_queue_is_not_cancellable(tmp_path: Path) -> None:
    """A queue dropped with jobs still pending lets go of them: a job the caller still holds no longer
    points at the queue or at its freed neighbours, so `cancel` on a new queue (which may reuse the old
    one's address) refuses it instead of unlinking it through freed memory (was a segfault)."""
    root = str(tmp_path)
    queue = native.ReadQueue()
    before = queue.submit(root, ".kvp", ["abcd0000"], None, NS16, 0, None)
    held = queue.submit(root, ".kvp", ["abcd0001"], None, NS16, 0, None)
    del before  # the held job's neighbour goes first, then the queue (whose address the next queue may take)
    del queue
    fresh = native.ReadQueue()
    with pytest.raises(ValueError, match="job"):
        fresh.cancel(held)
    assert held.times()[1:] == (0, 0)  # never started
    fresh.close()


def test_finished_on_a_job_outliving_its_queue_does_not_touch_the_freed_queue(tmp_path: Path) -> None:
    """A collected job keeps its queue's address; `finished` read after the queue was freed must not lock
    that queue's mutex (a use-after-free: here the freed block is reused by a bytes object whose header
    reads as a locked mutex, and the read hung for ever)."""
    script = (
        "import sys, threading\n"
        "import _hicache_native as native\n"
        "queue = native.ReadQueue()\n"
        "job = queue.submit(sys.argv[1], '.kvp', ['abcd0000'], None, bytes(16), 0, None)\n"
        "worker = threading.Thread(target=queue.work); worker.start()\n"
        "got = []\n"
        "while not got: got = queue.collect()\n"
        "queue.close(); worker.join(); del got\n"
        "size, addr = sys.getsizeof(queue), id(queue)  # its block: the GC header, then the object\n"
        "start = addr - (size - type(queue).__basicsize__)\n"
        "del queue\n"
        "reuse = bytes(size - sys.getsizeof(b''))  # the freed queue's block, the mutex's lock word nonzero\n"
        "print(id(reuse) <= addr < id(reuse) + size and id(reuse) == start, job.finished)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True, timeout=30
    )
    reused, finished = done.stdout.split()
    assert finished == "True"
    if reused != "True":
        pytest.skip("the allocator did not hand the freed queue's block on: nothing was exercised")


def test_a_stale_build_is_refused_with_a_rebuild_hint() -> None:
    """A worktree that merged a new hicache_native.c without rebuilding gets an ImportError saying to
    rebuild, not an AttributeError deep in a read; the build in use is the one this code expects."""
    import _hicache_native

    assert _hicache_native.BUILD == native.BUILD
    stale = (
        "import sys, types\n"
        "fake = types.ModuleType('_hicache_native'); fake.__file__ = 'old.so'\n"
        "sys.modules['_hicache_native'] = fake\n"
        "try:\n"
        "    import storage_backends.native\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", stale], capture_output=True, text=True, check=True, timeout=120
    )
    assert "stale" in done.stdout
    assert "make native" in done.stdout


def test_read_queue_retire_lets_one_worker_go() -> None:
    """`retire(1)` ends exactly one idle worker's `work()`; `close()` ends the rest."""
    queue = native.ReadQueue()
    left = threading.Semaphore(0)

    def work() -> None:
        queue.work()
        left.release()

    workers = [threading.Thread(target=work) for _ in range(2)]
    for w in workers:
        w.start()
    queue.retire(1)
    assert left.acquire(timeout=30), "no worker left"
    assert not left.acquire(blocking=False), "two workers left"
    assert sum(w.is_alive() for w in workers) >= 1
    queue.close()
    assert left.acquire(timeout=30), "the last worker did not leave"
    for w in workers:
        w.join(30)
    assert not any(w.is_alive() for w in workers)


@given(st.binary(max_size=2000), st.integers(1, 64), st.binary(min_size=16, max_size=16))
def test_chain_hashes_match_the_python_chain(key: bytes, step: int, prev: bytes) -> None:
    """The C chain gives what the Python loop it replaced gave (xxh3-128 of prev + namespace + page), so
    every page key stored before stays the same; a trailing partial page gets no hash."""
    expected, h = [], prev
    for start in range(0, len(key) - step + 1, step):
        h = xxhash.xxh3_128_digest(h + NS16 + key[start : start + step])
        expected.append(h)
    assert native.chain_hashes(key, step, NS16, prev) == expected


def test_chain_hashes_refuse_bad_arguments() -> None:
    """A step below 1, or a namespace digest or previous hash that is not 16 bytes, is refused by name."""
    with pytest.raises(ValueError, match="step"):
        native.chain_hashes(b"x" * 16, 0, NS16, NS16)
    with pytest.raises(ValueError, match="namespace_digest"):
        native.chain_hashes(b"x" * 16, 8, b"short", NS16)
    with pytest.raises(ValueError, match="prev"):
        native.chain_hashes(b"x" * 16, 8, NS16, b"short")


_REFUSED_FLAG = 1 << 30
"""A `preadv2` flag no kernel defines: refused with EOPNOTSUPP, as `RWF_NOWAIT` is on NFS and some FUSE mounts."""


def test_a_refused_probe_drops_the_probe_and_keeps_the_readahead(tmp_path: Path) -> None:
    """One flag meant "probe" and "read ahead": a filesystem refusing the probe got 0 back, and every later
    batch was read plainly (issue 22, item 5). The flags handed back now keep `READAHEAD`; without it the
    reader never probes, and nothing is dropped."""
    keys, bufs = ["abcd0000"], [bytearray(8)]
    flags = native.READAHEAD | _REFUSED_FLAG
    _, back, _ = native.read_pages(str(tmp_path), ".kvp", keys, bufs, NS16, flags)
    assert back == flags, "an absent page is opened, never read: nothing refused yet"
    page = tmp_path / "ab" / "abcd0000.kvp"
    page.parent.mkdir(parents=True)
    page.write_bytes(bytes(native.HEADER_SIZE + 8))
    codes, back, _ = native.read_pages(str(tmp_path), ".kvp", keys, bufs, NS16, flags)
    assert (codes, back) == (bytes([native.RETRY]), native.READAHEAD)
    assert native.read_pages(str(tmp_path), ".kvp", keys, bufs, NS16, back)[1] == native.READAHEAD
    assert native.read_pages(str(tmp_path), ".kvp", keys, bufs, NS16, 0)[1] == 0


def test_a_job_outliving_its_queue_is_refused_by_a_queue_at_its_address(tmp_path: Path) -> None:
    """A collected job named its queue by address: a new queue allocated at the freed one's address took
    it for its own (`cancel` answered, `submit` accepted it as a leader). Jobs name their queue by a
    generation number now (issue 22, item 8)."""
    root = str(tmp_path)
    queue = native.ReadQueue()
    job = queue.submit(root, ".kvp", ["abcd0000"], None, NS16, 0, None)
    worker, finished = _start_and_collect(queue, 1)
    assert finished == [job]
    queue.close()
    worker.join(30)
    del finished
    address = id(queue)
    del queue
    fresh = native.ReadQueue()
    try:
        if id(fresh) != address:
            pytest.skip("the allocator did not hand the freed queue's block on: nothing was exercised")
        with pytest.raises(ValueError, match="job"):
            fresh.cancel(job)
        with pytest.raises(ValueError, match="leader"):
            fresh.submit(root, ".kvp", ["abcd0001"], None, NS16, 0, None, job)
    finally:
        fresh.close()


class _Hook:
    """A read hook that can hold anything (a cycle back to its job or queue); weakly referenceable."""

    def __init__(self) -> None:
        self.held: object = None

    def __call__(self, keys: tuple[str, ...]) -> None:
        pass


def test_a_hook_cycling_back_to_a_pending_job_is_collected(tmp_path: Path) -> None:
    """A queue, a pending job and its hook holding the queue form a cycle; `ReadJob` and `ReadQueue` were not
    GC-tracked, so it leaked for good (issue 22, item 8). Now the collector frees it."""
    import gc
    import weakref

    queue = native.ReadQueue()
    hook = _Hook()
    hook.held = queue
    queue.submit(str(tmp_path), ".kvp", ["abcd0000"], None, NS16, 0, hook)
    alive = weakref.ref(hook)
    del queue, hook
    gc.collect()
    assert alive() is None


def test_a_hook_cycling_back_to_its_collected_job_is_collected(tmp_path: Path) -> None:
    """A finished job whose hook holds the job: a cycle through an untracked `ReadJob` leaked; now freed."""
    import gc
    import weakref

    queue = native.ReadQueue()
    hook = _Hook()
    job = queue.submit(str(tmp_path), ".kvp", ["abcd0000"], None, NS16, 0, hook)
    hook.held = job
    worker, finished = _start_and_collect(queue, 1)
    queue.close()
    worker.join(30)
    alive = weakref.ref(hook)
    del job, hook, finished
    gc.collect()
    assert alive() is None


def test_collect_keeps_finished_jobs_on_a_memory_error(tmp_path: Path) -> None:
    """`collect()` failing to allocate its list dropped every finished job it had taken: their callers
    waited for ever (issue 22, item 8). Now the jobs stay, the eventfd is signalled again, and the next
    `collect()` returns them. (A subprocess: allocations fail there on purpose.)"""
    pytest.importorskip("_testcapi")
    script = (
        "import select, sys, threading, _testcapi\n"
        "import _hicache_native as native\n"
        "queue = native.ReadQueue()\n"
        "job = queue.submit(sys.argv[1], '.kvp', ['abcd0000'], None, bytes(16), 0, None)\n"
        "worker = threading.Thread(target=queue.work); worker.start()\n"
        "select.select([queue.fileno()], [], [])\n"
        "queue.close(); worker.join()\n"
        "collect = queue.collect\n"
        "_testcapi.set_nomemory(0)\n"
        "try:\n"
        "    collect()\n"
        "except MemoryError:\n"
        "    _testcapi.remove_mem_hooks()\n"
        "    print('MemoryError')\n"
        "else:\n"
        "    _testcapi.remove_mem_hooks()\n"
        "print(bool(select.select([queue.fileno()], [], [], 0)[0]), queue.collect() == [job])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True, timeout=30
    )
    assert done.stdout.split() == ["MemoryError", "True", "True"], done.stdout + done.stderr
