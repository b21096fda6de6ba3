"""Turns of event-loop work: at most one caller resumes from `LoopPacer.turn` per loop iteration.

Sixteen prefetches started together otherwise run their first stage and their commit side by side: every
one of them resumes in the same loop iteration (their awaits end together), so that iteration carries
sixteen prefetches' worth of key conversion, page hashing, storage keys and tree inserts before any other
task (a decode step) runs again (issue 12). Each of those stages is bounded on its own; the pacer bounds
how many of them share an iteration. A prefetch takes two turns: one on its way down (at `start`: key
conversion, the peek, hashing), one on its way back (its commit's atomic part).

Queued turns go oldest ticket first, not first come first served: a prefetch takes a ticket when it starts
and shows it at its commit, so its commit goes ahead of the first stages of prefetches started after it.
Its allocation and launch take no turn: they follow its probe's await, never queued behind other
prefetches' hashing (which once left the read threads idle: 2-4 ms of a 55 ms pass of 1 GiB hot reads).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["LoopPacer"]


class LoopPacer:
    """Hands out turns of bounded loop work, one per event-loop iteration, oldest ticket first.

    A caller awaits `turn()` and then does one bounded piece of synchronous work before its next await.
    With nobody else's turn in this iteration, `turn()` returns at once (no await: an idle cache adds no
    loop iteration to a request); otherwise the caller queues and is resumed in a later iteration, one
    waiter per iteration, the one with the oldest ticket (`ticket()`; a turn asked for without one takes a
    new ticket, so those go in arrival order). A waiter cancelled before its turn gives its place up; one
    cancelled after its turn was handed out consumes it.

    asyncio only: it relies on a callback scheduled during an iteration running in the next one.
    """

    def __init__(self) -> None:
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        """Queued turns as a heap of (ticket, arrival, waiter)."""
        self._arrivals = itertools.count()
        self._tickets = itertools.count()
        self._active = False
        """A turn was handed out in this iteration or the previous one: callers queue."""
        self._handed = False
        """The last `_hand_on` resumed a waiter, which runs in this iteration."""
        self.turns = 0
        """Turns asked for so far (a caller cancelled while queued included)."""
        self.queued = 0
        """Of `turns`, those that waited for an earlier caller's turn."""

    @property
    def waiting(self) -> int:
        """Callers queued for a turn now (some may have been cancelled and not yet skipped)."""
        return len(self._waiters)

    def __repr__(self) -> str:
        return f"<LoopPacer turns={self.turns} queued={self.queued} waiting={self.waiting}>"

    def ticket(self) -> int:
        """A new ticket: newer than every ticket handed out before. Keep it for the turns of one piece of
        work (a prefetch's stages) so they go ahead of work started later."""
        return next(self._tickets)

    async def turn(self, ticket: int | None = None) -> None:
        """Return when this caller may run its piece of loop work: no other caller resumes from `turn`
        in the same loop iteration. Queued callers resume oldest `ticket` first (None: a new one)."""
        loop = asyncio.get_running_loop()
        self.turns += 1
        if not self._active:
            self._active = True
            loop.call_soon(self._hand_on)  # next iteration: resume the next waiter, or go idle
            return
        self.queued += 1
        waiter: asyncio.Future[None] = loop.create_future()
        order = self.ticket() if ticket is None else ticket
        heapq.heappush(self._waiters, (order, next(self._arrivals), waiter))
        await waiter

    def _hand_on(self) -> None:
        """Runs once per iteration while turns are queued: resume the next live waiter (in the next
        iteration), or go idle once the last one resumed has had its iteration to itself."""
        loop = asyncio.get_running_loop()
        while self._waiters:
            *_, waiter = heapq.heappop(self._waiters)
            if not waiter.done():  # a cancelled waiter gave its place up
                waiter.set_result(None)
                self._handed = True
                loop.call_soon(self._hand_on)
                return
        if self._handed:  # the waiter resumed last runs in this iteration: no second turn beside it
            self._handed = False
            loop.call_soon(self._hand_on)
            return
        self._active = False
