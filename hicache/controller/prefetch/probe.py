"""How many leading pages of a prefetch storage holds, found with a few sparse `exists` calls.

An exact answer stats every page (4,096 `stat` calls for 16 prefetches of 256 pages); that was a quarter of
the controller's prefetch time on hot 64 KiB pages (`bench/bench_io.py`). Instead the probe asks `exists`
about up to `fanout` evenly spaced pages of the range still in doubt, keeps the bracket around the first
absent probe, and repeats until the bracket is small enough to check page by page. A full hit of 1,024 pages
costs one call of 16 keys; a partial hit costs two or three calls.

The answer is exact when storage holds a prefix of the pages (what write-through to storage produces).
With a hole between two probes it overestimates; that is safe, because every page a prefetch reads is
verified: the stream ends at the first page it cannot read, and commit releases the unread tail.
"""

from __future__ import annotations

from collections.abc import Sequence

from storage_backends.protocol import StorageBackend

__all__ = ["probe_hit_pages"]

EXACT_BELOW = 64
"""A bracket this small (in pages) is checked page by page, in one call."""
FANOUT = 16
"""Pages probed per call while the bracket is larger."""


async def probe_hit_pages(
    storage: StorageBackend, keys: Sequence[str], *, exact_below: int = EXACT_BELOW, fanout: int = FANOUT
) -> int:
    """The number of leading `keys` that storage holds, assuming it holds a prefix of them.

    Args:
        storage: the backend to ask.
        keys: the page keys of the prefetch, in order.
        exact_below: brackets of fewer pages are checked page by page.
        fanout: pages probed per call in a larger bracket (>= 2).

    Raises:
        ValueError: naming `fanout` or `exact_below` when below their minimum; whatever
            `storage.exists` raises.
    """
    if fanout < 2:
        raise ValueError(f"fanout: expected >= 2, got {fanout}")
    if exact_below < 1:
        raise ValueError(f"exact_below: expected >= 1, got {exact_below}")
    lo, hi = 0, len(keys)  # pages [0, lo) are taken as present; page `hi` is absent (or the end)
    while hi - lo > exact_below:
        step = (hi - lo) / fanout
        # Evenly spaced, the last probe on the bracket's last page: a full hit is settled in one call.
        probes = sorted({lo + max(0, int(step * (i + 1)) - 1) for i in range(fanout)} | {hi - 1})
        present = await storage.exists([keys[p] for p in probes])
        if present == len(probes):
            return hi
        if present:
            lo = probes[present - 1] + 1
        hi = probes[present]
    return lo + (await storage.exists(keys[lo:hi]) if hi > lo else 0)
