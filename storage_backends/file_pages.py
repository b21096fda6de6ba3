"""The file backend's page files: where a page lives, and the work on it that runs in worker threads.

`PageFiles` knows the layout under one root and does the work on it: batched reads through the C extension,
a checked re-read of any page the C reader found unusual, group writes, stat and unlink.

Layout (docs/storage.md, "Group files"): each put's share of one worker thread is one group file, its pages
(each a `page_format` header followed by the payload) end to end, then a table of `GROUP_ENTRY` (key digest,
offset) per page and a `GROUP_FOOTER` (magic `GROUP_MAGIC`, `GROUP_VERSION`, count, xxh3-64 of the table).
The group file has no name of its own once written: every page's name `root/ab/<key>.kvp` is a hard link to
it, so the directory is the index, `exists` is a stat, `delete` unlinks one name and the filesystem frees
the group with its last name. It runs in worker threads only; `FileBackend`
(`storage_backends.file`) is the async face that validates, groups, counts and cancels.

Reads: the C reader (`native.ReadQueue`'s workers, see `storage_backends.threads`) reads and verifies
every page of a group straight into its buffer without the GIL (each chunk hashed while still in cache: one
pass over memory per verified page). It answers only "verified", "absent", "error" or "look again"
(`statuses`); a page it flags is read again here, field by field (`read_checked`), so the reason (truncated,
foreign, old format, corrupt, not a regular file) is named in one place, in Python.
"""

from __future__ import annotations

import errno as errno_names
import logging
import os
import secrets
import stat
import struct
from collections.abc import Sequence

from storage_backends import native
from storage_backends.batching import ERROR, HIT, MISS
from storage_backends.errors import (
    ChecksumMismatch,
    ForeignPage,
    OldPageFormat,
    StorageAuthError,
    StorageError,
)
from storage_backends.page_format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    check_stored_size,
    failure_status,
    key_digest,
    verify_page,
)
from storage_backends.protocol import PageStatus

__all__ = [
    "GROUP_ENTRY",
    "GROUP_FOOTER",
    "GROUP_MAGIC",
    "GROUP_VERSION",
    "NOWAIT",
    "READ_AHEAD",
    "SUFFIX",
    "PageFiles",
]

log = logging.getLogger("storage_backends.file")

SUFFIX = ".kvp"
"""File name suffix of a stored page."""

NOWAIT: int = getattr(os, "RWF_NOWAIT", 0) if hasattr(os, "posix_fadvise") else 0
"""`preadv2` flag: fail with EAGAIN instead of waiting for the device (Linux >= 4.14); 0 where absent."""

READ_AHEAD: int = native.READAHEAD | NOWAIT if NOWAIT else 0
"""The C reader's flags for reads with readahead: probe with `NOWAIT`, read ahead from the first cold page.
Two bits: a filesystem refusing the probe (NFS, some FUSE mounts) drops the probe, never the readahead."""

GROUP_MAGIC = b"HKVG"
"""The four bytes a group file's footer starts with."""

GROUP_VERSION = 1
"""The group format version (the footer's fifth byte); the page header keeps its own version."""

GROUP_ENTRY = struct.Struct("<16sQ")
"""A group table entry: the page's key digest (`page_format.key_digest`) and its offset in the file."""

GROUP_FOOTER = struct.Struct("<4sB3xQQ")
"""A group file's last bytes: magic, version, reserved (0), page count, xxh3-64 of the table."""

_TMP_SUFFIX = ".tmp"
_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_STATUS: dict[int, PageStatus] = {native.HIT: HIT, native.MISS: MISS, native.ERROR: ERROR}

assert native.HEADER_SIZE == HEADER_SIZE, "the C reader and page_format disagree on the header size"


class PageFiles:
    """Pages as files under `root`; every method but `statuses` (cheap: it maps the C reader's outcome)
    runs in a worker thread, never on the loop.

    Args:
        root: the absolute directory holding the pages.
        namespace_digest: the 16-byte namespace digest every page must carry.
        durable: fsync each page and its directory before reporting it written.
        read_flags: the C reader's flags (`READ_AHEAD`, or 0 for plain reads without readahead); the probe
            bit is dropped for good when the filesystem refuses it (NFS, some FUSE mounts), `native.READAHEAD`
            stays.
    """

    __slots__ = ("_durable", "_known_dirs", "_namespace", "read_flags", "root")

    def __init__(self, root: str, namespace_digest: bytes, *, durable: bool, read_flags: int) -> None:
        self.root = root
        self._namespace = namespace_digest
        self._durable = durable
        self.read_flags = read_flags
        self._known_dirs: set[str] = set()

    def path(self, key: str) -> str:
        """The file of page `key` (the key must be validated: 4-128 lowercase hex characters)."""
        return f"{self.root}/{key[0:2]}/{key}{SUFFIX}"

    def statuses(
        self, keys: Sequence[str], codes: bytes, read_flags: int, errors: Sequence[tuple[int, int]]
    ) -> list[PageStatus | None]:
        """The outcome of a group the C reader read (`native.read_pages`' or a `ReadQueue` job's result):
        one status per page, None for a page to re-read checked (`read_checked`). Logs the errors and
        keeps the flags the reader hands back (without the probe for good once the filesystem refused it;
        such a filesystem's groups are read ahead from their first page).

        The reader reads with `RWF_NOWAIT` while the page cache holds the pages; the first page that would
        wait for the device switches the rest of the group to readahead (the next 32 pages kept open and
        advised with `posix_fadvise(WILLNEED)` ahead of the one being read), so a cold group keeps the device
        busy with many reads at once (measured with `bench/bench_io.py`: 64 KiB pages, 4 threads, cold cache,
        0.95 -> 1.5 GB/s) and a group of thousands of small pages holds 32 files open, not thousands (and
        all worker threads together at most a quarter of the process's descriptor limit: no EMFILE).
        """
        self.read_flags &= read_flags
        if codes.count(native.HIT) == len(codes):
            return [HIT] * len(codes)
        for i, err in errors:
            log.warning("cannot read page %s: %s", self.path(keys[i]), _describe(err))
        return [_STATUS.get(code) for code in codes]

    def recheck(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """`read_checked` of each page (in a worker thread)."""
        return [self.read_checked(key, buf) for key, buf in zip(keys, buffers, strict=True)]

    def read_checked(self, key: str, buf: memoryview) -> PageStatus:
        """Read one page plainly and verify it field by field, logging the first problem found.

        A path that is not a regular file (a FIFO, a device, a directory) is an `ERROR`, refused before any
        read: it is opened without blocking and checked first, as the C reader does, so a FIFO cannot hold
        the thread (and the caller's buffer) until some writer comes.
        """
        path = self.path(key)
        header = bytearray(HEADER_SIZE)
        try:
            fd = os.open(path, _O_READ | os.O_NONBLOCK)
        except FileNotFoundError:
            return MISS
        except OSError as exc:
            log.warning("cannot open page %s: %s", path, exc)
            return ERROR
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                log.warning("cannot read page %s: %s", path, _not_regular(st.st_mode))
                return ERROR
            os.set_blocking(fd, True)
            try:
                offset, extent = _locate(fd, st.st_size, key)
            except ChecksumMismatch as exc:
                log.warning("discarding page %s: %s", path, exc)
                return failure_status(exc)
            got = _read_all(fd, header, buf, offset)
        except OSError as exc:
            log.warning("cannot read page %s: %s", path, exc)
            return ERROR
        finally:
            os.close(fd)
        try:
            # The header and extent first (foreign, old format, truncated, overlong or of another length:
            # `check_stored_size` names which), then the payload of a page of the right size.
            check_stored_size(
                memoryview(header)[: min(got, extent, HEADER_SIZE)], extent, buf.nbytes, self._namespace, key
            )
            verify_page(header, buf, self._namespace, key)
        except ChecksumMismatch as exc:
            log.warning("discarding page %s: %s", path, exc)
            return failure_status(exc)
        return HIT

    def extent(self, key: str) -> tuple[str, int, int]:
        """Where page `key` lies: its path, and the offset and length (header + payload) of its bytes in
        that group file (what a test damages to damage one page). In a worker thread or a test.

        Raises:
            FileNotFoundError: if the page has no file.
            ChecksumMismatch: if its group has no valid table, or the table does not name `key`.
        """
        path = self.path(key)
        fd = os.open(path, _O_READ)
        try:
            offset, extent = _locate(fd, os.fstat(fd).st_size, key)
        finally:
            os.close(fd)
        return path, offset, extent

    def write_group(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Write a group of pages as one group file, a hard link per page; one outcome per page.

        The C writer (`native.write_group`) builds each header, the table and the footer and writes the
        group without the GIL, then names each page (replacing a name already there: an old one-file
        page, a torn or foreign one, or an empty directory, which `exists` counts absent).
        """
        for directory in {f"{self.root}/{key[0:2]}" for key in keys} - self._known_dirs:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError:
                continue  # the page's link fails and is reported below
            self._known_dirs.add(directory)
        tag = f".{secrets.token_hex(8)}{_TMP_SUFFIX}"
        errors = native.write_group(
            self.root, list(keys), list(buffers), self._namespace, SUFFIX, tag, self._durable
        )
        if not any(errors):
            return [HIT] * len(keys)
        out: list[PageStatus] = []
        for key, err in zip(keys, errors, strict=True):
            if err:
                log.warning("cannot write page %s: %s", self.path(key), _describe(err))
                out.append(ERROR)
            else:
                out.append(HIT)
        return out

    def stat_failure(self, key: str, err: int) -> StorageError:
        """The error for page `key`, whose path `stat` failed on with errno `err` (EACCES, ELOOP, ENOTDIR):
        logged, and raised by `exists`, which cannot say how many pages are stored (never a miss)."""
        message = f"cannot stat page {self.path(key)}: {_describe(err)}"
        log.warning("%s", message)
        if err in (errno_names.EACCES, errno_names.EPERM):
            return StorageAuthError(message)
        return StorageError(message)

    def log_not_a_page(self, key: str) -> None:
        """Log that page `key`'s path holds no regular file (a directory, FIFO, socket or device, symlinks
        followed): `exists` counts it absent, so write-through replaces it (`write_group`). No I/O: it runs on
        the event loop."""
        log.warning(
            "no page at %s: not a regular file (a directory, FIFO, socket or device); counted absent, the "
            "next write replaces it",
            self.path(key),
        )

    def delete_group(self, keys: Sequence[str]) -> None:
        """Remove the page files of `keys`; absent ones are ignored.

        Raises:
            StorageError: if a file exists but cannot be removed.
        """
        for key in keys:
            try:
                os.unlink(self.path(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StorageError(f"cannot delete page {key}: {exc}") from exc


def _not_regular(mode: int) -> str:
    """Why a path with `mode` is no page file: what it is instead."""
    if stat.S_ISDIR(mode):
        return _describe(errno_names.EISDIR)
    kind = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device"}
    return f"not a regular file ({kind.get(stat.S_IFMT(mode), 'a block device or other special file')})"


def _describe(err: int) -> str:
    name = errno_names.errorcode.get(err, str(err))
    return f"[Errno {err}] {os.strerror(err)} ({name})"


def _locate(fd: int, size: int, key: str) -> tuple[int, int]:
    """The offset and extent (header + payload bytes, up to the next page or the table) of page `key` in the
    group file `fd` of `size` bytes, as the C reader's `find_page` finds them.

    Raises:
        OldPageFormat: a file without a group footer that starts with a page header of another format
            version, or is one v2 page header and the payload it announces (a one-file page of the layout
            before page groups): a miss the next put replaces.
        ChecksumMismatch: a torn group: no whole footer and table, or a table whose checksum fails.
        ForeignPage: the group's table does not name `key` (a name linked or copied over this key).
    """
    if size < GROUP_FOOTER.size + GROUP_ENTRY.size:
        raise _no_group(fd, size)
    footer = os.pread(fd, GROUP_FOOTER.size, size - GROUP_FOOTER.size)
    magic, version, count, checksum = GROUP_FOOTER.unpack(footer)
    if magic != GROUP_MAGIC or version != GROUP_VERSION or footer[5:8] != b"\0\0\0":
        raise _no_group(fd, size)
    # Each entry names a page of at least a header before the table: a count beyond that is torn (and
    # never sizes a read larger than the file's pages could need).
    if not 0 < count <= (size - GROUP_FOOTER.size) // (GROUP_ENTRY.size + HEADER_SIZE):
        raise ChecksumMismatch(f"group table of {count} pages does not fit a file of {size} bytes")
    table_start = size - GROUP_FOOTER.size - count * GROUP_ENTRY.size
    table = os.pread(fd, count * GROUP_ENTRY.size, table_start)
    if len(table) != count * GROUP_ENTRY.size or native.xxh3_64(table) != checksum:
        raise ChecksumMismatch("group table fails its checksum (a torn group)")
    entries = list(GROUP_ENTRY.iter_unpack(table))
    digest = key_digest(key)
    for j, (entry_digest, offset) in enumerate(entries):
        if entry_digest == digest:
            end = entries[j + 1][1] if j + 1 < count else table_start
            if not offset <= end <= table_start:
                raise ChecksumMismatch(f"group table places the page at {offset}..{end}, outside its pages")
            return offset, end - offset
    raise ForeignPage("the group's table does not name this key (a name linked or copied over it)")


def _no_group(fd: int, size: int) -> ChecksumMismatch:
    """Why a file without a group footer is no page: a one-file page of the old layout, or damage."""
    header = os.pread(fd, HEADER_SIZE, 0)
    if header[: len(MAGIC)] == MAGIC and header[4:5] != bytes([FORMAT_VERSION]):
        return OldPageFormat(f"a page of format version {header[4]} (no group footer)")
    if header[: len(MAGIC)] == MAGIC and size == HEADER_SIZE + int.from_bytes(header[40:48], "little"):
        return OldPageFormat("a one-file page of the layout before page groups (no group footer)")
    return ChecksumMismatch("no group footer (a torn or foreign file)")


def _read_all(fd: int, header: bytearray, buf: memoryview, offset: int) -> int:
    """Read header and payload from `offset` until both are full or the file ends (FUSE may split reads)."""
    want = HEADER_SIZE + buf.nbytes
    hview = memoryview(header)
    bview = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    got = 0
    while got < want:
        if got < HEADER_SIZE:
            n = os.preadv(fd, [hview[got:], bview], offset + got)
        else:
            n = os.preadv(fd, [bview[got - HEADER_SIZE :]], offset + got)
        if n == 0:
            break
        got += n
    return got
