"""A lazy registry of storage backends by URL scheme.

A scheme maps to a `"module:factory"` target that is imported only when a URL of that scheme is opened,
so `import storage_backends` (and `import hicache`) never imports an S3 client.
"""

from __future__ import annotations

import importlib
import re
import threading
from typing import Any, cast
from urllib.parse import urlsplit

from storage_backends.protocol import StorageBackend
from storage_backends.redact import redact_text, redact_url, remember_secrets, secret_values

__all__ = ["open_backend", "register_backend", "registered_schemes", "resolve_factory"]

_BUILTINS = {
    "file": "storage_backends.file:FileBackend.from_url",
    "memory": "storage_backends.memory:MemoryBackend.from_url",
    "s3": "storage_backends.s3:S3Backend.from_url",
    "valkey": "storage_backends.valkey:ValkeyBackend.from_url",
    "mooncake": "storage_backends.mooncake:MooncakeBackend.from_url",
}

_SCHEME_RE = re.compile(r"[a-z][a-z0-9+.-]*")
_TARGET_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*")

_targets: dict[str, str] = dict(_BUILTINS)
_lock = threading.Lock()


def register_backend(scheme: str, target: str) -> None:
    """Map URL scheme `scheme` to the factory `target` ("package.module:Class.from_url").

    The module is not imported here; `open_backend` imports it on first use. Registering a scheme
    again replaces its target (so tests and plugins can swap a built-in).

    Args:
        scheme: the URL scheme, lowercase (`"file"`, `"s3"`, `"juicefs"`).
        target: `"module:attr"` or `"module:Class.attr"`; the factory is called as
            `factory(url, namespace_digest=..., **options)` and returns a `StorageBackend`.

    Raises:
        ValueError: naming `scheme` or `target` when malformed.
    """
    if not isinstance(scheme, str) or _SCHEME_RE.fullmatch(scheme) is None:
        raise ValueError(f"scheme: expected a lowercase URL scheme such as 's3', got {scheme!r}")
    if not isinstance(target, str) or _TARGET_RE.fullmatch(target) is None:
        raise ValueError(f"target: expected 'module:factory' such as 'pkg.mod:Cls.from_url', got {target!r}")
    with _lock:
        _targets[scheme] = target


def registered_schemes() -> dict[str, str]:
    """A copy of the scheme → target map."""
    with _lock:
        return dict(_targets)


def resolve_factory(scheme: str) -> Any:
    """Import and return the factory registered for `scheme`.

    Raises:
        ValueError: naming `scheme`, if it is not registered.
        ImportError: if the target's module (or its client library) cannot be imported.
        AttributeError: if the module lacks the named factory.
    """
    with _lock:
        target = _targets.get(scheme)
    if target is None:
        raise ValueError(f"scheme: no storage backend registered for {scheme!r}; known: {sorted(_targets)}")
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


def open_backend(url: str, *, namespace_digest: bytes, **options: Any) -> StorageBackend:
    """Open the backend for `url`, importing its module only now.

    Args:
        url: `file:///abs/path`, `memory://name`, `s3://bucket/prefix`, or a registered scheme.
        namespace_digest: the cache's 16-byte namespace digest.
        **options: backend-specific keyword arguments (e.g. `max_concurrency`, `durable`).

    Raises:
        ValueError: naming `url`, if it has no scheme or an unknown one.
        Exception: what the factory raises, with any credential in its message replaced by `***`.
    """
    if not isinstance(url, str):
        raise TypeError(f"url: expected a str, got {type(url).__name__}")
    scheme = urlsplit(url).scheme.lower()
    if not scheme:
        raise ValueError(f"url: expected scheme://..., got {redact_url(url)!r}")
    with _lock:
        known = scheme in _targets
        schemes = sorted(_targets)
    if not known:
        raise ValueError(
            f"url: no storage backend registered for scheme {scheme!r} in {redact_url(url)!r}; known: {schemes}"
        )
    secrets = secret_values(url, options)
    remember_secrets(secrets)
    factory = resolve_factory(scheme)
    try:
        return cast("StorageBackend", factory(url, namespace_digest=namespace_digest, **options))
    except Exception as exc:
        # A factory (ours or a plugin's) may echo the URL or an option in its message: never a secret.
        message = str(exc)
        redacted = redact_text(message, secrets)
        if redacted == message:
            raise
        try:
            clean = type(exc)(redacted)
        except Exception:
            clean = ValueError(f"url: opening the storage backend failed: {redacted}")
        raise clean from None
