"""The interfaces both inference tiers implement, so nothing above them knows which one runs.

Two seams:

* ``InferenceEngine`` is what the rollout generator, ``LocalInferenceInterface`` and the training
  loop's generation windows talk to: ``generate`` with per-token logprobs and policy versions, the
  schedule hints of the forced-lag generator (``expect_group``/``group_done``/``await_batch``, see
  ``megatron.rl.rollout.generator.BatchScheduler``), the lifecycle (``start``/``aclose``) and the
  generation window (``resume``/``suspend``). ``LocalInferenceEngine`` (CPU tier) and
  ``DynamicInferenceEngineAdapter`` (CUDA tier, megatron-core's ``DynamicInferenceEngine``)
  implement it.
* ``RowRunner`` is what a ``StepGroup`` executes on every rank: one engine step of a data-parallel
  replica's rows (``RowWork`` -> ``RowResult``). ``ModelRunner`` (own KV cache) and
  ``DynamicEngineRunner`` (megatron-core's dynamic context and paged KV cache) implement it.

Both protocols are ``runtime_checkable`` so that tests can assert conformance; the check only sees
member names, the conformance tests exercise the behaviour.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from megatron.rl.inference.engine import GenerationOutput
from megatron.rl.inference.model_runner import RowResult, RowWork
from megatron.rl.wire import SamplingParams

Key = tuple[int, int, int]
"""A rollout key: (batch_id, index_in_batch, sample_index)."""

__all__ = ["GenerationOutput", "InferenceEngine", "Key", "RowRunner"]


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates completions on the trainer's own model, stepped only inside generation windows."""

    generated_tokens: int
    """Tokens sampled since start (a counter for throughput metrics)."""

    async def generate(
        self,
        prompt_tokens: list[int],
        sampling: SamplingParams,
        seed: int,
        key: Key | None = None,
    ) -> GenerationOutput:
        """Generate a completion of ``prompt_tokens``; resolves when it stops.

        Tokens are sampled with the request's own RNG (``seed``); each comes with its logprob
        under the tempered policy and the policy version that produced it. Raises
        ``InvalidInferenceRequest`` for a request that cannot be served and ``EngineError`` once
        the engine failed or was closed.
        """
        ...

    def expect_group(self, batch_id: int, index_in_batch: int, num_requests: int) -> None:
        """Group (batch, index) is about to send ``num_requests`` keyed requests."""
        ...

    def group_done(self, batch_id: int, index_in_batch: int) -> None:
        """Group (batch, index) will send nothing more that it announced."""
        ...

    def await_batch(self, batch_id: int | None) -> None:
        """The trainer waits for ``batch_id``; keyed work steps only while it is unfinished."""
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

    def resume(self) -> None:
        """Open a generation window."""
        ...

    @property
    def num_active(self) -> int:
        """Requests being decoded."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests queued for capacity."""
        ...


@runtime_checkable
class RowRunner(Protocol):
    """Executes one engine step of a data-parallel replica on this rank (collective in its TP/PP
    group): every rank of the replica gets the same rows and returns the same results."""

    def run(self, rows: list[RowWork]) -> list[RowResult]:
        """Feed ``rows`` and sample one token for each row that produced one, in row order."""
        ...
