"""The lazy backend registry: schemes map to factories imported only when a URL is opened."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from storage_backends import open_backend, register_backend
from storage_backends.file import FileBackend
from storage_backends.memory import MemoryBackend, drop_named_store
from storage_backends.registry import _BUILTINS, registered_schemes, resolve_factory

NS = bytes(range(16))


@pytest.fixture
def restore_registry() -> object:
    """Undo test registrations."""
    before = registered_schemes()
    yield None
    for scheme, target in before.items():
        register_backend(scheme, target)
    from storage_backends import registry

    for scheme in set(registered_schemes()) - set(before):
        del registry._targets[scheme]


async def test_opening_file_and_memory_urls_imports_no_client_library(tmp_path: Path) -> None:
    """A fresh interpreter imports hicache and storage_backends, opens file://, memory://, valkey:// and
    mooncake:// (these two connect on first use), and never loads obstore, redis, glide or Mooncake."""
    script = (
        "import sys, anyio\n"
        "import hicache, storage_backends\n"
        "assert 'storage_backends.file' not in sys.modules, 'file backend imported eagerly'\n"
        "async def main():\n"
        "    net = ('valkey://127.0.0.1:1/p', 'mooncake://127.0.0.1:1/p?metadata=http://127.0.0.1:1/m')\n"
        "    for url in (sys.argv[1], 'memory://lazy', *net):  # the network backends connect on first use\n"
        "        b = storage_backends.open_backend(url, namespace_digest=bytes(16))\n"
        "        await b.aclose()\n"
        "anyio.run(main)\n"
        "clients = ('obstore', 'boto3', 'botocore', 'aiofiles', 'redis', 'glide', 'mooncake')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in clients)\n"
        "print(heavy)\n"
    )
    result = await anyio.run_process([sys.executable, "-c", script, f"file://{tmp_path}"])
    assert result.stdout.decode().strip() == "[]"


async def test_open_backend_builds_file_and_memory_backends(tmp_path: Path) -> None:
    """The built-in schemes return the right classes, with options passed through."""
    file_backend = open_backend(f"file://{tmp_path}", namespace_digest=NS, max_concurrency=3)
    memory_backend = open_backend("memory://registry-test", namespace_digest=NS)
    try:
        assert isinstance(file_backend, FileBackend)
        assert "max_concurrency=3" in repr(file_backend)
        assert isinstance(memory_backend, MemoryBackend)
    finally:
        await file_backend.aclose()
        await memory_backend.aclose()
        drop_named_store("registry-test")


def test_builtins_include_s3_without_importing_it() -> None:
    """s3 is registered by name only."""
    assert registered_schemes()["s3"] == "storage_backends.s3:S3Backend.from_url"
    assert set(_BUILTINS) == {"file", "memory", "s3", "valkey", "mooncake"}


@pytest.mark.parametrize("url", ["ftp://host/x", "nosuchscheme:///x", "/just/a/path"])
def test_unknown_or_missing_scheme_raises_naming_url(url: str) -> None:
    """An unknown scheme or none at all is a ValueError naming url."""
    with pytest.raises(ValueError, match="url"):
        open_backend(url, namespace_digest=NS)


@pytest.mark.usefixtures("restore_registry")
def test_registration_is_lazy_until_opened() -> None:
    """Registering a missing module succeeds; only opening a URL of that scheme imports it."""
    register_backend("lazytest", "no_such_module_for_hicache_tests:factory")
    assert registered_schemes()["lazytest"] == "no_such_module_for_hicache_tests:factory"
    with pytest.raises(ModuleNotFoundError):
        open_backend("lazytest://x", namespace_digest=NS)


@pytest.mark.usefixtures("restore_registry")
async def test_registered_scheme_resolves_dotted_factories() -> None:
    """A scheme can point at any module attribute path, here an alias of the memory backend."""
    register_backend("memory", "storage_backends.memory:MemoryBackend.from_url")
    factory = resolve_factory("memory")
    assert factory == MemoryBackend.from_url
    backend = open_backend("memory://", namespace_digest=NS)
    assert isinstance(backend, MemoryBackend)
    await backend.aclose()


@pytest.mark.parametrize(
    ("scheme", "target", "name"),
    [("S3", "m:f", "scheme"), ("", "m:f", "scheme"), ("x", "nocolon", "target"), ("x", "m:", "target")],
)
def test_malformed_registrations_are_rejected(scheme: str, target: str, name: str) -> None:
    """Bad schemes and targets raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=name):
        register_backend(scheme, target)
