"""A decision of the tensor-parallel ranks: proposed by every rank, settled with a local value, resolved
to the minimum over the ranks (`Agreement` carries it through its steps)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import xxhash

__all__ = ["NONE", "Decision", "decode_max", "encode_max"]

NONE = (1 << 62) - 1
"""What an absent or unsettled slot contributes to a step: larger than any value or key."""


_MAX_BASE = NONE - 1


def encode_max(value: int) -> int:
    """`value` (in [0, 2**62 - 2]) as a decision's value whose agreed minimum decodes (`decode_max`) to
    the maximum of the ranks' values: what the neediest rank needs (pages to evict)."""
    if not 0 <= value <= _MAX_BASE:
        raise ValueError(f"value: must be in [0, {_MAX_BASE}], got {value}")
    return _MAX_BASE - value


def decode_max(agreed: int) -> int:
    """The maximum over the ranks, from the agreed value of decisions settled with `encode_max`."""
    return _MAX_BASE - agreed


def _hash_of(kind: str, key: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{kind}\x00{key}".encode()) & ((1 << 61) - 1)


class Decision:
    """One decision the ranks agree on: proposed by every rank, settled with a local value, resolved to
    the minimum of the ranks' values.

    Attributes:
        kind: what is decided (`"probe"`, `"probe_evict"`, `"commit"`, `"load_back"`, `"host_room"`).
        key: what it is about (a request id, a node's path); with `kind`, the same on every rank.
        seq: the decision's number, its place in the order of proposals (the same on every rank).
        default: the value settled locally when `timeout_s` passes unsettled (the safe answer: 0 pages).
    """

    __slots__ = (
        "_error",
        "_event",
        "_immediate",
        "_key_hash",
        "_local",
        "_notify",
        "_on_resolve",
        "_result",
        "_unmatched_since",
        "deadline",
        "default",
        "key",
        "kind",
        "seq",
    )

    def __init__(
        self,
        kind: str,
        key: str,
        seq: int,
        *,
        default: int,
        deadline: float,
        immediate: bool,
        notify: Callable[[], None] | None = None,
        on_resolve: Callable[[int | None], None] | None = None,
    ) -> None:
        self.kind = kind
        self.key = key
        self.seq = seq
        self.default = default
        self.deadline = deadline
        self._key_hash: int | None = None
        self._immediate = immediate
        self._local: int | None = None
        self._result: int | None = None
        self._error: BaseException | None = None
        self._event: asyncio.Event | None = None
        self._notify = notify
        self._on_resolve = on_resolve
        self._unmatched_since: float | None = None  # first step that saw it here but not on some peer

    @property
    def key_hash(self) -> int:
        """`kind` and `key` hashed: what a step compares across the ranks (worked out at the first step
        that carries the decision; one rank never needs it)."""
        if self._key_hash is None:
            self._key_hash = _hash_of(self.kind, self.key)
        return self._key_hash

    @property
    def settled(self) -> bool:
        """Whether this rank's value is known."""
        return self._local is not None

    @property
    def resolved(self) -> bool:
        """Whether the ranks agreed (or the agreement failed)."""
        return self._result is not None or self._error is not None

    @property
    def result(self) -> int | None:
        """The agreed value (the minimum of every rank's), or None until resolved."""
        return self._result

    def settle(self, value: int) -> None:
        """Give this rank's value (an int in [0, 2**62 - 1)). The first value settled counts; later calls
        are ignored, so a cleanup path may settle a safe default unconditionally.

        Raises:
            ValueError: naming `value` when it is negative or too large.
        """
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"value: expected an int, got {type(value).__name__} {value!r}")
        if not 0 <= value < NONE:
            raise ValueError(f"value: must be in [0, 2**62 - 1), got {value}")
        if self._local is not None or self.resolved:
            return
        self._local = value
        if self._immediate:
            self._resolve(value)
        elif self._notify is not None:
            self._notify()

    def _resolve(self, value: int) -> None:
        self._result = value
        self._wake(value)

    def _fail(self, error: BaseException) -> None:
        if self.resolved:
            return
        self._error = error
        self._wake(None)

    def _wake(self, agreed: int | None) -> None:
        """Wake the waiter and run `on_resolve` (once) with `agreed` (None: the agreement failed)."""
        if self._event is not None:
            self._event.set()
        if self._on_resolve is not None:
            callback, self._on_resolve = self._on_resolve, None
            callback(agreed)

    async def wait(self) -> int:
        """Wait until the ranks agree and return the agreed value.

        Raises:
            RankFailed: the group failed (a peer died or stopped responding) before the decision resolved.
            RankDivergence: the ranks proposed different decisions in this one's place.
        """
        if not self.resolved:
            if self._event is None:
                self._event = asyncio.Event()
            await self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        if self._error is not None:
            state = f"failed: {type(self._error).__name__}"
        elif self._result is not None:
            state = f"agreed={self._result}"
        else:
            state = f"local={self._local}" if self._local is not None else "unsettled"
        return f"Decision(seq={self.seq}, kind={self.kind}, key={self.key!r}, {state})"
