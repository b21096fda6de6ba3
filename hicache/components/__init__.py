"""Hybrid-model components beside full-attention KV (the tree's base): sliding-window KV, Mamba state."""

from __future__ import annotations

from hicache.components.base import TIERS, Component, PathValues
from hicache.components.mamba import MambaState
from hicache.components.swa import SlidingWindow

__all__ = [
    "TIERS",
    "Component",
    "MambaState",
    "PathValues",
    "SlidingWindow",
    "component_storage_key",
]


def component_storage_key(page_hash: bytes, component: str) -> str:
    """The storage key of a component's page: the base page's key followed by the name's bytes in hex.

    Storage keys are lowercase hex, so the name is hex-encoded (`"swa"` adds `"737761"`); keys of
    different components and of the base page never collide because their lengths differ.
    """
    return page_hash.hex() + component.encode().hex()
