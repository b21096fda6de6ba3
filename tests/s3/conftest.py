"""Fixtures for the S3 backend tests: loopback moto and JuiceFS gateway servers, and backends on them.

The servers are session-scoped, bound to free 127.0.0.1 ports, keep their state in temporary directories
and are stopped at the end of the session. A server that cannot start fails the tests that need it (with
its log in the error): these tests must run in CI, never skip.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3_servers import S3Server, start_juicefs, start_moto  # noqa: E402

from storage_backends.s3 import S3Backend  # noqa: E402

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


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server with an empty bucket, shared by the session."""
    server = start_moto(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def juicefs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A JuiceFS S3 gateway on a file-backed volume with sqlite metadata, shared by the session."""
    server = start_juicefs(tmp_path_factory.mktemp("juicefs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_moto(tmp_path: Path) -> Iterator[S3Server]:
    """A moto server of this test's own, which the test may kill and restart."""
    server = start_moto(tmp_path)
    try:
        yield server
    finally:
        server.stop()
