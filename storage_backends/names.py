"""Validation of the names a storage URL carries: S3 buckets, object prefixes and `file://` roots.

A name that could make pages land outside the place the URL names is refused, never repaired:

- **Buckets** follow the S3 general-purpose bucket naming rules: 3-63 characters of lowercase letters,
  digits, dots and hyphens; a letter or digit first and last; no two adjacent dots and no dot next to a
  hyphen; not an IPv4 address; none of the reserved prefixes (`xn--`, `sthree-`, `amzn-s3-demo-`) or
  suffixes (`-s3alias`, `--ol-s3`, `.mrap`, `--x-s3`, `--table-s3`). So `.`, `..`, `My_Bucket` and
  `192.168.0.1` are refused.
- **Prefixes** are `/`-separated segments; leading and trailing `/` are dropped. A URL's path is
  percent-decoded once first; a segment that is empty, `.` or `..`, a backslash, a control character, an
  encoded `/` (`%2F`) and a `%` left after decoding (a double encoding) are refused.
- **`file://` roots** are percent-decoded once, must be absolute, and are refused when a segment is `.` or
  `..` or when they hold a backslash, a control character, an encoded `/` or a `%` left after decoding.
  Repeated and trailing slashes are harmless and are collapsed (`file:///a//b/` is `/a/b`).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final
from urllib.parse import unquote, urlsplit

__all__ = [
    "check_url_names",
    "file_root_from_url_path",
    "prefix_from_url_path",
    "validate_bucket",
    "validate_prefix",
]

_BUCKET_CHARS: Final = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_RESERVED_PREFIXES: Final = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_SUFFIXES: Final = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
_ENCODED_SLASH: Final = re.compile(r"%2f", re.IGNORECASE)


def validate_bucket(bucket: object, *, argument: str = "bucket") -> str:
    """Return `bucket` if it is a valid S3 bucket name (see the module docstring), else raise.

    Raises:
        TypeError: naming `argument`, for a non-str.
        ValueError: naming `argument` and the rule broken.
    """
    if not isinstance(bucket, str):
        raise TypeError(f"{argument}: expected a str, got {type(bucket).__name__}")
    if ":" in bucket or "@" in bucket:
        # Never echoed: `s3://key:sec/ret@bucket` (a raw `/` in a password) reaches here as `key:sec`.
        raise ValueError(
            f"{argument}: a bucket name has no ':' or '@' (user info or a port), got one with them"
        )
    shown = ascii(bucket)
    if not 3 <= len(bucket) <= 63:
        raise ValueError(f"{argument}: a bucket name has 3 to 63 characters, got {len(bucket)} ({shown})")
    if _BUCKET_CHARS.fullmatch(bucket) is None:
        raise ValueError(
            f"{argument}: a bucket name holds only lowercase letters, digits, '.' and '-', and starts and "
            f"ends with a letter or digit, got {shown}"
        )
    if ".." in bucket or ".-" in bucket or "-." in bucket:
        raise ValueError(f"{argument}: a bucket name has no '..', '.-' or '-.', got {shown}")
    try:
        ipaddress.IPv4Address(bucket)
    except ValueError:
        pass
    else:
        raise ValueError(f"{argument}: a bucket name must not be an IP address, got {shown}")
    if bucket.startswith(_RESERVED_PREFIXES) or bucket.endswith(_RESERVED_SUFFIXES):
        raise ValueError(f"{argument}: {shown} uses a prefix or suffix S3 reserves")
    return bucket


def _check_segments(text: str, *, argument: str, shown: str, allow_empty: bool) -> list[str]:
    if "\\" in text:
        raise ValueError(f"{argument}: backslashes are not allowed, got {shown}")
    if _CONTROL.search(text):
        raise ValueError(f"{argument}: control characters are not allowed, got {shown}")
    if "%" in text:
        raise ValueError(f"{argument}: '%' is not allowed (a URL path is decoded once), got {shown}")
    segments = text.split("/")
    for segment in segments:
        if segment in {".", ".."} or (segment == "" and not allow_empty):
            raise ValueError(f"{argument}: empty, '.' or '..' path segments are not allowed, got {shown}")
    return segments


def validate_prefix(prefix: object, *, argument: str = "prefix") -> str:
    """Return the object-name prefix `prefix` without leading or trailing `/`, or raise.

    The prefix is taken literally (no percent-decoding; see `prefix_from_url_path` for URLs).

    Raises:
        TypeError: naming `argument`, for a non-str.
        ValueError: naming `argument`, for an empty, `.` or `..` segment, a backslash, a control
            character or a `%`.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"{argument}: expected a str, got {type(prefix).__name__}")
    stripped = prefix.strip("/")
    if stripped:
        _check_segments(stripped, argument=argument, shown=ascii(prefix), allow_empty=False)
    return stripped


def _decode_once(path: str, *, argument: str) -> str:
    if _ENCODED_SLASH.search(path):
        raise ValueError(f"{argument}: an encoded '/' (%2F) is ambiguous and not allowed, got {path!a}")
    try:
        return unquote(path, errors="strict")
    except UnicodeDecodeError:
        raise ValueError(f"{argument}: the percent-encoding is not UTF-8, got {path!a}") from None


def prefix_from_url_path(path: str, *, argument: str = "prefix") -> str:
    """The object prefix a URL's path names: percent-decoded once, then checked by `validate_prefix`.

    Raises:
        ValueError: naming `argument`, for an encoded `/`, invalid percent-encoding, or a prefix
            `validate_prefix` refuses.
    """
    return validate_prefix(_decode_once(path, argument=argument), argument=argument)


def file_root_from_url_path(path: str, *, argument: str = "root") -> str:
    """The directory a `file://` URL's path names: decoded once, absolute, no `.`/`..` segments.

    Repeated and trailing slashes are collapsed; everything else that could leave the named directory
    is refused (see the module docstring).

    Raises:
        ValueError: naming `argument`, for a relative path, an encoded `/`, a `.` or `..` segment, a
            backslash, a control character, or a `%` left after decoding.
    """
    decoded = _decode_once(path, argument=argument)
    shown = ascii(path)
    if not decoded.startswith("/"):
        raise ValueError(f"{argument}: expected an absolute path (file:///abs/path), got {shown}")
    segments = _check_segments(decoded, argument=argument, shown=shown, allow_empty=True)
    return "/" + "/".join(s for s in segments if s)


def check_url_names(url: str) -> None:
    """Check the names in a `s3://bucket/prefix` or `file:///root` URL; other schemes pass unchecked.

    Lets a configuration refuse a bad storage URL when it is built, before any backend is opened.

    Raises:
        ValueError: naming `bucket`, `prefix` or `root`, as `validate_bucket`, `prefix_from_url_path` and
            `file_root_from_url_path` do.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        validate_bucket(parts.netloc.rpartition("@")[2])
        prefix_from_url_path(parts.path)
    elif scheme == "file":
        file_root_from_url_path(parts.path)
