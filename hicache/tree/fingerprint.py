"""A tree's fingerprint: its structure, each node's tiers, backed-up flags and locks, in canonical order.

Tensor-parallel ranks run identical trees over their own slices of the KV heads: the same nodes, on the
same tiers, with the same locks. Pool indices, page hashes (they chain the namespace, which holds the rank)
and node ids are rank-local and stay out. `node_records` lists the nodes depth-first with children sorted by
their first page's tokens, so two trees built by the same operations in any order of dict insertion give
the same list; `fingerprint` digests it; `describe_difference` names the first node where ranks differ.
Pure and synchronous; reads the tree through `iter_nodes()`, `node_info()` and `component_value()`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import xxhash

from hicache.keys import TOKEN_BYTES
from hicache.tree.handles import NodeInfo, NodeRef
from hicache.tree.radix import RadixTree

__all__ = ["NodeRecord", "describe_difference", "fingerprint", "fingerprint_of", "node_records"]

_PREVIEW_TOKENS = 8


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What the ranks must agree on about one node.

    Attributes:
        start: the node's first token position (the tokens of its ancestors).
        tokens: the node's number of tokens.
        path: a digest of every token from the root through this node (rank-independent).
        device: whether the node holds device pages.
        host: whether the node is backed up to host.
        backup_pending: whether a device-to-host backup is in flight.
        device_lock: the node's device lock count.
        host_lock: the node's host lock count.
        components: per component (sorted by name), the tiers holding its data (`"device"`, `"host"`).
        node_id: the node's id on this rank (shown in messages, not compared).
        preview: the node's first tokens (shown in messages, not compared).
    """

    start: int
    tokens: int
    path: int
    device: bool
    host: bool
    backup_pending: bool
    device_lock: int
    host_lock: int
    components: tuple[tuple[str, str], ...]
    node_id: int = 0
    preview: tuple[int, ...] = ()

    def compared(self) -> tuple[object, ...]:
        """The fields that must be equal on every rank."""
        return (
            self.start,
            self.tokens,
            self.path,
            self.device,
            self.host,
            self.backup_pending,
            self.device_lock,
            self.host_lock,
            self.components,
        )


def node_records(tree: RadixTree) -> list[NodeRecord]:
    """Every node but the root, depth-first, children in the order of their first page's token bytes."""
    infos = {ref: tree.node_info(ref) for ref in tree.iter_nodes()}
    kids: dict[NodeRef | None, list[NodeInfo]] = {}
    for info in infos.values():
        parent = info.parent if info.parent in infos else None  # None: a child of the root
        kids.setdefault(parent, []).append(info)
    names = [c.name for c in tree.components]
    out: list[NodeRecord] = []
    stack = [(info, 0, 0) for info in sorted(kids.get(None, ()), key=_first_page, reverse=True)]
    while stack:
        info, start, parent_path = stack.pop()
        key = info.key
        path = xxhash.xxh3_64_intdigest(key, seed=parent_path)
        comps: list[tuple[str, str]] = []
        for name in sorted(names):
            tiers = [t for t in ("device", "host") if tree.component_value(info.ref, name, t) is not None]
            if tiers:
                comps.append((name, "+".join(tiers)))
        n = len(key) // TOKEN_BYTES
        preview = tuple(
            int.from_bytes(key[i : i + TOKEN_BYTES], "little", signed=True)
            for i in range(0, min(len(key), _PREVIEW_TOKENS * TOKEN_BYTES), TOKEN_BYTES)
        )
        out.append(
            NodeRecord(
                start=start,
                tokens=n,
                path=path,
                device=info.device_value is not None,
                host=info.host_value is not None,
                backup_pending=info.backup_pending is not None,
                device_lock=info.device_lock,
                host_lock=info.host_lock,
                components=tuple(comps),
                node_id=info.ref.id,
                preview=preview,
            )
        )
        for child in sorted(kids.get(info.ref, ()), key=_first_page, reverse=True):
            stack.append((child, start + n, path))
    return out


def _first_page(info: NodeInfo) -> bytes:
    return info.key


def fingerprint(tree: RadixTree) -> int:
    """A 61-bit digest of `node_records(tree)`'s compared fields (equal trees, equal digests)."""
    return fingerprint_of(node_records(tree))


def fingerprint_of(records: Sequence[NodeRecord]) -> int:
    """`fingerprint` of a tree whose `node_records` are `records` (a snapshot taken earlier)."""
    h = xxhash.xxh3_64()
    for record in records:
        h.update(repr(record.compared()).encode())
    return h.intdigest() & ((1 << 61) - 1)


def encode_records(records: Sequence[NodeRecord]) -> bytes:
    """`records` as JSON bytes (what ranks exchange when their fingerprints differ)."""
    return json.dumps([asdict(r) for r in records], separators=(",", ":")).encode()


def _decode(payload: bytes) -> list[NodeRecord]:
    out = []
    for raw in json.loads(payload.decode()):
        raw["components"] = tuple(tuple(c) for c in raw["components"])
        raw["preview"] = tuple(raw["preview"])
        out.append(NodeRecord(**raw))
    return out


def _show(record: NodeRecord | None) -> str:
    if record is None:
        return "no node there"
    tiers = [t for t, on in (("device", record.device), ("host", record.host)) if on]
    if record.backup_pending:
        tiers.append("backup-pending")
    comps = "".join(f", {name}@{tiers or 'none'}" for name, tiers in record.components)
    return (
        f"node {record.node_id} tokens [{record.start}, {record.start + record.tokens}) starting "
        f"{list(record.preview)} tiers={'+'.join(tiers) or 'none'} device_lock={record.device_lock} "
        f"host_lock={record.host_lock}{comps}"
    )


def describe_difference(shared: Sequence[bytes], *, this_rank: int = 0) -> str:
    """Name the first node (in canonical order) where some rank's tree differs from rank 0's.

    Args:
        shared: each rank's `encode_records` payload, by rank.
        this_rank: the rank reporting (named in the message).
    """
    trees = [_decode(p) for p in shared]
    reference = trees[0]
    first: tuple[int, int] | None = None  # (position, rank)
    for rank, records in enumerate(trees[1:], start=1):
        for i in range(max(len(records), len(reference))):
            a = reference[i] if i < len(reference) else None
            b = records[i] if i < len(records) else None
            if a is None or b is None or a.compared() != b.compared():
                if first is None or i < first[0]:
                    first = (i, rank)
                break
    if first is None:
        return f"rank {this_rank}: the tree fingerprints differ but no node does (a digest collision)"
    i, rank = first
    a = reference[i] if i < len(reference) else None
    b = trees[rank][i] if i < len(trees[rank]) else None
    return (
        f"rank {this_rank}: the ranks' trees differ at node #{i} in canonical order: "
        f"rank 0 has {_show(a)}; rank {rank} has {_show(b)}"
    )
