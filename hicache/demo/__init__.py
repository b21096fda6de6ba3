"""The `hicache demo`: a seeded small Llama served by an asyncio loop over a `HiCache`, checked bit for bit.

Needs the `demo` extra (transformers, rich); importing this package imports neither.
"""

from __future__ import annotations

__all__: list[str] = []
