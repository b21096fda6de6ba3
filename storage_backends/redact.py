"""One place that decides what may be shown of a storage URL, its options and error text.

Everything hicache prints about storage (config `repr`/`str`, log records, exception messages, the demo's
table and JSON, `hicache inspect`, metric labels, a backend's `repr`) goes through these helpers, so a
credential given in a URL query, in user info, in keyword options or in the environment is never shown.

What counts as secret is decided by the option's *name*, word by word (words split at any separator, any
case): a word containing `secret`, `password`, `passwd`, `token`, `key`, `credential`, `session`,
`signature`, `auth`, `cookie` or `private`, or one that is exactly `sig`, `pwd`, `pass` or `sas`; the
plain words `tokens`, `keys` and `tokenizer` name counts and lists and are not secret. Values under other
names (`bucket`, `endpoint`, `region`, `max_concurrency`, ...) stay visible, except that a value that is
itself a URL is redacted in turn. User info (`user:password@`) is always replaced.

This module lives in `storage_backends` (and imports nothing from `hicache`) so that backends and the
controller can both use it while imports stay one-way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import SplitResult, parse_qsl, unquote, unquote_plus, urlsplit, urlunsplit

__all__ = [
    "LOGGERS",
    "REDACTED",
    "RedactingFilter",
    "environment_secrets",
    "is_secret_name",
    "redact_options",
    "redact_text",
    "redact_url",
    "redact_value",
    "redacted_repr",
    "remember_secrets",
    "secret_values",
]

REDACTED: Final = "***"
"""What a secret value is replaced with."""

_SECRET_PARTS: Final = (
    "secret",
    "password",
    "passwd",
    "token",
    "key",
    "credential",
    "session",
    "signature",
    "auth",
    "cookie",
    "private",
)
_SECRET_WORDS: Final = frozenset({"sig", "pwd", "pass", "sas"})
_NOT_SECRET_WORDS: Final = frozenset({"tokens", "keys", "tokenizer"})
"""Whole words that name counts and lists, not credentials (`num_tokens`, `keys`): a log of them stays readable."""
_WORD_SPLIT: Final = re.compile(r"[^a-z0-9]+")

_URL_IN_TEXT: Final = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
"""A URL inside free text: scheme, `://`, then up to whitespace or a quote."""

_ASSIGNMENT_IN_TEXT: Final = re.compile(
    r"""(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P<sep>\s*=\s*["']?)(?P<value>[^\s,;&'"}\])]+)"""
    r"""|(?P<qname>["'][A-Za-z_][A-Za-z0-9_.-]*["'])(?P<qsep>\s*:\s*["']?)(?P<qvalue>[^\s,;&'"}\])]+)"""
)
"""`name=value` or a quoted `"name": "value"` (a mapping's repr) inside free text."""

_MIN_ENV_SECRET: Final = 6
"""Shorter environment values are not scrubbed from text: they would match ordinary words."""

_MIN_SECRET: Final = 4
"""Shorter known secrets are not scrubbed from free text (a one-letter user name would mangle it all);
URLs and `name=value` pairs in the text are still redacted by name."""


def is_secret_name(name: object) -> bool:
    """Whether an option or query parameter called `name` holds a secret (see the module docstring)."""
    return isinstance(name, str) and _is_secret_str(name)


@functools.lru_cache(maxsize=4096)
def _is_secret_str(name: str) -> bool:
    # Cached: the log filter asks about every environment variable's name for every record.
    for word in _WORD_SPLIT.split(name.lower()):
        if word in _NOT_SECRET_WORDS:
            continue
        if word in _SECRET_WORDS or any(part in word for part in _SECRET_PARTS):
            return True
    return False


def _redact_pairs(text: str) -> str:
    """Redact the secret values of an `a=1&b=2` string, keeping every other byte as given."""
    if not text:
        return text
    pieces = []
    for pair in re.split(r"([&;])", text):
        if pair in ("&", ";"):
            pieces.append(pair)
            continue
        name, eq, value = pair.partition("=")
        if eq and is_secret_name(unquote_plus(name)):
            pieces.append(f"{name}={REDACTED}")
        elif eq and "://" in unquote_plus(value):
            pieces.append(f"{name}={redact_url(unquote_plus(value))}")
        else:
            pieces.append(pair)
    return "".join(pieces)


def _misparsed_userinfo(parts: SplitResult) -> str | None:
    """User info that `urlsplit` cut at a raw `/` (`s3://user:pa/ss@host/p`), or None.

    Such a URL is malformed, but a hand-written one is common: `urlsplit` then puts `user:pa` in the
    netloc and `ss@host` in the path, and the password would be shown as part of the path.
    """
    if "@" in parts.netloc or ":" not in parts.netloc or "@" not in parts.path:
        return None
    return f"{parts.netloc}{parts.path.rpartition('@')[0]}"


def redact_url(url: object) -> str:
    """`url` with its user info and the secret values of its query and fragment replaced by `***`.

    The scheme, host, port, path and non-secret parameters (`endpoint`, `region`, ...) are kept, so the
    result still says where the storage is. A value that cannot be parsed as a URL is shown only up to
    its first `?` or `#`, with any user info removed.

    Args:
        url: a storage URL (any object: a non-str is shown as its `repr`, redacted the same way).
    """
    text = url if isinstance(url, str) else repr(url)
    try:
        parts = urlsplit(text)
        netloc, path = parts.netloc, parts.path
        if "@" in netloc:
            netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
        elif _misparsed_userinfo(parts) is not None:
            host, slash, path = path.rpartition("@")[2].partition("/")
            netloc, path = f"{REDACTED}@{host}", slash + path
        return urlunsplit(
            (parts.scheme, netloc, path, _redact_pairs(parts.query), _redact_pairs(parts.fragment))
        )
    except ValueError:
        head = re.split(r"[?#]", text, maxsplit=1)[0]
        scheme, sep, rest = head.partition("://")
        netloc, slash, path = rest.partition("/")
        if sep and "@" in netloc:
            head = f"{scheme}://{REDACTED}@{netloc.rpartition('@')[2]}{slash}{path}"
        cut = len(re.split(r"[?#]", text, maxsplit=1)) > 1
        return head + (f"?{REDACTED}" if cut else "")


def redact_value(name: object, value: Any) -> Any:
    """`value` as it may be shown under the option name `name`.

    A secret name hides any non-empty value; a mapping is redacted key by key; a string that contains a
    URL has the URL redacted; other values are returned unchanged.
    """
    if is_secret_name(name):
        return REDACTED if value not in (None, "") else value
    if isinstance(value, Mapping):
        return redact_options(value)
    if isinstance(value, str) and "://" in value:
        return redact_text(value)
    return value


def redact_options(options: Mapping[Any, Any] | None) -> dict[Any, Any]:
    """A copy of `options` with every secret value replaced by `***` (see `redact_value`)."""
    if not options:
        return {}
    return {name: redact_value(name, value) for name, value in options.items()}


def environment_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names say they are secret (`AWS_SECRET_ACCESS_KEY`, ...).

    Values shorter than six characters are left out: scrubbing them would mangle ordinary text.
    """
    env = os.environ if environ is None else environ
    return [v for k, v in env.items() if len(v) >= _MIN_ENV_SECRET and is_secret_name(k)]


_known: set[str] = set()
_known_lock = threading.Lock()


def remember_secrets(values: Iterable[str]) -> None:
    """Add literal secrets (of four characters or more) that `redact_text` scrubs from now on.

    Configurations and backends call this with the credentials they were given, so a log record or
    error text that echoes one verbatim (a client's message, a traceback) is still cleaned.
    """
    fresh = {v for v in values if isinstance(v, str) and len(v) >= _MIN_SECRET}
    if fresh:
        with _known_lock:
            _known.update(fresh)


def secret_values(url: object = None, options: Mapping[Any, Any] | None = None) -> list[str]:
    """The literal secrets a URL (user info, secret-named query values) and options carry.

    Lets a caller scrub text it did not write (a third-party backend's error) with `redact_text`.
    """
    found: list[str] = []
    if isinstance(url, str):
        try:
            parts = urlsplit(url)
        except ValueError:
            parts = None
        if parts is not None:
            userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
            userinfo = _misparsed_userinfo(parts) or userinfo
            found.extend(p for part in userinfo.split(":", 1) if part for p in {part, unquote(part)})
            for text in (parts.query, parts.fragment):
                for name, value in parse_qsl(text, keep_blank_values=True):
                    if is_secret_name(name) and value:
                        found.extend({value, value.replace(" ", "+")})
                    elif "://" in value:  # `endpoint=http://id:secret@host`: its user info too
                        found.extend(secret_values(value))
    for name, value in (options or {}).items():
        if is_secret_name(name) and isinstance(value, str) and value:
            found.append(value)
        elif isinstance(value, Mapping):
            found.extend(secret_values(None, value))
    return found


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Free text (an error message, a log line) with every credential it might carry replaced by `***`.

    Three passes: each URL found in the text is redacted (`redact_url`); each `name=value` or quoted
    `'name': value` (a mapping's repr) whose name is secret loses its value; then every known secret
    value (`secrets`, those given to `remember_secrets`, and the secret-named environment variables)
    still present is replaced wherever it appears, in any case.

    Args:
        text: the text to clean.
        secrets: literal secret values known to the caller (a backend's credentials); values shorter
            than four characters are not searched for.
    """
    if not isinstance(text, str):
        text = str(text)
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    if "=" in text or ":" in text:
        text = _ASSIGNMENT_IN_TEXT.sub(_redact_assignment, text)
    with _known_lock:
        known = set(_known)
    folded = text.casefold()
    for secret in sorted({*secrets, *known, *environment_secrets()}, key=len, reverse=True):
        # Any case: a URL parser lowercases a host, and user info misparsed as one is a secret still.
        if len(secret) >= _MIN_SECRET and secret.casefold() in folded:
            text = re.sub(re.escape(secret), REDACTED, text, flags=re.IGNORECASE)
            folded = text.casefold()
    return text


def _redact_assignment(match: re.Match[str]) -> str:
    if match.group("name") is not None:
        name, sep, value = match.group("name", "sep", "value")
    else:
        name, sep, value = match.group("qname", "qsep", "qvalue")
    if not is_secret_name(name.strip("'\"")) or value == REDACTED:
        return match.group(0)
    return f"{name}{sep}{REDACTED}"


def redacted_repr(obj: Any) -> str:
    """A dataclass instance's repr with every credential in its fields replaced by `***`.

    Each field the default repr shows is passed through `redact_value`: a secret-named field is hidden,
    option mappings lose their secret values, URLs their user info and secret query values.
    """
    shown = ", ".join(
        f"{f.name}={redact_value(f.name, getattr(obj, f.name))!r}" for f in dataclasses.fields(obj) if f.repr
    )
    return f"{type(obj).__qualname__}({shown})"


class RedactingFilter(logging.Filter):
    """A logging filter that passes every record's message and traceback through `redact_text`.

    Installed on every hicache and storage-backend logger (`LOGGERS`) when this module is imported, so
    records are clean before any handler (yours, pytest's caplog) sees them.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact `record` in place; never drops it."""
        message = record.getMessage()
        cleaned = redact_text(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


LOGGERS: Final = (
    "hicache",
    "storage_backends",
    "hicache.breaker",
    "hicache.cache",
    "hicache.prefetch",
    "hicache.release",
    "hicache.storage_writer",
    "hicache.tree",
    "hicache.work",
    "hicache.memory.pool",
    "hicache.memory.transfer",
    "hicache.integrations.vllm",
    "storage_backends.file",
    "storage_backends.memory",
    "storage_backends.s3",
    "storage_backends.valkey",
    "storage_backends.mooncake",
    "storage_backends.net_calls",
)
"""The loggers hicache and its backends write to; each carries one `RedactingFilter`."""

_FILTER: Final = RedactingFilter()
for _name in LOGGERS:
    logging.getLogger(_name).addFilter(_FILTER)
