"""The inference protocol: its types, and the two seams every inference backend plugs into.

Everything above inference (agents, the rollout generator, the servers, the training loop's
generation windows) imports from here, never from an implementation module.

* ``InferenceEngine``: what agents generate through (``generate`` with per-token logprobs and
  policy versions), the schedule hints of the forced-lag generator (``BatchScheduler``), the
  lifecycle (``start``/``aclose``) and the generation window (``resume``/``suspend``). One
  implementation: ``scheduler.ContinuousBatchingScheduler``.
* ``RowRunner``: what a ``StepGroup`` executes on every rank, one engine step of a data-parallel
  replica's rows (``RowWork`` -> ``RowResult``) and the plain forwards that score sequences
  (``ScoreWork`` -> ``ScoreOutput``). Implementations, one package per inference
  backend, chosen through ``backends.py``: ``KVCacheRowRunner`` (``cpu/``; the CPU tier: the
  trained model with a per-slot KV cache) and ``DynamicEngineRowRunner`` (``megatron_core/``; the
  CUDA tier: megatron-core's ``DynamicInferenceEngine`` on the trained model).

The protocols are ``runtime_checkable`` so that tests can assert conformance; the check only sees
member names, the conformance tests exercise the behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import torch

from megatron.rl.inference.keys import Key
from megatron.rl.wire import SamplingParams

if TYPE_CHECKING:
    from megatron.rl.inference.engine_snapshot import EngineSnapshot


@dataclass(frozen=True)
class GenerationOutput:
    """What the engine returns for one request."""

    tokens: list[int]
    """Generated token ids, EOS included when the request stopped on it."""
    logprobs: list[float]
    """Per generated token, under the tempered sampling policy."""
    policy_versions: list[int]
    """Policy version that generated each token."""
    finish_reason: Literal["stop", "length"]
    """"stop": EOS sampled; "length": ``max_tokens`` reached."""
    routed_experts: list[list[int]] | None = None
    """Routing replay (``SchedulerConfig.record_routing``, MoE models): per position the request
    fed (prompt + tokens[:-1]), the experts of every MoE layer, flat layer-major (L * k ids)."""
    top_logprobs: list[Alternatives] | None = None
    """Per generated token, the ``SamplingParams.top_logprobs`` most likely tokens of the
    distribution its logprob is from (None: none asked)."""


Alternatives = tuple[tuple[int, float], ...]
"""The most likely tokens at one position: (token id, logprob) pairs, most likely first."""


TokenWatch = Callable[[int, float, int, Alternatives], bool]
"""Sees each token of one request as the engine records it (token, logprob, policy version,
alternatives) and says whether the request ends there (a stop string completed): how the
inference interface streams and stops. It runs inside the engine's step: it must be quick, and
an exception it raises fails its request only."""


@dataclass(frozen=True)
class ScoreOutput:
    """What the engine returns for scoring a sequence (a plain forward, nothing generated)."""

    logprobs: list[float]
    """Logprob of each token after the first, given the tokens before it (temperature 1)."""
    top_logprobs: list[Alternatives]
    """The most likely tokens at each of those positions (empty tuples when none asked)."""


class EngineError(RuntimeError):
    """The engine failed or was closed; every pending and later request raises this."""


class InvalidInferenceRequest(ValueError):
    """The request itself is unusable (too long, tokens outside the vocabulary, ...).

    Agents treat it as an environment error (a masked placeholder rollout), not a crash.
    """


@dataclass(frozen=True)
class RowWork:
    """New tokens for one request (one cache slot) in one engine step."""

    slot: int
    """The request's slot in its replica."""
    tokens: tuple[int, ...]
    """Tokens to feed: the whole prompt on a request's first step, then its last sampled token."""
    start: int
    """Position of ``tokens[0]`` in the request's sequence."""
    temperature: float
    top_p: float
    top_k: int
    seed: int
    """The request's sampling seed."""
    max_tokens: int = 0
    """The request's token budget (0: unknown; runners that need it use the rest of the
    sequence length)."""
    ignore_eos: bool = False
    """The request runs to its budget: stop tokens do not end it (``SamplingParams.ignore_eos``;
    runners that terminate requests themselves must not stop it at EOS)."""
    adapter: str | None = None
    """The named LoRA adapter set the row generates with (a multi-adapter server's request;
    None: the model's own weights and adapters)."""
    top_logprobs: int = 0
    """Alternatives to return with the sampled token (``RowResult.alternatives``)."""


@dataclass(frozen=True)
class RowResult:
    """The token sampled for one row, and its logprob under the tempered policy."""

    slot: int
    token: int
    logprob: float
    routes: torch.Tensor | None = None
    """(n_fed, L, k) int16: the experts each of the L MoE layers chose for each token this row fed
    (None: routing not recorded)."""
    alternatives: Alternatives = ()
    """The row's ``top_logprobs`` most likely tokens of the same distribution."""


@dataclass(frozen=True)
class ScoreWork:
    """One sequence to score: a plain forward over ``tokens`` (no KV cache, nothing sampled)."""

    tokens: tuple[int, ...]
    top_logprobs: int = 0
    """Alternatives per position (``ScoreOutput.top_logprobs``)."""
    adapter: str | None = None
    """The named LoRA adapter set to score with (None: the model as it is)."""


@runtime_checkable
class BatchScheduler(Protocol):
    """Schedule hints the rollout generator gives the engine (deterministic schedule).

    Requests carrying a rollout key are scheduled by key; these hints tell the engine which keyed
    requests are coming and which batch the trainer waits for.
    """

    def expect_group(self, batch_id: int, index_in_batch: int, num_requests: int) -> None:
        """Group (batch, index) is about to send ``num_requests`` keyed requests."""

    def group_done(self, batch_id: int, index_in_batch: int) -> None:
        """Group (batch, index) will send nothing more that it announced."""

    def await_batch(self, batch_id: int | None) -> None:
        """The trainer waits for ``batch_id`` (None: for every submitted batch)."""

    async def window_spent(self, batch_id: int) -> None:
        """Wait until the window of ``batch_id`` has taken every engine step the schedule gives
        it (the reward-wait budget of later batches' steps, if any)."""

    def snapshot(self) -> EngineSnapshot:
        """The keyed work in flight between windows (a checkpoint; ``engine_snapshot.py``)."""

    def restore(self, snapshot: EngineSnapshot) -> None:
        """Continue a ``snapshot`` before any request arrives (a resumed run)."""


@dataclass
class EngineCounters:
    """What the engine has done since start: cumulative counters for the step metrics (the
    trainer logs the difference over each collection window)."""

    generated_tokens: int = 0
    """Tokens sampled."""
    steps: int = 0
    """Engine steps (one forward over every row planned for it)."""
    rows: int = 0
    """Rows over all steps: rows / steps is the mean number of requests decoded per step."""
    step_seconds: float = 0.0
    """Wall-clock seconds inside those steps; a window's time outside them is the engine idle
    (waiting for rewards, announced requests or agents)."""

    def count_step(self, rows: int, seconds: float) -> None:
        """One more engine step, of ``rows`` rows, that took ``seconds``."""
        self.steps, self.rows = self.steps + 1, self.rows + rows
        self.step_seconds += seconds

    def __sub__(self, earlier: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.generated_tokens - earlier.generated_tokens,
            self.steps - earlier.steps,
            self.rows - earlier.rows,
            self.step_seconds - earlier.step_seconds,
        )


@runtime_checkable
class InferenceEngine(BatchScheduler, Protocol):
    """Generates completions on the trainer's own model, stepped only inside generation windows."""

    counters: EngineCounters
    """Tokens, steps, rows and step time since start (for the step metrics)."""

    async def generate(
        self,
        prompt_tokens: list[int],
        sampling: SamplingParams,
        seed: int,
        key: Key | None = None,
        continued: bool = False,
        adapter: str | None = None,
        watch: TokenWatch | None = None,
    ) -> GenerationOutput:
        """Generate a completion of ``prompt_tokens``; resolves when it stops.

        Tokens are sampled with the request's own RNG (``seed``); each comes with its logprob
        under the tempered policy and the policy version that produced it. Raises
        ``InvalidInferenceRequest`` for a request that cannot be served and ``EngineError`` once
        the engine failed or was closed. ``continued`` (keyed requests): another turn of the
        rollout may follow under ``key``; the deterministic schedule waits for it.
        ``adapter``: a named LoRA adapter set to generate with (unkeyed requests). ``watch``:
        sees each token as it is recorded and may end the request (``TokenWatch``).
        """
        ...

    def end_rollout(self, key: Key) -> bool:
        """Rollout ``key`` sends no further turn; True if the engine was waiting for one."""
        ...

    async def score(
        self, tokens: list[int], top_logprobs: int = 0, adapter: str | None = None
    ) -> ScoreOutput:
        """The logprob of each token of ``tokens`` after the first under the current policy (a
        plain forward, run at the next engine step of an open window); raises
        ``InvalidInferenceRequest`` for a sequence that does not fit."""
        ...

    def start(self) -> None:
        """Start the engine's loop task (suspended until ``resume``)."""
        ...

    async def aclose(self) -> None:
        """Stop the loop; pending and later requests fail with ``EngineError``."""
        ...

    def suspend(self) -> None:
        """End the generation window: no step runs until ``resume`` (weights may change)."""
        ...

    def holds_requests(self) -> bool:
        """Whether a request is queued or in flight (else no KV-cache slot holds anything)."""
        ...

    def resume(self) -> None:
        """Open a generation window."""
        ...


@runtime_checkable
class RowRunner(Protocol):
    """Executes one engine step of a data-parallel replica on this rank (collective in its TP/PP
    group): every rank of the replica gets the same rows and returns the same results."""

    def run(self, rows: list[RowWork]) -> list[RowResult]:
        """Feed ``rows`` and sample one token for each row that produced one, in row order."""
        ...

    def end_window(self, idle: bool = False) -> None:
        """The generation window closed on this rank (the weights are about to change);
        ``idle``: no request holds a slot, so the runner may release its KV memory."""
        ...

    def score(self, jobs: list[ScoreWork]) -> list[ScoreOutput]:
        """A plain forward of each job's tokens (collective like ``run``), in job order."""
        ...


@runtime_checkable
class SlotSnapshotRunner(Protocol):
    """A ``RowRunner`` whose KV cache slots can be saved and restored bitwise (the CPU tier's), so
    that a checkpoint keeps the requests in flight instead of finishing them first."""

    def export_slots(self, positions: dict[int, int]) -> dict:
        """slot -> its cache contents at positions ``0 .. positions[slot] - 1``."""
        ...

    def import_slots(self, saved: dict) -> None:
        """Write ``export_slots``'s result back into this runner's cache."""
        ...
