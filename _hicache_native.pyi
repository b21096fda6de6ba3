"""Types of the C extension built from native/hicache_native.c (imported through storage_backends.native)."""

from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import Buffer

HIT: int
"""Outcome byte of `read_pages`: the page was read and verified."""
MISS: int
"""Outcome byte of `read_pages`: the page file does not exist."""
RETRY: int
"""Outcome byte of `read_pages`: something unusual (short, foreign, old or corrupt): re-read it checked."""
ERROR: int
"""Outcome byte of `read_pages`: opening or reading failed; its errno is in the errors list."""
HEADER_SIZE: int
"""Bytes of page header the C reader expects (page format v2: 56)."""
BUILD: int
"""The module's interface version (`storage_backends.native` refuses a build of another)."""
CHUNK_BYTES: int
"""Bytes read, then hashed, at a time: small enough to still be in the CPU cache when hashed."""
READAHEAD: int
"""Flag of `read_pages`' `nowait_flags`, beside the probe flags: read ahead (keep pages open and advised
ahead of the one being read) from the first page not in the page cache, or from the first page without a
probe flag. Without it every page is read plainly."""

def read_pages(
    root: str,
    suffix: str,
    keys: Sequence[str],
    buffers: Sequence[Buffer],
    namespace_digest: bytes,
    nowait_flags: int,
    /,
) -> tuple[bytes, int, list[tuple[int, int]]]:
    """Read and verify page `key` through its name `root/ab/<key><suffix>` (a link to its group file: the
    footer and table say where the page lies, docs/storage.md) into each buffer, the whole batch without
    the GIL.

    `nowait_flags` is 0 (plain reads) or `READAHEAD` with any probe flags (`RWF_NOWAIT`). Returns one outcome
    byte per page, the flags to pass next time (without the probe once the filesystem refused it,
    `READAHEAD` kept), and `(index, errno)` for every `ERROR` page. A file without a valid group table, one whose
    table does not name the key, or a page whose extent is not header plus buffer is `RETRY`, never `HIT`. All read threads together hold at most a quarter of the soft
    `RLIMIT_NOFILE` open ahead; a page beyond that, or whose open ahead hits EMFILE, is opened at its own
    turn, and one whose own open hits EMFILE or ENFILE is `RETRY` (re-read once the batch's files are closed).

    Raises:
        ValueError: naming the argument, for a key that is not 4-128 lowercase hex characters, a NUL in
            `root` or `suffix`, a digest that is not 16 bytes, or a buffer count or buffer that does not fit.
        TypeError: naming `keys[i]`, for a key that is not a str.
    """

class ReadJob:
    """A batch of pages, or a call, handed to a `ReadQueue`: its handle (cancel it, or take its result)."""

    call: bool
    """Whether the job calls a Python callable (`ReadQueue.call`) rather than reading pages."""
    finished: bool
    """Whether a worker finished the job: its buffers are written for good (`collect()` may not have taken
    it yet: a job of a set waits for the set's last)."""

    def times(self) -> tuple[int, int, int]:
        """When the job was queued, started and finished, in `time.monotonic_ns()` (0: not yet)."""

    def result(self) -> Any:
        """What `read_pages` returns for the batch (`tuple[bytes, int, list[tuple[int, int]]]`), or what a
        call job's callable returned, once the job is done.

        Raises:
            RuntimeError: if the job has not run.
            BaseException: what a call job's callable raised.
        """

class ReadQueue:
    """Worker threads (callers of `work()`) that read `ReadJob`s one after another without the GIL."""

    closed: bool
    """Whether `close()` was called."""

    def __init__(self) -> None: ...
    def submit(
        self,
        root: str,
        suffix: str,
        keys: Sequence[str],
        buffers: Sequence[Buffer] | None,
        namespace_digest: bytes,
        nowait_flags: int,
        hook: Callable[[tuple[str, ...]], object] | None,
        leader: ReadJob | None = None,
        /,
    ) -> ReadJob:
        """Queue a batch as `read_pages` takes it; `hook` is called with its keys in the worker first.
        With `buffers=None` the pages are only stat-ed, up to the first absent (MISS), failing (ERROR) or
        not regular (RETRY: a directory, FIFO, socket or device, symlinks followed) one.
        With a `leader` (a job of this queue) the job joins the leader's set: `fileno()` is signalled once
        the set's last unfinished job finishes, not once per job.

        Raises:
            RuntimeError: after `close()`.
            ValueError, TypeError: as `read_pages`, or naming `leader` (a job of another queue, one that
                was freed included: jobs name their queue by a generation number), before anything is queued.
        """
    def call(self, func: Callable[[], object], leader: ReadJob | None = None, /) -> ReadJob:
        """Queue a job that calls `func()` in a worker, with the GIL (the callable is dropped in the worker
        once called); `leader` as for `submit`.

        Raises:
            RuntimeError: after `close()`.
            TypeError: naming `func`, if it is not callable; ValueError: naming `leader`, as for `submit`.
        """
    def cancel(self, job: ReadJob, /) -> bool:
        """Remove a pending job (it never starts): True; False once it started. Signals `fileno()` either
        way (finished jobs of its set may be waiting for `collect()`)."""
    def collect(self) -> list[ReadJob]:
        """Every job finished since the last call, signalled or not (and `fileno()` reset).

        Raises:
            MemoryError: with every finished job kept for the next call (and `fileno()` signalled again).
        """
    def work(self) -> None:
        """Run pending jobs in this thread, without the GIL, until `close()` (once nothing is pending) or
        `retire()`."""
    def retire(self, n: int, /) -> None:
        """Ask `n` workers to leave `work()`."""
    def close(self) -> None:
        """Refuse new jobs; workers leave `work()` once nothing is pending."""
    def fileno(self) -> int:
        """An eventfd, readable while finished jobs wait for `collect()`."""

def chain_hashes(key: Buffer, step: int, namespace_digest: bytes, prev: bytes, /) -> list[bytes]:
    """One 16-byte xxh3-128 digest per full `step`-byte page of `key`: digest(previous page's hash +
    `namespace_digest` + the page's bytes), starting from `prev` (`hicache.keys.chained_page_hashes`).

    Raises:
        ValueError: naming the argument, for `step` < 1 or a digest or hash that is not 16 bytes.
    """

def xxh3_64(data: Buffer, /) -> int:
    """xxh3-64 (seed 0) of a C-contiguous buffer, as `xxhash.xxh3_64_intdigest`; releases the GIL."""

def chain_page_keys(
    key: Buffer, step: int, namespace_digest: bytes, prev: bytes, /
) -> tuple[list[bytes], list[str]]:
    """`chain_hashes`, and each hash's storage key (its 32 lowercase hex digits), aligned
    (`hicache.keys.chained_page_keys`).

    Raises:
        ValueError: as `chain_hashes`.
    """
