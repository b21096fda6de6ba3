"""The configuration is a leaf: importing it loads no tensor-parallel machinery."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
import torch
with_torch = set(sys.modules)
import hicache.config
from hicache.keys import Namespace
from hicache.layout import KVLayout
layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, page_size=4)
try:
    hicache.config.HiCacheConfig(layout=layout, device_pages=4, host_pages=4, tp_group=object())
except TypeError as exc:
    refused = str(exc)
print(json.dumps([sorted(set(sys.modules) - with_torch), refused]))
"""


def test_importing_the_config_imports_no_tensor_parallel_module() -> None:
    """Guards the config as a leaf: it used to import `hicache.parallel.group` (and with it the agreement,
    the tree and `torch.distributed`'s process groups) only to check `tp_group`'s type. Without that
    import it still refuses a `tp_group` that is no `RankGroup`, naming the argument. (`import torch`
    itself loads `torch.distributed` on this torch, so the probe counts only what the config adds.)"""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    added, refused = json.loads(out.stdout)
    assert "hicache.config" in added
    assert not [m for m in added if m.startswith(("hicache.parallel", "torch.distributed"))]
    assert not [m for m in added if m.startswith(("hicache.tree", "hicache.controller"))]
    assert refused == "tp_group: expected a RankGroup, got object"
