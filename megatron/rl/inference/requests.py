"""What the continuous-batching scheduler (``scheduler.py``) is configured with and queues: its
limits (``SchedulerConfig``), one generation request (``Request``), and a request as a checkpoint
saves it (``saved_turn``) and restores it (``restored_request``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from megatron.rl.inference.engine_snapshot import SavedTurn
from megatron.rl.inference.protocol import Key, RowWork
from megatron.rl.wire import SamplingParams


@dataclass(frozen=True)
class SchedulerConfig:
    """Capacity and scheduling limits of the scheduler (per data-parallel replica)."""

    max_requests: int = 64
    """Slots per data-parallel replica for keyed requests (rollouts): the most decoded at once."""
    max_seq_len: int = 128
    """Longest prompt + generation a request may reach (the KV cache length)."""
    eos_id: int = 1
    """Token that ends a generation."""
    extra_stop_ids: tuple[int, ...] = ()
    """Other tokens that end a generation (e.g. Llama 3's ``<|eot_id|>``)."""
    barrier_timeout_s: float = 60.0
    """Longest wait for announced requests before stepping without them."""
    window_target: bool = True
    """The deterministic schedule: step keyed requests only while the awaited batch is unfinished
    (``await_batch``), and only past the barrier. False: keyed requests step whenever the engine
    is resumed, like unkeyed ones, without waiting for announced requests (faster, but which
    window generates a token then depends on timing)."""
    reward_wait_steps: int = 0
    """With ``window_target``: engine steps of later batches' keyed work after the awaited batch
    has finished generating, which ``window_spent`` waits for (the reward-wait budget)."""
    outside_slots: int = 0
    """Further slots per replica reserved for unkeyed requests (evaluators, judges, people at the
    endpoint; ``slots.py``): they are served within a few engine steps whatever the rollouts do,
    and under ``window_target`` never shift the rollouts' schedule. 0: unkeyed requests wait for
    a free rollout slot."""
    record_routing: bool = False
    """Runners record each fed token's MoE routes (``RowResult.routes``); a no-op for models
    without routers."""

    def __post_init__(self) -> None:
        if self.reward_wait_steps < 0:
            raise ValueError(f"reward_wait_steps must be >= 0, got {self.reward_wait_steps}")
        if self.outside_slots < 0:
            raise ValueError(f"outside_slots must be >= 0, got {self.outside_slots}")

    @property
    def num_slots(self) -> int:
        """KV-cache slots per replica: the rollouts' and the reserved outside ones."""
        return self.max_requests + self.outside_slots


@dataclass
class Request:
    order: tuple
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    key: Key | None
    future: asyncio.Future
    continued: bool = False
    replica: int = -1
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn: int = 0
    """Requests of the same key before this one (the turns of a multi-turn rollout)."""

    def __lt__(self, other: "Request") -> bool:
        return self.order < other.order

    def next_row(self) -> RowWork:
        """The tokens this request feeds in the coming step."""
        first = not self.tokens
        s = self.sampling
        return RowWork(
            slot=self.slot, tokens=tuple(self.prompt if first else self.tokens[-1:]),
            start=0 if first else len(self.prompt) + len(self.tokens) - 1,
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=self.seed,
            max_tokens=s.max_tokens, ignore_eos=s.ignore_eos,
        )  # fmt: skip


def saved_turn(turn: Request | SavedTurn) -> SavedTurn:
    """A request as a snapshot holds it."""
    if isinstance(turn, SavedTurn):
        return turn
    r = turn
    done = r.future.done() and not r.future.cancelled() and r.future.exception() is None
    reason = r.future.result().finish_reason if done else None
    return SavedTurn(
        key=r.key, turn=r.turn, prompt=r.prompt, sampling=r.sampling, seed=r.seed,
        continued=r.continued, order=r.order, tokens=r.tokens, logprobs=r.logprobs,
        versions=r.versions, finish_reason=reason,
        replica=-1 if reason else r.replica, slot=-1 if reason else r.slot,
    )  # fmt: skip


def restored_request(s: SavedTurn, future: asyncio.Future) -> Request:
    """A snapshot's in-flight request as the scheduler queues it again."""
    return Request(
        tuple(s.order), list(s.prompt), s.sampling, s.seed, s.key, future, s.continued,
        s.replica, s.slot, list(s.tokens), list(s.logprobs), list(s.versions), s.turn,
    )  # fmt: skip
