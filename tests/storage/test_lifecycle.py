"""The backend lifecycle mixin: calls in flight, closing that waits for them, release exactly once."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from hicache.errors import CacheClosed
from storage_backends.lifecycle import BackendLifecycle
from storage_backends.protocol import PageStatus


class ToyBackend(BackendLifecycle):
    """A backend whose calls wait for `gate`; `get(["boom"], ...)` raises once let through."""

    def __init__(self) -> None:
        self._closed = True
        self.gate = anyio.Event()
        self.releases = 0
        self._closed = False

    async def exists(self, keys: Sequence[str]) -> int:
        """Count `keys` once the gate opens."""
        await self.gate.wait()
        return len(keys)

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        await self.gate.wait()
        if list(keys) == ["boom"]:
            raise ValueError("keys: boom")
        return [PageStatus.HIT] * len(keys)

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        return [True] * len(keys)

    async def delete(self, keys: Sequence[str]) -> None:
        return None

    def _release(self) -> None:
        self.releases += 1

    def __repr__(self) -> str:
        return f"<ToyBackend releases={self.releases}>"


async def test_aclose_without_calls_releases_once_and_refuses_later_calls() -> None:
    backend = ToyBackend()
    await backend.aclose()
    await backend.aclose()
    assert backend.closed
    assert backend.releases == 1
    with pytest.raises(CacheClosed, match="ToyBackend"):
        await backend.put(["a"], [])
    with pytest.raises(CacheClosed):
        async with backend:
            pass


async def test_a_cancelled_aclose_leaves_the_release_to_the_last_call_in_flight() -> None:
    """Cancelling the wait does not reopen the backend nor release it under a running call."""
    backend = ToyBackend()
    results: list[int] = []

    async def look() -> None:
        results.append(await backend.exists(["a", "b"]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(look)
        await anyio.wait_all_tasks_blocked()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await backend.aclose()
        assert scope.cancelled_caught
        assert backend.closed
        assert backend.releases == 0, "released while a call was in flight"
        with pytest.raises(CacheClosed):
            await backend.exists(["a"])
        backend.gate.set()
    assert results == [2]
    assert backend.releases == 1
    await backend.aclose()
    assert backend.releases == 1


async def test_a_call_that_raises_still_lets_aclose_finish() -> None:
    """A failing call counts out like any other: its error reaches its caller, aclose returns."""
    backend = ToyBackend()
    errors: list[BaseException] = []

    async def failing_get() -> None:
        try:
            await backend.get(["boom"], [])
        except ValueError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(failing_get)
        await anyio.wait_all_tasks_blocked()
        backend.gate.set()
        await backend.aclose()
        assert backend.releases == 1
    assert [str(e) for e in errors] == ["keys: boom"]


def test_subclass_methods_are_wrapped_once() -> None:
    """Each class wraps only what it defines: an inherited method is not counted twice."""

    class Sub(ToyBackend):
        async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
            return [False] * len(keys)

    assert Sub.get is ToyBackend.get
    assert Sub.put is not ToyBackend.put
    assert Sub.put.__name__ == "put"
    assert ToyBackend.exists.__doc__ == "Count `keys` once the gate opens."
    assert Sub.put.__wrapped__.__qualname__.endswith("Sub.put")  # type: ignore[attr-defined]


async def test_an_overriding_subclass_counts_its_calls_in_flight() -> None:
    class Slow(ToyBackend):
        async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
            await self.gate.wait()
            return [True] * len(keys)

    backend = Slow()
    steps: list[str] = []

    async def put() -> None:
        await backend.put(["a"], [])
        steps.append("put returned")

    async def close() -> None:
        await backend.aclose()
        steps.append("aclose returned")

    async with anyio.create_task_group() as tg:
        tg.start_soon(put)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(close)
        await anyio.wait_all_tasks_blocked()
        assert steps == []
        backend.gate.set()
    assert steps == ["put returned", "aclose returned"]
