"""The docs stay true to the code: the README's example runs, and the architecture page names every module.

`make docs` (mkdocs in strict mode, in CI) checks the pages' links, anchors and API reference blocks;
these tests check what mkdocs cannot see.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
EXAMPLE_MARKER = "<!-- tests/test_docs.py runs this block -->"


def module_names() -> list[str]:
    """Every module of `hicache/` and `storage_backends/` by dotted name (a package by its `__init__`)."""
    names = []
    for package in ("hicache", "storage_backends"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def readme_example() -> str:
    """The Python block right after the README's example marker."""
    text = README.read_text()
    assert EXAMPLE_MARKER in text, f"README.md lost its example marker {EXAMPLE_MARKER!r}"
    found = re.match(r"\s*```python\n(.*?)\n```", text.split(EXAMPLE_MARKER, 1)[1], re.S)
    assert found, "the README's example marker is not followed by a ```python block"
    return found.group(1)


def test_architecture_names_every_module() -> None:
    """A module added, renamed or moved without a line in docs/architecture.md's module map fails here."""
    named = set(re.findall(r"`([A-Za-z_][\w.]*)`", ARCHITECTURE.read_text()))
    missing = [name for name in module_names() if name not in named]
    assert not missing, f"docs/architecture.md does not name these modules: {missing}"


def test_the_module_map_names_only_modules_that_exist() -> None:
    """A module deleted or renamed leaves no line behind in docs/architecture.md's module map."""
    text = ARCHITECTURE.read_text()
    listed = re.findall(
        r"^- `((?:hicache|storage_backends)[\w.]*)`", text.split("## Every module", 1)[1], re.M
    )
    assert len(listed) >= 50
    stale = sorted(set(listed) - set(module_names()))
    assert not stale, f"docs/architecture.md's module map names modules that do not exist: {stale}"


def test_readme_example_runs(tmp_path: Path) -> None:
    """The front door's example runs as printed, warnings as errors, and reuses the shared prefix."""
    script = tmp_path / "readme_example.py"
    script.write_text(readme_example())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "16"], done.stdout


def test_readme_links_exist() -> None:
    """Every relative link of the README (its map of the docs) points at a file of the repository."""
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert links, "the README links no file"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links missing files: {missing}"
