"""Hybrid components in the pure tree: one scenario per rule (window, tombstone, state, cascade, locks, sanity)."""

from __future__ import annotations

from typing import Protocol

import pytest
import torch

from hicache.components import MambaState, SlidingWindow
from hicache.errors import InvariantViolation
from hicache.layout import KVLayout
from hicache.tree import ComponentFree, RadixTree


class HasFrees(Protocol):
    @property
    def component_frees(self) -> tuple[ComponentFree, ...]: ...


PAGE = 4
WINDOW = 8


def swa() -> SlidingWindow:
    return SlidingWindow(WINDOW, KVLayout.flat(8, PAGE), device_pages=16, host_pages=16)


def mamba() -> MambaState:
    return MambaState(32, device_slots=8, host_slots=8)


def make_tree(*names: str, write_policy: str = "write_through") -> RadixTree:
    comps = [swa() if n == "swa" else mamba() for n in names]
    return RadixTree(PAGE, write_policy=write_policy, components=comps)


def ids(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def seq(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def frees(*results: HasFrees) -> dict[tuple[str, str], list[int]]:
    """The component indices the results say the tree let go of, by (component, tier)."""
    out: dict[tuple[str, str], list[int]] = {}
    for r in results:
        for f in r.component_frees:
            out.setdefault((f.component, f.tier), []).extend(f.indices.tolist())
    return out


def test_a_match_ends_only_where_the_sliding_window_is_complete() -> None:
    """A prefix ending inside a node whose window KV covers only the node's tail is truncated to the
    previous node end: the window before the split point has no KV."""
    tree = make_tree("swa")
    a, b = seq(16), seq(16, 100)
    r1 = tree.insert(a, ids(0, 16), {"swa": ids(0, 8)})
    r2 = tree.insert(a + b, ids(0, 32), {"swa": ids(8, 8)})
    assert tree.match_prefix(a + b).device_len == 32
    assert tree.match_prefix(a).device_len == 16
    # Ending after b's first 8 tokens: b's window KV covers only its last 8 tokens.
    assert tree.match_prefix(a + b[:8]).device_len == 16
    assert frees(r1, r2) == {}  # every window index found a node
    tree.sanity_check()


def test_old_window_pages_become_a_tombstone_while_the_node_keeps_serving_full_attention() -> None:
    """Evicting an internal node's window KV keeps its full-attention KV: deeper matches still hit,
    a match ending at the tombstone does not."""
    tree = make_tree("swa")
    a, b = seq(16), seq(16, 100)
    tree.insert(a, ids(0, 16), {"swa": ids(0, 8)})
    tree.insert(a + b, ids(0, 32), {"swa": ids(8, 8)})
    upper = tree.match_prefix(a).last_device_node
    tree.lock_device(tree.match_prefix(a + b).last_device_node)  # protects b's window (and a's)
    assert tree.evict_component("swa", 8).evicted_slots == 0
    tree.unlock_device(tree.match_prefix(a + b).last_device_node)
    # LRU: a was touched by the last match too; both are candidates; evict until a's window is gone.
    evicted = []
    while tree.component_value(upper, "swa") is not None:
        evicted.append(tree.evict_component("swa", 1))
        assert evicted[-1].evicted_slots > 0
    assert tree.node_info(upper).device_value is not None  # the node stays for full attention
    assert tree.match_prefix(a).device_len == 0
    assert set(range(8)) <= set(frees(*evicted)[("swa", "device")])
    tree.sanity_check()


def test_a_match_ends_only_at_a_node_holding_a_mamba_state() -> None:
    """Splitting a node leaves its state at the end (the lower part): a match ending at the split point
    is truncated to the previous state."""
    tree = make_tree("mamba")
    a, b = seq(16), seq(16, 100)
    tree.insert(a, ids(0, 16), {"mamba": ids(0, 1)})
    tree.insert(a + b, ids(0, 32), {"mamba": ids(1, 1)})
    assert tree.match_prefix(a + b).device_len == 32
    assert tree.match_prefix(a + b[:8]).device_len == 16
    lower = tree.match_prefix(a + b).last_device_node
    assert tree.component_value(lower, "mamba") is not None
    assert tree.component_window(lower) == {"mamba": ids(1, 1)}
    tree.sanity_check()


def test_a_host_match_may_pass_a_shared_prefix_that_holds_no_state() -> None:
    """Two conversations share a prefix whose split node holds no state: one user's own history on the
    host is still a match, since a component needs to be valid only where the prefix ends."""
    tree = make_tree("mamba")
    a, b, c = seq(16), seq(16, 100), seq(16, 200)
    tree.insert(a + b, ids(0, 32), {"mamba": ids(0, 1)})
    tree.insert(a + c, ids(32, 32), {"mamba": ids(1, 1)})
    own = tree.match_prefix(a + b).last_device_node
    upper = tree.node_info(own).parent
    assert upper is not None
    assert tree.component_value(upper, "mamba") is None  # the split point holds no state
    tree.begin_backup(upper, ids(100, 16))
    tree.commit_backup(upper)
    tree.begin_backup(own, ids(116, 16), {"mamba": ids(5, 1)})
    tree.commit_backup(own)
    assert frees(tree.demote(own)) == {("mamba", "device"): [0]}
    m = tree.match_prefix(a + b)
    assert (m.device_len, m.host_len) == (16, 16)
    assert m.host_nodes == (own,)
    # Without the host state the same prefix matches nothing: the shared node is no valid end.
    assert tree.evict_component("mamba", 1, "host").evicted_slots == 1
    m = tree.match_prefix(a + b)
    assert (m.device_len, m.host_len) == (0, 0)
    tree.sanity_check()


def test_a_state_on_an_unaligned_key_is_handed_back() -> None:
    """A state taken after a partial last page does not sit at a node end: the tree frees it."""
    tree = make_tree("mamba")
    r = tree.insert(seq(18), ids(0, 18), {"mamba": ids(5, 1)})
    assert frees(r) == {("mamba", "device"): [5]}
    assert tree.match_prefix(seq(16)).device_len == 0
    tree.sanity_check()


def test_evicting_the_window_cascades_to_the_state_and_evicting_full_attention_to_both() -> None:
    """Priority full > SWA > Mamba: a window tombstone drops the node's state; losing the device copy of
    the base drops every component there."""
    tree = make_tree("swa", "mamba")
    a = seq(16)
    tree.insert(a, ids(0, 16), {"swa": ids(0, 8), "mamba": ids(0, 1)})
    node = tree.match_prefix(a).last_device_node
    r = tree.evict_component("mamba", 1)
    assert r.evicted_slots == 1
    assert tree.component_value(node, "swa") is not None  # a state eviction leaves the window
    assert frees(r) == {("mamba", "device"): [0]}
    assert frees(tree.insert(a, ids(100, 16), {"mamba": ids(3, 1)})) == {}
    assert tree.component_value(node, "mamba") is not None
    r = tree.evict_component("swa", 8)
    assert r.evicted_slots == 8
    assert tree.component_value(node, "mamba") is None
    assert frees(r) == {("swa", "device"): list(range(8)), ("mamba", "device"): [3]}
    assert frees(tree.insert(a, ids(100, 16), {"swa": ids(8, 8), "mamba": ids(4, 1)})) == {}
    evicted = tree.evict_device(16)
    assert evicted.freed_device.tolist() == list(range(16))
    assert frees(evicted) == {("swa", "device"): list(range(8, 16)), ("mamba", "device"): [4]}
    tree.sanity_check()


def test_component_info_shows_each_record_without_reaching_into_the_node() -> None:
    """The public snapshot of a node's component records: values per tier, the backup in flight and the
    locks (tests read them through the tree's private nodes before)."""
    tree = make_tree("swa", "mamba")
    a = seq(16)
    tree.insert(a, ids(0, 16), {"swa": ids(0, 8), "mamba": ids(0, 1)})
    leaf = tree.match_prefix(a).last_device_node
    assert tree.component_info(leaf)["mamba"].device_lock == 0
    tree.lock_device(leaf)
    tree.begin_backup(leaf, ids(100, 16), {"swa": ids(40, 8), "mamba": ids(7, 1)})
    info = tree.component_info(leaf)
    assert set(info) == {"swa", "mamba"}
    swa_info, mamba_info = info["swa"], info["mamba"]
    assert swa_info.device_value is not None
    assert torch.equal(swa_info.device_value, ids(0, 8))
    assert swa_info.host_value is None
    assert swa_info.backup_pending is not None
    assert torch.equal(swa_info.backup_pending, ids(40, 8))
    assert mamba_info.backup_pending is not None
    assert torch.equal(mamba_info.backup_pending, ids(7, 1))
    assert swa_info.device_lock == mamba_info.device_lock == tree.node_info(leaf).device_lock
    assert swa_info.host_lock == 0
    tree.commit_backup(leaf)
    assert torch.equal(tree.component_info(leaf)["mamba"].host_value, ids(7, 1))  # type: ignore[arg-type]
    tree.unlock_device(leaf)
    tree.sanity_check()


def test_component_locks_are_per_component_and_never_above_the_base_lock() -> None:
    """A lock protects the whole path's window KV but only the locked node's state: an ancestor's state
    can still be evicted while a request runs."""
    tree = make_tree("swa", "mamba")
    a, b = seq(16), seq(16, 100)
    tree.insert(a, ids(0, 16), {"swa": ids(0, 8), "mamba": ids(0, 1)})
    tree.insert(a + b, ids(0, 32), {"swa": ids(8, 8), "mamba": ids(1, 1)})
    leaf = tree.match_prefix(a + b).last_device_node
    upper = tree.match_prefix(a).last_device_node
    tree.lock_device(leaf)
    assert tree.evict_component("swa", 100).evicted_slots == 0
    assert tree.evict_component("mamba", 100).evicted_slots == 1  # the ancestor's state only
    assert tree.component_value(upper, "mamba") is None
    assert tree.component_value(leaf, "mamba") is not None
    tree.sanity_check()
    node = tree._require_live(upper)  # white-box: corrupt a lock
    assert node.components is not None
    node.components["swa"].device_lock = node.device_lock + 1
    with pytest.raises(InvariantViolation, match="swa device lock 2 exceeds the base lock 1"):
        tree.sanity_check()
    node.components["swa"].device_lock = node.device_lock
    tree.unlock_device(leaf)
    tree.sanity_check()


def test_backup_and_load_back_carry_components_and_a_host_match_needs_them_on_the_host() -> None:
    """A node backed up with its window and state can be demoted and matched on the host; loading it back
    attaches the components again."""
    tree = make_tree("swa", "mamba")
    a = seq(16)
    tree.insert(a, ids(0, 16), {"swa": ids(0, 8), "mamba": ids(0, 1)})
    node = tree.match_prefix(a).last_device_node
    tree.begin_backup(node, ids(0, 16), {"swa": ids(40, 8), "mamba": ids(7, 1)})
    with pytest.raises(ValueError, match="already backed up"):
        tree.begin_backup(node, ids(0, 16))
    tree.commit_backup(node)
    assert tree.component_statistics()["swa"].host_slots == 8
    assert frees(tree.demote(node)) == {("swa", "device"): list(range(8)), ("mamba", "device"): [0]}
    m = tree.match_prefix(a)
    assert (m.device_len, m.host_len) == (0, 16)
    tree.attach_device(node, ids(50, 16), {"swa": ids(60, 8), "mamba": ids(2, 1)})
    assert tree.match_prefix(a).device_len == 16
    # Without the host state, the same host node is not a match.
    assert frees(tree.demote(node)) == {("swa", "device"): list(range(60, 68)), ("mamba", "device"): [2]}
    assert tree.evict_component("mamba", 1, "host").evicted_slots == 1
    assert tree.match_prefix(a).host_len == 0
    tree.sanity_check()


def test_component_copies_without_a_source_value_or_of_the_wrong_length_are_refused() -> None:
    """A backup or load-back naming a component the node holds nothing of on the source tier, an unknown
    component, or a copy of the wrong length is refused with a message naming it, before the tree changes
    (a wrong copy would otherwise become a value pointing at pages that hold something else)."""
    tree = make_tree("swa", "mamba")
    a = seq(16)
    node = tree.insert(a, ids(0, 16), {"swa": ids(0, 8)}).node  # no Mamba state was given
    before = (tree.statistics(), tree.component_statistics())
    with pytest.raises(ValueError, match="unknown component 'nope'"):
        tree.begin_backup(node, ids(0, 16), {"nope": ids(0, 1)})
    with pytest.raises(
        ValueError, match=r"components\['mamba'\]: node \d+ holds no mamba value on the device"
    ):
        tree.begin_backup(node, ids(0, 16), {"mamba": ids(7, 1)})
    with pytest.raises(ValueError, match=r"components\['swa'\]: expected 8 entries"):
        tree.begin_backup(node, ids(0, 16), {"swa": ids(40, 4)})
    assert (tree.statistics(), tree.component_statistics()) == before
    tree.begin_backup(node, ids(0, 16), {"swa": ids(40, 8)})
    tree.commit_backup(node)
    tree.demote(node)
    with pytest.raises(ValueError, match=r"components\['mamba'\]: node \d+ holds no mamba value on the host"):
        tree.attach_device(node, ids(50, 16), {"mamba": ids(2, 1)})
    with pytest.raises(ValueError, match=r"components\['swa'\]: expected 8 entries"):
        tree.attach_device(node, ids(50, 16), {"swa": ids(60, 16)})
    assert tree.node_info(node).device_value is None
    tree.sanity_check()


def test_aborted_component_backup_is_handed_back() -> None:
    """An aborted backup returns the base host indices and the component's, for the caller to free."""
    tree = make_tree("swa")
    tree.insert(seq(16), ids(0, 16), {"swa": ids(0, 16)})
    node = tree.match_prefix(seq(16)).last_device_node
    tree.begin_backup(node, ids(0, 16), {"swa": ids(16, 16)})
    assert tree.component_statistics()["swa"].pending_backup_slots == 16
    aborted = tree.abort_backup(node)
    assert aborted.freed_host.tolist() == list(range(16))
    assert frees(aborted) == {("swa", "host"): list(range(16, 32))}
    tree.sanity_check()


def test_a_dropped_refill_leaves_its_component_buffers_to_the_caller() -> None:
    """Under write-through a refill below an un-backed node is dropped: the tree takes no component
    index (the controller releases them with the host pages in one call)."""
    tree = make_tree("swa", "mamba")
    tree.insert(seq(16), ids(0, 16))
    r = tree.insert_host(tree.root, seq(32), ids(0, 32), components={"swa": ids(0, 8), "mamba": ids(0, 1)})
    assert r.host_insert_dropped
    assert r.component_frees == ()
    assert all(s.host_slots == 0 for s in tree.component_statistics().values())
    tree.sanity_check()


def test_a_refill_attaches_the_window_as_a_suffix_and_the_state_at_its_end() -> None:
    """A storage refill's window covers its last pages and its state its end: only the end matches."""
    tree = make_tree("swa", "mamba")
    r = tree.insert_host(tree.root, seq(32), ids(0, 32), components={"swa": ids(0, 8), "mamba": ids(0, 1)})
    assert not r.host_insert_dropped
    assert tree.component_value(r.node, "swa", "host") is not None
    m = tree.match_prefix(seq(32))
    assert (m.device_len, m.host_len) == (0, 32)
    assert tree.match_prefix(seq(24)).host_len == 0  # neither a state nor a window there
    tree.sanity_check()


def test_sanity_check_reports_component_data_without_base_data_and_counter_drift() -> None:
    """Component data on a tier without the base value, drifted counters and a malformed window suffix
    are all reported."""
    tree = make_tree("swa")
    tree.insert(seq(16), ids(0, 16), {"swa": ids(0, 8)})
    node = tree._require_live(tree.match_prefix(seq(16)).last_device_node)  # white-box: corrupt it
    assert node.components is not None
    node.components["swa"].host_value = ids(0, 8)
    with pytest.raises(InvariantViolation) as info:
        tree.sanity_check()
    text = "\n".join(info.value.violations)
    assert "swa.host_value without the base value on that tier" in text
    assert "counter swa host slots: kept 0, recomputed 8" in text
    node.components["swa"].host_value = None
    node.components["swa"].device_value = ids(0, 6)
    with pytest.raises(InvariantViolation, match="not a non-empty page-aligned suffix"):
        tree.sanity_check()


def test_without_components_nodes_carry_no_component_data() -> None:
    """The base case is untouched: no records, no component frees, and components are refused."""
    tree = RadixTree(PAGE)
    assert tree.insert(seq(16), ids(0, 16)).component_frees == ()
    tree.lock_device(tree.match_prefix(seq(16)).last_device_node)
    assert all(tree.component_info(n) == {} for n in tree.iter_nodes())
    assert tree.component_statistics() == {}
    with pytest.raises(ValueError, match="no components"):
        tree.insert(seq(32), ids(0, 32), {"swa": ids(0, 8)})
    with pytest.raises(ValueError, match="taken"):
        RadixTree(PAGE, components=[swa(), swa()])
