"""The lifecycle every storage backend shares: the closed flag, the async context manager, the warning.

A backend is an async context manager with an idempotent `aclose()`; using it after `aclose()` raises
`CacheClosed`, and one garbage-collected while still open warns with `ResourceWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Self

from hicache.errors import CacheClosed

__all__ = ["BackendLifecycle"]


class BackendLifecycle:
    """Mixin for storage backends: `closed`, `aclose()`, `async with`, and the unclosed-resource warning.

    A subclass sets `self._closed = True` first in `__init__` (so a constructor that fails does not warn
    in `__del__`) and `False` once fully constructed; an `aclose()` of its own releases what it holds and
    sets `_closed`. The warning and the `CacheClosed` message name the backend by its `repr`.
    """

    _closed: bool = True

    @property
    def closed(self) -> bool:
        """Whether `aclose()` was called."""
        return self._closed

    async def aclose(self) -> None:
        """Mark the backend closed; idempotent."""
        self._closed = True

    async def __aenter__(self) -> Self:
        self._check_open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # `warnings.warn` is bound as a default so the check still works while the interpreter shuts down.
    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        if not getattr(self, "_closed", True):
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosed(f"{self!r} is closed")
