"""`import hicache` (and `hicache.integrations`) never imports vLLM: the connector is imported only when
vLLM names it (`kv_connector_module_path="hicache.integrations.vllm"`)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_hicache_imports_no_engine() -> None:
    code = (
        "import sys, hicache, hicache.integrations; from hicache import HiCache; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'zmq')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
