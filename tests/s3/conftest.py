"""Fixtures for the S3 backend tests: loopback moto and JuiceFS gateway servers, and backends on them.

The servers are session-scoped, bound to free 127.0.0.1 ports, keep their state in temporary directories
and are stopped at the end of the session. A server that cannot start fails the tests that need it (with
its log in the error): these tests must run in CI, never skip.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The server helpers (shared with bench/bench_s3.py) and the shared contract live in sibling directories.
_TESTS = Path(__file__).resolve().parents[1]
for _path in (_TESTS, _TESTS / "storage"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from s3_servers import S3Server, start_juicefs, start_moto  # noqa: E402


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
