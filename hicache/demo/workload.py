"""A seeded multi-user, multi-turn chat workload for the demo.

Every user has one conversation that starts with one of a few shared system prompts. Each turn appends the
user's new tokens to the history; the model's decoded tokens are appended after the turn is served, so the
next turn's prompt is the whole conversation so far. Shared system prompts give cross-user hits; returning
users whose history was pushed out of the device and host pools by others give host and storage hits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

__all__ = ["Conversation", "Session", "Workload", "WorkloadSpec", "make_workload"]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The knobs of the workload; everything random is drawn from `seed`.

    Attributes:
        users: concurrent simulated users, one conversation each.
        turns: turns per conversation.
        system_prompts: distinct system prompts shared among the users.
        system_prompt_tokens: length of each system prompt.
        user_tokens: inclusive range of the number of new user tokens per turn.
        decode_tokens: tokens the model generates per turn.
        arrival_gap_s: users arrive this far apart, in order.
        think_time_s: inclusive range of the pause between a user's turns.
        vocab_size: token ids are drawn from `[0, vocab_size)`.
        seed: the workload seed.
    """

    users: int = 8
    turns: int = 4
    system_prompts: int = 3
    system_prompt_tokens: int = 320
    user_tokens: tuple[int, int] = (48, 160)
    decode_tokens: int = 8
    arrival_gap_s: float = 0.05
    think_time_s: tuple[float, float] = (0.05, 0.4)
    vocab_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "users",
            "turns",
            "system_prompts",
            "system_prompt_tokens",
            "decode_tokens",
            "vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        lo, hi = self.user_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"user_tokens: expected 1 <= low <= high, got {self.user_tokens!r}")
        tlo, thi = self.think_time_s
        if not 0 <= tlo <= thi or self.arrival_gap_s < 0:
            raise ValueError(
                f"think_time_s/arrival_gap_s: expected 0 <= low <= high and gap >= 0, "
                f"got {self.think_time_s!r}, {self.arrival_gap_s!r}"
            )


@dataclass(frozen=True, slots=True)
class Conversation:
    """One user's scripted side of a conversation.

    Attributes:
        user: the user's number.
        system_prompt: which shared system prompt the conversation starts with.
        start_delay_s: when the user arrives, from the start of the run.
        turn_tokens: the user's new tokens, one tuple per turn.
        think_times_s: the pause after each turn.
    """

    user: int
    system_prompt: int
    start_delay_s: float
    turn_tokens: tuple[tuple[int, ...], ...]
    think_times_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    """The whole scripted workload: shared system prompts and one conversation per user."""

    spec: WorkloadSpec
    system_prompts: tuple[tuple[int, ...], ...]
    conversations: tuple[Conversation, ...]

    @property
    def num_requests(self) -> int:
        """Requests the workload issues (users times turns)."""
        return sum(len(c.turn_tokens) for c in self.conversations)


def make_workload(spec: WorkloadSpec) -> Workload:
    """Draw a workload from `spec.seed`; the same spec always gives the same workload."""
    rng = random.Random(spec.seed)
    vocab = spec.vocab_size
    system_prompts = tuple(
        tuple(rng.randrange(vocab) for _ in range(spec.system_prompt_tokens))
        for _ in range(spec.system_prompts)
    )
    conversations = []
    for user in range(spec.users):
        turns = tuple(
            tuple(rng.randrange(vocab) for _ in range(rng.randint(*spec.user_tokens)))
            for _ in range(spec.turns)
        )
        conversations.append(
            Conversation(
                user=user,
                system_prompt=user % spec.system_prompts,
                start_delay_s=user * spec.arrival_gap_s,
                turn_tokens=turns,
                think_times_s=tuple(round(rng.uniform(*spec.think_time_s), 4) for _ in range(spec.turns)),
            )
        )
    return Workload(spec=spec, system_prompts=system_prompts, conversations=tuple(conversations))


@dataclass(slots=True)
class Session:
    """A user's conversation while it is being served: the history grows by prompt and reply each turn.

    Args:
        workload: the workload the conversation belongs to.
        conversation: the scripted user side.
    """

    workload: Workload
    conversation: Conversation
    history: list[int] = field(default_factory=list)
    turn: int = 0

    def __post_init__(self) -> None:
        if not self.history:
            self.history = list(self.workload.system_prompts[self.conversation.system_prompt])

    @property
    def done(self) -> bool:
        """Whether every turn has been served."""
        return self.turn >= len(self.conversation.turn_tokens)

    def next_prompt(self) -> torch.Tensor:
        """The prompt of the next turn: the history plus the user's new tokens, as an int64 tensor."""
        if self.done:
            raise ValueError(f"user {self.conversation.user}: all {self.turn} turns were already served")
        return torch.tensor(self.history + list(self.conversation.turn_tokens[self.turn]), dtype=torch.int64)

    def record_reply(self, prompt: torch.Tensor, reply: list[int]) -> None:
        """Append the served prompt and the model's reply to the history and move to the next turn."""
        self.history = [int(t) for t in prompt.tolist()] + list(reply)
        self.turn += 1
