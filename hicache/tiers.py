"""Names of the cache's tiers and of what a prefetch can come to: string enums, so they read as (and
compare equal to) the plain strings metrics labels and older call sites use.

A leaf module: it imports nothing of hicache, so the tree, the controller and the metrics can all use it.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["DropReason", "PrefetchStatus", "ShedReason", "SkipReason", "Tier"]


class Tier(StrEnum):
    """Where a page lives: the accelerator's memory, pinned host memory, or the storage backend."""

    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


class SkipReason(StrEnum):
    """Why a prefetch was not started (the `reason` label of `prefetch_skipped_total`)."""

    NO_STORAGE = "no_storage"
    """The cache has no storage tier."""
    BELOW_THRESHOLD = "below_threshold"
    """The page-aligned remainder beyond the match is below `prefetch_threshold`."""
    CAPACITY = "capacity"
    """The tokens in flight would exceed `capacity_tokens`."""
    STORAGE_UNAVAILABLE = "storage_unavailable"
    """The storage tier's circuit breaker is open (storage was found down)."""
    STORAGE_ERROR = "storage_error"
    """The storage lookup failed or timed out."""
    STORAGE_MISS = "storage_miss"
    """Storage holds too few of the pages beyond the match."""
    HOST_FULL = "host_full"
    """The host pool cannot take enough of the pages."""
    COMPONENT_MISS = "component_miss"
    """Storage lacks a hybrid component's pages (a partial window, no recurrent state)."""
    COMPONENT_HOST_FULL = "component_host_full"
    """A hybrid component's host pool cannot take its pages."""


class DropReason(StrEnum):
    """Why a finished prefetch's pages were dropped instead of committed (the `reason` label of
    `prefetch_dropped_tokens_total`)."""

    ANCHOR_NOT_BACKED_UP = "anchor_not_backed_up"
    """Under write-through, the node the pages hang from is not backed up to host."""
    COMPONENT_INCOMPLETE = "component_incomplete"
    """A hybrid component's pages did not all arrive: every page is useless without them."""


class ShedReason(StrEnum):
    """Why a queued backup or storage write was let go unwritten (the `reason` label of
    `writes_shed_total`)."""

    QUEUE_FULL = "queue_full"
    """Its queue was at its limit (`backup_queue_limit`, `storage_write_queue_limit`)."""
    STORAGE_UNAVAILABLE = "storage_unavailable"
    """The storage tier's circuit breaker is open."""


class PrefetchStatus(StrEnum):
    """How a prefetch was resolved (`PrefetchOutcome.status`)."""

    COMMITTED = "committed"
    """Its pages were attached to the tree."""
    DROPPED = "dropped"
    """Its pages went back to the host pool without being attached."""
    CANCELLED = "cancelled"
    """It was cancelled; its pages went back once its reads stopped."""
