"""The `handoff` scenario (`hicache demo --scenario handoff`): users move to this instance from another one
that shares its storage, so storage hits hang below prefixes this instance has just computed itself.

Three phases, in lockstep (one request at a time, the caches settled in between, so the same requests
drop on every run):

1. This instance computes each shared system prompt itself (storage holds nothing yet) and inserts it. It
   runs under `write_through_selective` (a prefix is backed up once hit twice), so these fresh prefixes stay
   on the device only, as a prefix whose write-through backup is still queued does.
2. Another instance over the same storage and namespace (write-through: everything reaches storage) serves
   every user's turns but the last, then closes.
3. Every user's last turn comes back to this instance: its prompt starts with a fresh system prompt on the
   device, and the conversation below it is in storage. Its prefetch anchors at the un-backed system prompt,
   so the refill is what `refill_under_unbacked` decides: `drop` recomputes the conversation,
   `backup_then_attach` backs the system prompt up and attaches it.

Every request of every phase is recorded and checked against recompute like any other.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from hicache.controller import HiCache
from hicache.demo.workload import Session
from hicache.policy import WritePolicy

if TYPE_CHECKING:
    from hicache.demo.loop import ServingLoop

__all__ = ["SCENARIOS", "serve_handoff"]

SCENARIOS = ("chat", "handoff")
"""The demo's scenarios: `chat` (users served by this instance only) and `handoff` (this module)."""


async def serve_handoff(runner: ServingLoop[Any], cache: HiCache) -> None:
    """Serve the workload's users as in the module docstring: `cache` is this instance.

    Args:
        runner: the serving loop (its records collect every phase's requests).
        cache: this instance's cache (under `write_through_selective`; storage configured).

    Raises:
        ValueError: when `cache` has no storage tier, or the workload has a single turn (nothing is left
            for another instance to serve).
    """
    config = cache.config
    if config.storage_url is None:
        raise ValueError("cache: the handoff scenario needs a storage tier (storage_url)")
    workload = runner.workload
    if workload.spec.turns < 2:
        raise ValueError(f"turns: the handoff scenario needs at least 2 turns, got {workload.spec.turns}")
    runner.extra_requests = len(workload.system_prompts)
    # 1. This instance computes the shared system prompts itself.
    for p, system_prompt in enumerate(workload.system_prompts):
        prompt = torch.tensor(system_prompt, dtype=torch.int64)
        await runner._serve_recorded(cache, f"s{p}", -(p + 1), 0, prompt)
        await cache.wait_idle()
    # 2. Another instance serves every turn but the last, writing through to the shared storage.
    sessions = [Session(workload, conversation) for conversation in workload.conversations]
    other = dataclasses.replace(config, write_policy=WritePolicy.WRITE_THROUGH)
    async with HiCache(other) as elsewhere:
        for _ in range(workload.spec.turns - 1):
            for session in sessions:
                await runner._turn_cached(elsewhere, session)
                await elsewhere.wait_idle()
    # 3. The users' last turns come back here.
    for session in sessions:
        await runner._turn_cached(cache, session)
        await cache.wait_idle()
