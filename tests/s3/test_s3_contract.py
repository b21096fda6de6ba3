"""The shared storage-backend contract and the hostile-storage suite, run against S3Backend on loopback moto
and the JuiceFS gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import obstore
import pytest
from contract import BackendContract, Corrupt, ReadGate, Reopen
from hostile import HostileStorage, RawStore
from obstore.store import S3Store
from s3_servers import S3Server

from storage_backends.s3 import S3Backend


class _S3Contract(BackendContract, HostileStorage):
    """The contract on one server; subclasses name the server fixture."""

    server_fixture = ""

    @pytest.fixture
    def server(self, request: pytest.FixtureRequest) -> S3Server:
        result: S3Server = request.getfixturevalue(self.server_fixture)
        return result

    @pytest.fixture
    def url(self, server: S3Server, request: pytest.FixtureRequest) -> str:
        import uuid

        return server.url(f"contract-{uuid.uuid4().hex[:12]}")

    @pytest.fixture
    async def backend(self, server: S3Server, url: str, namespace_digest: bytes) -> AsyncIterator[S3Backend]:
        async with S3Backend.from_url(url, namespace_digest=namespace_digest, **server.options()) as b:
            yield b

    @pytest.fixture
    def reopen(self, server: S3Server, url: str) -> Reopen:
        async def open_again(digest: bytes) -> S3Backend:
            return S3Backend.from_url(url, namespace_digest=digest, **server.options())

        return open_again

    @pytest.fixture
    def raw(self, server: S3Server) -> S3Store:
        """A plain client on the server's bucket, to read and write objects behind the backend's back."""
        return S3Store(
            server.bucket,
            endpoint=server.endpoint,
            region=server.region,
            access_key_id=server.access_key_id,
            secret_access_key=server.secret_access_key,
            client_options={"allow_http": True},
        )

    @pytest.fixture
    def raw_store(self, raw: S3Store, backend: S3Backend) -> RawStore:
        class Raw:
            async def read(self, key: str) -> bytes:
                return bytes(await (await obstore.get_async(raw, backend.object_path(key))).bytes_async())

            async def write(self, key: str, data: bytes) -> None:
                await obstore.put_async(raw, backend.object_path(key), data)

        return Raw()

    @pytest.fixture
    def corrupt_page(self, raw: S3Store, backend: S3Backend) -> Corrupt:
        store = raw

        async def flip_last_byte(key: str) -> None:
            path = backend.object_path(key)
            body = bytearray(await (await obstore.get_async(store, path)).bytes_async())
            body[-1] ^= 0x01
            await obstore.put_async(store, path, bytes(body))

        return flip_last_byte

    @pytest.fixture
    def hold_reads(self, backend: S3Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadGate]:
        gate = ReadGate()
        monkeypatch.setattr(backend, "_get_one", gate.awaited(backend._get_one))
        yield gate
        gate.open()


class TestS3Moto(_S3Contract):
    server_fixture = "moto_server"


class TestS3JuiceFS(_S3Contract):
    server_fixture = "juicefs_server"
