"""Mamba (or any recurrent / linear-attention) state: one fixed-size snapshot at a node's end.

Per node and tier the value is one slot of the component's pool (a pool whose "page" is one slot of
`state_nbytes` opaque bytes), or nothing. A prefix can end at a node only when the node holds a state:
the recurrence cannot be resumed anywhere else. A split leaves the state with the lower part (the
original node, which keeps the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.components.base import PathValues
from hicache.layout import KVLayout

__all__ = ["MambaState"]


@dataclass(frozen=True)
class MambaState:
    """A recurrent-state snapshot as a component.

    Attributes:
        state_nbytes: bytes of one state (all layers).
        device_slots: states the device pool holds.
        host_slots: states the host pool holds.
        name: the component's name (unique in a cache; a suffix of its storage keys).
        rank: eviction order (the highest by default: states go first).

    Raises:
        ValueError: a field out of range.
    """

    state_nbytes: int
    device_slots: int
    host_slots: int
    name: str = "mamba"
    rank: int = 2

    def __post_init__(self) -> None:
        for field_name in ("state_nbytes", "device_slots", "host_slots", "rank"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name}: expected an int >= 1, got {value!r}")
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name: expected an identifier, got {self.name!r}")

    @property
    def device_pages(self) -> int:
        """Pages of the device pool (one slot each)."""
        return self.device_slots

    @property
    def host_pages(self) -> int:
        """Pages of the host pool (one slot each)."""
        return self.host_slots

    @property
    def lock_path(self) -> bool:
        """Only the state at the locked node matters; ancestors' states may go."""
        return False

    def pool_layout(self, page_size: int) -> KVLayout:
        """One opaque slot of `state_nbytes` per pool page."""
        return KVLayout.flat(self.state_nbytes, page_size=1)

    def check_value(self, value: torch.Tensor, num_tokens: int, page_size: int) -> str | None:
        """Exactly one slot."""
        if int(value.shape[0]) != 1:
            return f"{int(value.shape[0])} entries instead of one state slot"
        return None

    def split(
        self, value: torch.Tensor, upper_tokens: int, num_tokens: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The state stays at the end, with the lower part."""
        return None, value

    def valid_end(self, path: PathValues) -> bool:
        """The last node holds a state (the empty prefix needs none)."""
        for _, value in path:
            return value is not None
        return True

    def distribute(
        self, spans: Sequence[tuple[int, int]], values: torch.Tensor, end: int, key_tokens: int
    ) -> list[torch.Tensor | None]:
        """The state goes to the last span, if the key ended exactly there."""
        out: list[torch.Tensor | None] = [None] * len(spans)
        if spans and key_tokens == end and spans[-1][1] == end:
            out[-1] = values
        return out

    def prefix_pages(self, num_tokens: int, page_size: int) -> int:
        """One state, named after the prefix's last page."""
        return 1

    def page_hash_index(self, num_pages: int, value: torch.Tensor, page_size: int) -> list[int]:
        """The state is named after the node's last page."""
        return [num_pages - 1]
