"""What the continuous-batching scheduler (``scheduler.py``) is configured with and queues: its
limits (``SchedulerConfig``), one generation request (``Request``), and a request as a checkpoint
saves it (``saved_turn``) and restores it (``restored_request``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from megatron.rl.inference.engine_snapshot import SavedTurn
from megatron.rl.inference.protocol import (
    Alternatives,
    GenerationOutput,
    InvalidInferenceRequest,
    Key,
    RowResult,
    RowWork,
    TokenWatch,
)
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
    """Routing replay: runners record the experts each MoE router chose for every token fed
    (``RowResult.routes``) and finished requests return them (``GenerationOutput.routed_experts``);
    a model without routers records nothing."""

    def __post_init__(self) -> None:
        if self.reward_wait_steps < 0:
            raise ValueError(f"reward_wait_steps must be >= 0, got {self.reward_wait_steps}")
        if self.outside_slots < 0:
            raise ValueError(f"outside_slots must be >= 0, got {self.outside_slots}")

    @property
    def num_slots(self) -> int:
        """KV-cache slots per replica: the rollouts' and the reserved outside ones."""
        return self.max_requests + self.outside_slots


def check_request(
    prompt: list[int], sampling: SamplingParams, key: Key | None, adapter: str | None, seq: int
) -> None:
    """``InvalidInferenceRequest`` for a request the engine cannot serve: an empty prompt, one
    that does not fit ``seq`` tokens with its budget, or a rollout (keyed) that asks for an
    adapter, stop strings or alternatives (a rollout generates with the policy, ends at stop
    tokens and records its tokens' logprobs only)."""
    if not prompt or len(prompt) + sampling.max_tokens > seq:
        raise InvalidInferenceRequest(
            f"prompt of {len(prompt)} tokens plus max_tokens={sampling.max_tokens} does not fit "
            f"the engine's max_seq_len={seq}"
        )
    if key is not None and (adapter is not None or sampling.top_logprobs or sampling.stop):
        raise InvalidInferenceRequest(
            "a rollout (keyed request) generates with the policy, ends at stop tokens and "
            "records only its tokens' logprobs: no adapter, 'stop' or 'top_logprobs'"
        )


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
    adapter: str | None = None
    """The named LoRA adapter set it generates with (``RowWork.adapter``)."""
    watch: TokenWatch | None = field(default=None, compare=False)
    """Called with each token as it is recorded (``TokenWatch``); True ends the request."""
    tops: list[Alternatives] = field(default_factory=list, compare=False)
    """Per generated token, its alternatives (``SamplingParams.top_logprobs`` > 0 only)."""
    routes: list[torch.Tensor] = field(default_factory=list, compare=False)
    """Routing replay: the routes of the positions fed so far, in order, as (n, L * k) int16
    chunks (the prompt's, then one per decode step)."""

    def add_routes(self, routes: torch.Tensor | None) -> None:
        """Keep a step's (n_fed, L, k) routes (None: not recorded)."""
        if routes is not None:
            self.routes.append(routes.reshape(routes.shape[0], -1))  # (n_fed, L * k)

    def record(self, res: RowResult, version: int) -> None:
        """Keep one sampled token (and its logprob, ``version``, routes and alternatives)."""
        self.tokens.append(res.token)
        self.logprobs.append(res.logprob)
        self.versions.append(version)
        self.add_routes(res.routes)
        if self.sampling.top_logprobs:
            self.tops.append(res.alternatives)

    def watched(self, res: RowResult, version: int) -> bool:
        """Whether the request's watcher (if any) ends it at the token just recorded."""
        if self.watch is None:
            return False
        return bool(self.watch(res.token, res.logprob, version, res.alternatives))

    def output(self, reason: str) -> GenerationOutput:
        """What the request returns, finished for ``reason``."""
        tops = self.tops if self.sampling.top_logprobs else None
        return GenerationOutput(
            self.tokens, self.logprobs, self.versions, reason, self.routed_experts(), tops
        )

    def routed_experts(self) -> list[list[int]] | None:
        """The routes of every position fed so far (the prompt and the generated tokens but the
        last), flat per position; None unless each of them was recorded (e.g. resumed from a
        snapshot that did not save routes)."""
        fed = len(self.prompt) + len(self.tokens) - 1 if self.tokens else 0
        if not self.routes or sum(len(r) for r in self.routes) != fed:
            return None
        return torch.cat(self.routes).tolist()

    def __lt__(self, other: Request) -> bool:
        return self.order < other.order

    def next_row(self) -> RowWork:
        """The tokens this request feeds in the coming step."""
        first = not self.tokens
        s = self.sampling
        return RowWork(
            slot=self.slot,
            tokens=tuple(self.prompt if first else self.tokens[-1:]),
            start=0 if first else len(self.prompt) + len(self.tokens) - 1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=self.seed,
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            adapter=self.adapter,
            top_logprobs=s.top_logprobs,
        )


def saved_turn(turn: Request | SavedTurn) -> SavedTurn:
    """A request as a snapshot holds it."""
    if isinstance(turn, SavedTurn):
        return turn
    r = turn
    done = r.future.done() and not r.future.cancelled() and r.future.exception() is None
    reason = r.future.result().finish_reason if done else None
    return SavedTurn(
        key=r.key,
        turn=r.turn,
        prompt=r.prompt,
        sampling=r.sampling,
        seed=r.seed,
        continued=r.continued,
        order=r.order,
        tokens=r.tokens,
        logprobs=r.logprobs,
        versions=r.versions,
        finish_reason=reason,
        replica=-1 if reason else r.replica,
        slot=-1 if reason else r.slot,
        routed_experts=r.routed_experts(),
    )


def restored_request(s: SavedTurn, future: asyncio.Future) -> Request:
    """A snapshot's in-flight request as the scheduler queues it again."""
    routes = [] if not s.routed_experts else [torch.tensor(s.routed_experts, dtype=torch.int16)]
    return Request(
        tuple(s.order),
        list(s.prompt),
        s.sampling,
        s.seed,
        s.key,
        future,
        s.continued,
        s.replica,
        s.slot,
        list(s.tokens),
        list(s.logprobs),
        list(s.versions),
        s.turn,
        routes=routes,
    )
