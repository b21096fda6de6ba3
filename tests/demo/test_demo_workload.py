"""The demo's seeded workload."""

from __future__ import annotations

import pytest

from hicache.demo.workload import Session, WorkloadSpec, make_workload


def test_workload_is_a_function_of_its_seed() -> None:
    """The same seed gives the same conversations; another seed gives others."""
    spec = WorkloadSpec(users=4, turns=3, seed=7)
    assert make_workload(spec) == make_workload(spec)
    assert make_workload(spec) != make_workload(WorkloadSpec(users=4, turns=3, seed=8))
    workload = make_workload(spec)
    assert workload.num_requests == 12
    assert {c.system_prompt for c in workload.conversations} == {0, 1, 2}
    for conv in workload.conversations:
        assert all(48 <= len(t) <= 160 for t in conv.turn_tokens)


def test_session_history_grows_by_prompt_and_reply() -> None:
    """Each turn's prompt extends the previous prompt and reply, so conversations share their prefix."""
    workload = make_workload(WorkloadSpec(users=1, turns=2, seed=1))
    session = Session(workload, workload.conversations[0])
    first = session.next_prompt()
    assert first[: workload.spec.system_prompt_tokens].tolist() == list(workload.system_prompts[0])
    session.record_reply(first, [1, 2, 3])
    second = session.next_prompt()
    assert second[: first.numel() + 3].tolist() == [*first.tolist(), 1, 2, 3]
    session.record_reply(second, [4])
    assert session.done
    with pytest.raises(ValueError, match="already served"):
        session.next_prompt()


def test_workload_spec_names_a_bad_argument() -> None:
    with pytest.raises(ValueError, match="users"):
        WorkloadSpec(users=0)
    with pytest.raises(ValueError, match="user_tokens"):
        WorkloadSpec(user_tokens=(10, 5))
