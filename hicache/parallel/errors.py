"""The errors of the tensor-parallel rank group: a dead or silent peer, and ranks that disagree."""

from __future__ import annotations

from hicache.errors import HiCacheError

__all__ = ["RankDivergence", "RankFailed", "RankGroupError", "TreeDivergence"]


class RankGroupError(HiCacheError, RuntimeError):
    """Base class of the errors of a tensor-parallel rank group."""


class RankFailed(RankGroupError, TimeoutError):
    """Raised when a collective of the rank group did not complete: a peer rank died, closed its group or
    stopped responding for longer than the group's `timeout_s`. The group is unusable from then on: every
    later collective and every pending agreement raises this error too."""


class RankDivergence(RankGroupError):
    """Raised on every rank when the ranks registered different decisions under one sequence number, or
    reached one agreement step with different step numbers: the caller did not make the same calls in the
    same order on every rank. The group is unusable from then on."""


class TreeDivergence(RankGroupError, AssertionError):
    """Raised by a cross-rank `sanity_check` when the tree fingerprints differ; the message names the first
    differing node (in a canonical order of the trees) and the ranks that disagree."""
