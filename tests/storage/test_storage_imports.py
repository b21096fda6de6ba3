"""The storage layer depends on nothing above it: no module of `storage_backends` imports `hicache`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import hicache.errors
import storage_backends.errors

_PACKAGE = Path(storage_backends.errors.__file__).parent


def _modules() -> list[str]:
    return sorted(
        "storage_backends" if path.name == "__init__.py" else f"storage_backends.{path.stem}"
        for path in _PACKAGE.glob("*.py")
    )


def _imported_names(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` anywhere in the file names (function bodies and
    `TYPE_CHECKING` blocks included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.add(node.module)
    return names


def test_no_storage_module_names_hicache_in_an_import() -> None:
    """Guards the direction of the data flow: backends know pages and bytes, and their errors live in the
    leaf `storage_backends.errors` (they used to import `hicache.errors`, which loads the whole cache)."""
    offenders = {
        path.name: sorted(n for n in _imported_names(path) if n.split(".")[0] == "hicache")
        for path in sorted(_PACKAGE.rglob("*.py"))
    }
    assert not {name: mods for name, mods in offenders.items() if mods}


def test_importing_every_storage_module_loads_no_hicache_module() -> None:
    """Importing each module of the package (in a fresh interpreter) leaves `hicache` unimported, and the
    leaf `storage_backends.errors` loads nothing else of the package and no async library."""
    modules = _modules()
    assert "storage_backends.errors" in modules
    assert len(modules) >= 10
    code = (
        "import importlib, json, sys\n"
        "import storage_backends.errors\n"
        "leaf = sorted(sys.modules)\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps([leaf, sorted(sys.modules)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    leaf, loaded = (set(names) for names in json.loads(out.stdout))
    assert not {m for m in loaded if m.split(".")[0] == "hicache"}
    assert {m for m in leaf if m.startswith("storage_backends")} == {
        "storage_backends",
        "storage_backends.errors",
    }
    assert "anyio" not in leaf


def test_hicache_errors_re_exports_the_storage_errors_as_the_same_classes() -> None:
    """`except hicache.errors.X` keeps catching what a backend raises: one class object per name, and
    the whole hierarchy (the cache's own errors included) rooted at one `HiCacheError`."""
    for name in storage_backends.errors.__all__:
        assert getattr(hicache.errors, name) is getattr(storage_backends.errors, name), name
        assert name in hicache.errors.__all__
    for name in hicache.errors.__all__:
        assert issubclass(getattr(hicache.errors, name), storage_backends.errors.HiCacheError), name
    assert issubclass(hicache.errors.StorageCircuitOpen, storage_backends.errors.StorageUnavailable)
    assert issubclass(storage_backends.errors.PageNotFound, FileNotFoundError)
