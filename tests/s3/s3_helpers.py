"""Helpers for the S3 backend tests: the test namespace, fresh prefixes, opening backends on a server."""

from __future__ import annotations

import uuid
from typing import Any

from s3_servers import S3Server

from storage_backends.s3 import S3Backend

__all__ = ["FAST_RETRIES", "NAMESPACE", "open_backend", "unique_prefix"]

NAMESPACE = bytes(range(16))
"""The namespace digest every test backend writes and checks."""

FAST_RETRIES: dict[str, Any] = {
    "deadline_s": 0.5,
    "attempt_timeout_s": 0.25,
    "backoff_initial_s": 0.01,
    "backoff_max_s": 0.05,
}
"""Retry settings small enough that a dead server fails a page in well under a second."""


def unique_prefix() -> str:
    """A fresh key prefix, so tests sharing a session server never see each other's pages."""
    return f"t-{uuid.uuid4().hex[:12]}"


def open_backend(server: S3Server, prefix: str | None = None, **options: Any) -> S3Backend:
    """An `S3Backend` on `server` opened through its URL, with the server's credentials as options."""
    merged = {"deadline_s": 10.0, **server.options(), **options}
    return S3Backend.from_url(server.url(prefix or unique_prefix()), namespace_digest=NAMESPACE, **merged)
