"""The tree is the pure core: importing it loads neither anyio nor the pools, and nothing in it awaits."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
import hicache.tree
import hicache.components
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout))


def test_importing_the_tree_imports_neither_anyio_nor_the_pools() -> None:
    """Guards the direction of the data flow: the controller calls the tree and the pools, the tree calls
    nothing of theirs (a component importing `KVLayout` through `hicache.memory` used to pull the pools,
    the transfers and anyio into every importer of the tree)."""
    loaded = _modules_after(_PROBE)
    assert "hicache.tree.radix" in loaded
    forbidden = {
        "anyio",
        "hicache.memory",
        "hicache.memory.pool",
        "hicache.memory.allocator",
        "hicache.controller",
    }
    assert not forbidden & loaded, sorted(forbidden & loaded)
    assert not {m for m in loaded if m.startswith(("anyio.", "hicache.memory.", "hicache.controller."))}


def test_the_tree_modules_import_no_async_library() -> None:
    """Importing every module of `hicache.tree` and `hicache.components` loads no async library (anyio,
    trio, sniffio; torch itself loads asyncio) and no pool: the tree tests run without an event loop
    because nothing in the tree awaits."""
    loaded = _modules_after(_PROBE)
    ours = sorted(m for m in loaded if m.startswith(("hicache.tree", "hicache.components")))
    assert len(ours) >= 10
    code = (
        "import importlib, json, sys\n"
        f"for name in {ours!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = _modules_after(code)
    assert not {m for m in loaded if m.split(".")[0] in {"anyio", "trio", "sniffio"}}
    assert "hicache.memory.pool" not in loaded
