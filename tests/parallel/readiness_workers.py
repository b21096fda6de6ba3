"""Per-rank functions of the agreed-readiness tests (module level: spawned ranks import them)."""

from __future__ import annotations

from typing import Any

from hicache.errors import LoadBackFailed
from hicache.memory.layerwise import CpuLayerReadiness, CudaLayerReadiness
from hicache.parallel import AgreedLayerReadiness, RankGroup


class RecordedEvent:
    """A CUDA event stand-in: recorded, its copy still running on the GPU."""

    def query(self) -> bool:
        return False


class EnqueuedCopy(CudaLayerReadiness):
    """A CUDA copy's readiness whose enqueue recorded `enqueued` layers' events and stopped (all of them,
    or short: a failed enqueue); the stream wait is recorded instead of run (no GPU needed)."""

    def __init__(self, num_layers: int, enqueued: int) -> None:
        super().__init__(num_layers)
        self.events = [RecordedEvent() for _ in range(enqueued)]  # type: ignore[assignment]
        self._enqueued.set()
        self.stream_waits: list[int] = []

    def wait_layer(self, layer: int) -> None:
        self.stream_waits.append(layer)


def forward_over_cuda_copy(group: RankGroup, enqueued_by_rank: list[int]) -> dict[str, Any]:
    """Every layer's `wait_layer` over this rank's `EnqueuedCopy` (4 layers): which layer raised, the
    readiness collectives and the stream waits."""
    local = EnqueuedCopy(4, enqueued_by_rank[group.tp_rank])
    assert group.readiness is not None
    readiness = AgreedLayerReadiness(local, group.readiness, 4)
    failed = _forward(readiness)
    return {"failed": failed, "collectives": readiness.collectives, "stream_waits": local.stream_waits}


class FinishingCopy(CpuLayerReadiness):
    """A CPU copy's readiness with layer 0 landed, whose other layers land the moment anyone asks
    whether it is done (the copy finishing between two looks at it)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.mark_ready(0)

    @property
    def done(self) -> bool:
        while not self.is_ready(self.num_layers - 1):
            self.mark_ready(self._ready)
        return True


def forward_over_finishing_copy(group: RankGroup) -> dict[str, Any]:
    """Every layer's `wait_layer` over a `FinishingCopy` (4 layers): which layer raised, and the
    readiness collectives."""
    assert group.readiness is not None
    readiness = AgreedLayerReadiness(FinishingCopy(4), group.readiness, 4)
    return {"failed": _forward(readiness), "collectives": readiness.collectives}


def _forward(readiness: AgreedLayerReadiness) -> int:
    """`wait_layer` for each of the 4 layers in order; the layer that raised `LoadBackFailed`, or -1."""
    for layer in range(4):
        try:
            readiness.wait_layer(layer)
        except LoadBackFailed:
            return layer
    return -1


def readiness_group_is_the_group_itself(group: RankGroup) -> str:
    """What `RankGroup` says when given its own process group as the readiness group."""
    try:
        RankGroup(group.process_group, readiness_process_group=group.process_group)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def forward_over_a_load_revoked_on_one_rank(group: RankGroup) -> dict[str, Any]:
    """Every layer's `wait_layer` over a CPU copy whose 4 layers all landed, but whose load was dropped
    (revoked) on rank 1: which layer raised, and the readiness collectives."""
    local = CpuLayerReadiness(4)
    for layer in range(4):
        local.mark_ready(layer)
    readiness = AgreedLayerReadiness(local, group.readiness or group, 4, revoked=lambda: group.tp_rank == 1)
    return {"failed": _forward(readiness), "collectives": readiness.collectives}
