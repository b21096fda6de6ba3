"""The controller's rooms call downwards only: `prefetch` -> `movement` -> `storage` -> `pages` (and any room
may read `state`); the facade's modules at the top of `hicache.controller` call them all. Checked on the
import statements of every module (the ones under `TYPE_CHECKING` too), so a new upward import fails here
before it becomes a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import hicache.controller

_CONTROLLER = Path(hicache.controller.__file__).parent
_ROOMS = ["prefetch", "movement", "storage", "pages"]
"""Top to bottom: each room may import the rooms after it."""


def _controller_imports(path: Path) -> set[str]:
    """The `hicache.controller` modules `path` imports, by their name below `hicache.controller`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        names.update(
            m.removeprefix("hicache.controller.") for m in modules if m.startswith("hicache.controller.")
        )
    return names


def test_every_controller_module_lives_in_a_room_or_the_facade() -> None:
    rooms = {p.name for p in _CONTROLLER.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(_ROOMS)


def test_rooms_import_only_the_rooms_below_them() -> None:
    checked = 0
    for rank, room in enumerate(_ROOMS):
        allowed = {room, *_ROOMS[rank + 1 :], "state"}
        for path in sorted((_CONTROLLER / room).glob("*.py")):
            upward = {m for m in _controller_imports(path) if m.split(".")[0] not in allowed}
            assert not upward, (
                f"{room}/{path.name} imports {sorted(upward)}: rooms may import only {sorted(allowed)}"
            )
            checked += 1
    assert checked >= 15
