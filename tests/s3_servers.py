"""Start and stop loopback S3-compatible servers (moto, the JuiceFS gateway) for tests and benchmarks.

Shared by `tests/s3/conftest.py` and `bench/bench_s3.py` (both put this directory on `sys.path`); kept out of
the installed packages on purpose. Every server binds a free port on 127.0.0.1, keeps its state and logs in a
caller-owned directory, and is stopped by `S3Server.stop()`. A server that cannot start raises
`ServerStartError` with the tail of its log: CI must see why, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "S3Server",
    "ServerStartError",
    "find_binary",
    "free_port",
    "start_juicefs",
    "start_moto",
    "wait_for_port",
]

_REGION = "us-east-1"
_START_TIMEOUT_S = 60.0


class ServerStartError(RuntimeError):
    """Raised when a server process exits early or does not accept connections in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def find_binary(name: str) -> str:
    """The path of `name` next to the running interpreter (the venv's bin), else on PATH.

    Raises:
        ServerStartError: if neither has it.
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ServerStartError(f"{name!r} not found next to {sys.executable} nor on PATH")
    return found


def _log_tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "<no log>"


def wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Poll until `127.0.0.1:port` accepts a connection, bounded by `timeout_s`.

    Raises:
        ServerStartError: if the process exits first or the deadline passes.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise ServerStartError(
                f"server exited with {process.returncode} before listening:\n{_log_tail(log)}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"server not listening on port {port} after {timeout_s}s:\n{_log_tail(log)}"
            )
        time.sleep(0.05)


@dataclass
class S3Server:
    """A running loopback S3 server and how to reach it.

    Attributes:
        kind: "moto" or "juicefs".
        port: the TCP port on 127.0.0.1.
        bucket: a bucket that exists on the server.
        access_key_id: the access key the server accepts.
        secret_access_key: the secret the server accepts.
        workdir: the directory holding the server's state and log.
    """

    kind: str
    port: int
    bucket: str
    access_key_id: str
    secret_access_key: str = field(repr=False)
    workdir: Path
    process: subprocess.Popen[bytes] | None = field(repr=False)
    _log_file: IO[bytes] | None = field(default=None, repr=False)
    _argv: list[str] = field(default_factory=list, repr=False)
    _env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def endpoint(self) -> str:
        """The HTTP endpoint, `http://127.0.0.1:PORT`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def region(self) -> str:
        """The region to sign requests for."""
        return _REGION

    @property
    def log_path(self) -> Path:
        """The file the server's stdout and stderr go to."""
        return self.workdir / f"{self.kind}.log"

    def url(self, prefix: str) -> str:
        """An `s3://` URL for `prefix`, with endpoint and region in the query (no credentials)."""
        return f"s3://{self.bucket}/{prefix}?endpoint={self.endpoint}&region={self.region}"

    def options(self) -> dict[str, Any]:
        """Keyword options for `S3Backend.from_url`: the credentials."""
        return {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}

    def _spawn(self) -> None:
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self._argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self._env,
            cwd=self.workdir,
        )
        try:
            wait_for_port(self.port, self.process, self.log_path, _START_TIMEOUT_S)
            if self.kind == "juicefs":
                _wait_http_ok(f"{self.endpoint}/minio/health/ready", self.log_path, _START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """Kill the server abruptly (SIGKILL) and reap it, as a crash would; `restart()` brings it back."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        self._reap()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and close its log; idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._reap()

    def _reap(self) -> None:
        if self.process is not None:
            self.process.wait()
            self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> None:
        """Start the server again on the same port (moto comes back empty but for its bucket)."""
        self.stop()
        self._spawn()
        if self.kind == "moto":
            _create_moto_bucket(self.endpoint, self.bucket)


def _wait_http_ok(url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                response.read()
                return
        except (OSError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise ServerStartError(f"{url} not ready after {timeout_s}s:\n{_log_tail(log)}") from None
        time.sleep(0.05)


def _create_moto_bucket(endpoint: str, bucket: str) -> None:
    # moto does not check signatures, so a bare PUT creates the bucket without an S3 client.
    request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT", data=b"")
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def start_moto(workdir: Path, *, bucket: str = "hicache", port: int | None = None) -> S3Server:
    """Start `moto_server` on 127.0.0.1 and create `bucket`.

    Args:
        workdir: an existing directory for the log.
        bucket: the bucket to create.
        port: the port to bind; a free one if None.

    Raises:
        ServerStartError: if moto is missing, exits early or does not listen in time.
    """
    port = free_port() if port is None else port
    argv = [find_binary("moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    env = dict(os.environ)
    env.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")
    server = S3Server(
        kind="moto",
        port=port,
        bucket=bucket,
        access_key_id="testing",
        secret_access_key="testing-secret",
        workdir=workdir,
        process=None,
        _argv=argv,
        _env=env,
    )
    server._spawn()
    try:
        _create_moto_bucket(server.endpoint, bucket)
    except (OSError, urllib.error.URLError) as exc:
        server.stop()
        raise ServerStartError(
            f"could not create bucket on moto: {exc}\n{_log_tail(server.log_path)}"
        ) from exc
    return server


def start_juicefs(
    workdir: Path,
    *,
    bucket: str = "hicache",
    volume: str = "hcvol",
    port: int | None = None,
) -> S3Server:
    """Format a file-backed JuiceFS volume (sqlite metadata) and start its S3 gateway on 127.0.0.1.

    Args:
        workdir: an existing, empty directory for the data, metadata, cache, HOME and logs.
        bucket: the bucket name the gateway serves.
        volume: the volume name (3+ characters).
        port: the port to bind; a free one if None.

    Raises:
        ServerStartError: if juicefs is missing, the format fails, or the gateway does not listen in time.
    """
    juicefs = find_binary("juicefs")
    for sub in ("data", "cache", "home"):
        (workdir / sub).mkdir(exist_ok=True)
    meta = f"sqlite3://{workdir / 'meta.db'}"
    env = dict(os.environ)
    env.update(
        HOME=str(workdir / "home"),
        MINIO_ROOT_USER="hicacheadmin",
        MINIO_ROOT_PASSWORD="hicache-gateway-secret",
    )
    format_log = workdir / "juicefs-format.log"
    with open(format_log, "wb") as log:
        result = subprocess.run(
            [
                juicefs,
                "format",
                "--no-update",
                "--storage",
                "file",
                "--bucket",
                f"{workdir / 'data'}/",
                meta,
                volume,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
            timeout=_START_TIMEOUT_S,
            check=False,
        )
    if result.returncode != 0:
        raise ServerStartError(f"juicefs format failed ({result.returncode}):\n{_log_tail(format_log)}")
    port = free_port() if port is None else port
    argv = [
        juicefs,
        "gateway",
        "--no-usage-report",
        "--no-banner",
        "--log",
        str(workdir / "juicefs-gateway-internal.log"),
        "--metrics",
        f"127.0.0.1:{free_port()}",
        "--cache-dir",
        str(workdir / "cache"),
        "--bucket-name",
        bucket,
        meta,
        f"127.0.0.1:{port}",
    ]
    server = S3Server(
        kind="juicefs",
        port=port,
        bucket=bucket,
        access_key_id=env["MINIO_ROOT_USER"],
        secret_access_key=env["MINIO_ROOT_PASSWORD"],
        workdir=workdir,
        process=None,
        _argv=argv,
        _env=env,
    )
    server._spawn()
    return server
