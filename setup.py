"""Builds hicache's C extensions, `_hicache_native` (the file backend's read+verify path),
`_hicache_write` (its write path: header and write without the GIL) and `_hicache_tree` (the radix tree's
walk); the rest of the project's metadata
lives in pyproject.toml.

`pip install -e .` (and `make venv`) compiles it in place. It needs a C compiler and Python's headers; where
either is missing the build stops with an error naming what is missing and how to get it.
"""

from __future__ import annotations

import os
import shutil
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildNative(build_ext):
    """`build_ext` that first checks for what compiling needs and says plainly what is missing."""

    def run(self) -> None:
        missing = []
        include = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(include, "Python.h")):
            missing.append(
                f"Python's development headers (no Python.h in {include}; on Debian/Ubuntu: "
                "apt-get install python3-dev)"
            )
        compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
        if shutil.which(compiler) is None:
            missing.append(
                f"a C compiler ({compiler!r} is not on PATH; on Debian/Ubuntu: apt-get install gcc)"
            )
        if missing:
            raise SystemExit(
                "hicache: cannot build its C extension _hicache_native (native/hicache_native.c), "
                "which the file storage backend reads through. Missing: " + "; ".join(missing) + "."
            )
        super().run()


# On x86, xxHash's runtime dispatcher (vendored with xxhash.h) picks the widest vector unit the CPU has
# (SSE2, AVX2, AVX-512) for the page checksums; it is built with baseline flags, so the module still runs on
# any x86-64. Whether the target is x86 is the compiler's test (native/xxh_dispatch.c), not this machine's:
# elsewhere that unit is empty and xxhash.h's own code path is the only one. Measured once (a one-off timing,
# see BENCHMARKS.md) on this project's 2-core EPYC: xxh3-64 of a 1 MiB page at ~38 GB/s built for SSE2,
# ~110 GB/s dispatched (AVX-512).
_XXHASH = [
    "native/xxhash/xxhash.h",
    "native/xxhash/xxh_x86dispatch.h",
    "native/xxhash/xxh_x86dispatch.c",
]
_FLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "_hicache_native",
            sources=["native/hicache_native.c", "native/xxh_dispatch.c"],
            include_dirs=["native"],
            depends=_XXHASH,
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "_hicache_tree",
            sources=["native/hicache_tree.c"],
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "_hicache_write",
            sources=["native/hicache_write.c", "native/xxh_dispatch.c"],
            include_dirs=["native"],
            depends=_XXHASH,
            extra_compile_args=_FLAGS,
        ),
    ],
    cmdclass={"build_ext": BuildNative},
)
