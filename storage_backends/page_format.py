"""The fixed header stored in front of every page payload, and the checks a reader runs on it.

Layout of format version 2 (little-endian, `HEADER_SIZE` = 56 bytes)::

    offset  size  field
         0     4  magic b"HKVP"
         4     1  format version (2)
         5     1  flags (0; reserved for compression/encryption bits)
         6     2  reserved (0)
         8    16  namespace digest (`hicache.keys.Namespace.digest`)
        24    16  key digest: xxh3-128 of the page's storage key (ASCII hex), see `key_digest`
        40     8  payload length in bytes (u64)
        48     8  xxh3-64 of the payload (u64)

A reader trusts a page only after `verify_page` passes, checking in order: magic, version, flags, namespace,
key, payload length, checksum. The namespace check turns a page written by a differently configured cache into
a miss; the key check does the same for a valid page copied, renamed or symlinked over another key's object
(the object name alone says nothing: only the header binds bytes to a key); the length check catches
truncation, and the checksum catches torn or flipped bytes. Version 1 pages (a 40-byte header without the key
digest) are misses (`OldPageFormat`), never read and never a crash.

The key digest guards against careless and accidental aliasing, not against a forger who can write the store
(such a writer can write any header it likes).

`encode_header` and `verify_page` hash the whole payload (about 25 GB/s, but still ~40 us per MiB): backends
call them inside worker threads, never on the event loop. The payload checksum is the C extension's
`xxh3_64` (`storage_backends.native`), which releases the GIL for any payload of 4 KiB or more, so those
threads do not stall the loop either (python-xxhash keeps the GIL up to 64 KiB). The file backend's reads
verify inside the C extension instead, in the same pass as the read (`storage_backends.file_pages`).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

from storage_backends.errors import ChecksumMismatch, ForeignPage, OldPageFormat
from storage_backends.native import xxh3_64
from storage_backends.protocol import PageStatus

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "KEY_DIGEST_SIZE",
    "MAGIC",
    "NAMESPACE_DIGEST_SIZE",
    "PageHeader",
    "check_namespace_digest",
    "check_stored_size",
    "decode_header",
    "encode_header",
    "failure_status",
    "key_digest",
    "page_key",
    "validate_key",
    "validate_keys",
    "verify_page",
]

MAGIC = b"HKVP"
"""The four bytes every stored page starts with."""

FORMAT_VERSION = 2
"""The page format version this module writes and reads (1: no key digest; read as a miss)."""

NAMESPACE_DIGEST_SIZE = 16
"""Length of a namespace digest in bytes."""

KEY_DIGEST_SIZE = 16
"""Length of a key digest in bytes."""

_HEADER = struct.Struct("<4sBBH16s16sQQ")
_PREFIX = struct.Struct("<4sB")

HEADER_SIZE: int = _HEADER.size
"""Bytes of header in front of every stored payload (56)."""

_KEY_RE = re.compile(r"[0-9a-f]{4,128}")
_HEX_DIGITS = b"0123456789abcdef"


class PageHeader(NamedTuple):
    """The decoded fields of a page header (the magic is checked, not kept)."""

    version: int
    flags: int
    namespace_digest: bytes
    key_digest: bytes
    payload_length: int
    checksum: int


def key_digest(key: str) -> bytes:
    """The 16-byte digest of a storage key that a page's header carries (xxh3-128 of its ASCII)."""
    return xxhash.xxh3_128_digest(key.encode("ascii"))


def failure_status(exc: ChecksumMismatch) -> PageStatus:
    """The `PageStatus` a read reports for a page that failed verification with `exc`."""
    if isinstance(exc, ForeignPage):
        return PageStatus.FOREIGN
    if isinstance(exc, OldPageFormat):
        return PageStatus.OLD_FORMAT
    return PageStatus.CORRUPT


def check_namespace_digest(namespace_digest: bytes) -> bytes:
    """Return `namespace_digest` as `bytes` after checking it is 16 bytes.

    Raises:
        TypeError: if it is not bytes-like.
        ValueError: if it is not exactly 16 bytes long.
    """
    if not isinstance(namespace_digest, bytes | bytearray | memoryview):
        raise TypeError(f"namespace_digest: expected 16 bytes, got {type(namespace_digest).__name__}")
    digest = bytes(namespace_digest)
    if len(digest) != NAMESPACE_DIGEST_SIZE:
        raise ValueError(f"namespace_digest: expected {NAMESPACE_DIGEST_SIZE} bytes, got {len(digest)}")
    return digest


def page_key(hash: bytes) -> str:
    """The storage key of a page: the lowercase hex form of its chained page hash.

    Raises:
        TypeError: if `hash` is not bytes-like.
        ValueError: if `hash` is shorter than 2 or longer than 64 bytes.
    """
    if not isinstance(hash, bytes | bytearray | memoryview):
        raise TypeError(f"hash: expected bytes, got {type(hash).__name__}")
    raw = bytes(hash)
    if not 2 <= len(raw) <= 64:
        raise ValueError(f"hash: expected 2 to 64 bytes, got {len(raw)}")
    return raw.hex()


def validate_keys(keys: Sequence[str]) -> None:
    """Check that every key is 4 to 128 lowercase hex characters, as `page_key` makes them.

    Backends that turn keys into paths or object names call this so no key can escape its root
    (`../x`, `/etc/passwd`, `a/b`) or alias another on a case-insensitive store.

    Raises:
        ValueError: naming `keys` and the first offending key.
    """
    if not keys:
        return
    # Fast path in C: lengths via map(len), characters by deleting every hex digit from the joined keys
    # (a 16k-page batch in ~1 ms of event-loop time, against ~7 ms for a per-key regex).
    if all(type(k) is str for k in keys) and min(map(len, keys)) >= 4 and max(map(len, keys)) <= 128:
        try:
            joined = "".join(keys).encode("ascii")
        except UnicodeEncodeError:
            joined = b"x"
        if not joined.translate(None, _HEX_DIGITS):
            return
    for i, key in enumerate(keys):
        validate_key(key, name=f"keys[{i}]")


def validate_key(key: object, *, name: str = "key") -> None:
    """Check one key as `validate_keys` does.

    Raises:
        ValueError: naming `name` (the caller's argument) and the key.
    """
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ValueError(f"{name}: expected 4-128 lowercase hex characters, got {key!r}")


def encode_header(payload: memoryview, namespace_digest: bytes, key: str) -> bytes:
    """Build the header stored in front of `payload` (hashes the payload: call it off the event loop).

    Args:
        payload: the page payload as bytes-like (any buffer xxhash accepts).
        namespace_digest: the writer's 16-byte namespace digest.
        key: the storage key the page is written under.
    """
    digest = check_namespace_digest(namespace_digest)
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, digest, key_digest(key), view.nbytes, xxh3_64(view))


def decode_header(header: bytes | bytearray | memoryview) -> PageHeader:
    """Decode a header without looking at any payload.

    Raises:
        OldPageFormat: for a page of another format version (checked before the header's length, so a
            short version 1 page is reported as such).
        ChecksumMismatch: if the header is short, has the wrong magic, or flags or reserved bits this
            version does not define.
    """
    if len(header) >= _PREFIX.size:
        magic, version = _PREFIX.unpack_from(header)
        if magic == MAGIC and version != FORMAT_VERSION:
            raise OldPageFormat(f"page format version {version}, this reader reads {FORMAT_VERSION}")
    if len(header) < HEADER_SIZE:
        raise ChecksumMismatch(f"page header is truncated: {len(header)} of {HEADER_SIZE} bytes")
    magic, version, flags, reserved, digest, kdigest, length, checksum = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise ChecksumMismatch(f"bad page magic {magic!r}, expected {MAGIC!r}")
    if flags or reserved:
        # Version 2 defines no flags: a page with any set (say, compressed) must not be read as raw bytes.
        raise ChecksumMismatch(f"unsupported page flags {flags:#04x} (reserved {reserved:#06x})")
    return PageHeader(version, flags, digest, kdigest, length, checksum)


def _check_owner(fields: PageHeader, namespace_digest: bytes, key: str) -> None:
    if fields.namespace_digest != namespace_digest:
        raise ForeignPage(
            f"page belongs to namespace {fields.namespace_digest.hex()}, expected {bytes(namespace_digest).hex()}"
        )
    if fields.key_digest != key_digest(key):
        raise ForeignPage(f"page was written under another key (key digest {fields.key_digest.hex()})")


def check_stored_size(
    header: bytes | bytearray | memoryview,
    stored_bytes: int,
    buffer_bytes: int,
    namespace_digest: bytes,
    key: str,
) -> None:
    """Check a stored page of `stored_bytes` bytes (header included) against a `buffer_bytes` buffer.

    For a reader that found the stored size differs from `HEADER_SIZE + buffer_bytes`, or has not looked.
    Every such page is the page's fault, never the caller's: the namespace digest binds the page bytes'
    layout (`hicache.keys.Namespace.layout`), so a page of this namespace and key holding another number of
    bytes was written wrongly or damaged, and is as unusable as a torn one (a `CORRUPT` miss, which the
    cache deletes so that write-through can put the real page back).

    Raises:
        ChecksumMismatch: with `failure_status` saying why, for a bad, foreign or old-format header, or a
            truncated, overlong or well-formed page of another length.
    """
    fields = decode_header(header)
    _check_owner(fields, namespace_digest, key)
    if fields.payload_length != buffer_bytes:
        raise ChecksumMismatch(
            f"page holds {fields.payload_length} payload bytes, the reader's page has {buffer_bytes}"
        )
    if stored_bytes != HEADER_SIZE + buffer_bytes:
        raise ChecksumMismatch(f"page is {stored_bytes} bytes, expected {HEADER_SIZE + buffer_bytes}")


def verify_page(
    header: bytes | bytearray | memoryview, payload: memoryview, namespace_digest: bytes, key: str
) -> None:
    """Check a stored page against its header and the key it was read under; return quietly when it verifies.

    Checks, in order: magic, version, flags, header size, namespace digest, key digest, payload length,
    xxh3-64 checksum. Hashes the payload: call it off the event loop.

    Raises:
        ForeignPage: the header names another namespace or key.
        OldPageFormat: the page is of another format version.
        ChecksumMismatch: with the reason, for the first other check that fails.
    """
    fields = decode_header(header)
    payload = payload if isinstance(payload, memoryview) else memoryview(payload)
    _check_owner(fields, namespace_digest, key)
    if fields.payload_length != payload.nbytes:
        raise ChecksumMismatch(
            f"page payload length is {payload.nbytes} bytes, header says {fields.payload_length}"
        )
    actual = xxh3_64(payload)
    if actual != fields.checksum:
        raise ChecksumMismatch(
            f"page checksum mismatch: stored {fields.checksum:016x}, computed {actual:016x}"
        )
