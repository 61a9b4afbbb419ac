"""A distillation teacher behind an HTTP server (``--distill-teacher URL``).

The teacher scores each trained rollout through ``POST URL/v1/completions`` with ``echo``,
``logprobs`` 0 and ``max_tokens`` 0 (``RemoteInferenceInterface.score``): the log-probability of
every token given those before it, from any server that answers that way with the prompt's token
ids (``prompt_token_ids``: ours, ``python -m megatron.trainer.serve``). The rollout is sent as
token ids, so the server's model must use the policy's tokenizer; its answer must echo exactly
those ids, or the run stops with a message naming the server.

* **Which rows.** Each rank scores the rows it trains (its data-parallel shard of the batch) and
  the whole batch is gathered over data parallelism, as the forward-only methods return it; the
  ranks of one model-parallel group send the same requests.
* **Deterministic.** The rows are scored one request at a time, in order: a server that batches
  concurrent requests would otherwise score a row in a batch whose composition depends on
  arrival times. Each answer then depends on the row alone, so reruns and a resumed run get the
  same logprobs (as long as the server's model does not change).
* **Not available remotely**: the teacher's argmax and top-k (an OpenAI answer names the
  alternatives by their text, not their ids), so ``distill/argmax_mismatch`` is not reported and
  ``--distill-topk-logits-k`` is refused (``flags/distill.py``).
* **Failures** end the run with the server named: a refused connection or a 5xx after the
  retries, an answer that is not a scoring, a read that outlasts the timeout (never a hang).
"""

from __future__ import annotations

import asyncio

import httpx
import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.http_client import ClientPool, RetryPolicy
from megatron.rl.inference.remote import RemoteInferenceInterface
from megatron.rl.wire import ScoreRequest
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.cache import TeacherLogprobs
from megatron.trainer.train.forward import gather_data_parallel
from megatron.trainer.train.step import data_parallel_rows

FLAG = "--distill-teacher"
READ_TIMEOUT_S = 600.0
"""Longest wait for one scoring (a long rollout on a busy server), then the run stops."""


class RemoteTeacher:
    """The teacher's logprobs of a batch's targets from the server at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        ctx: ParallelContext,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.ctx = ctx
        self.retry = retry
        """Retries of a refused connection or a 5xx answer, then the run stops."""

    def get_teacher_logprobs(
        self, data: TrainBatch, micro_batch_size: int | None = None, topk: int | None = None
    ) -> TeacherLogprobs:
        """(B, T) log pi_teacher(target) of ``data`` at temperature 1 (0 past each row's length;
        this rank's rows when ``data`` is its shard); no argmax (``TeacherLogprobs.argmax`` is
        None). ``micro_batch_size`` is not used: one request per row."""
        if topk is not None:
            raise ValueError(f"{FLAG} {self.base_url}: a remote teacher has no top-k")
        (rows,) = data_parallel_rows(data.num_rows, self.ctx, data.num_rows, data.is_shard)
        sequences = [_tokens(data, b) for b in range(rows.start, rows.stop)]
        scored = asyncio.run(self._score([s for s in sequences if len(s) > 1]))
        local = torch.zeros((len(sequences), data.input_ids.shape[1]), dtype=torch.float32)
        answers = iter(scored)
        for i, tokens in enumerate(sequences):
            if len(tokens) > 1:  # an empty row has nothing to score
                local[i, : len(tokens) - 1] = torch.tensor(next(answers), dtype=torch.float32)
        logprobs = local if data.is_shard else gather_data_parallel(local, self.ctx)
        return TeacherLogprobs(logprobs, None)

    async def _score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's logprobs of its tokens after the first, one request at a time."""
        timeout = httpx.Timeout(30.0, read=READ_TIMEOUT_S)
        pool = ClientPool(1, timeout)
        interface = RemoteInferenceInterface(
            self.base_url, pool, self.retry, keep_rollout_keys=False, api_key=self.api_key
        )
        try:
            scored = []
            for tokens in sequences:
                try:
                    answer = await interface.score(ScoreRequest(prompt_tokens=tokens))
                except Exception as exc:  # InferenceUnavailable, InvalidInferenceRequest, ...
                    raise RuntimeError(f"{FLAG} {self.base_url}: scoring failed: {exc}") from None
                if answer.prompt_tokens != tokens or len(answer.logprobs) != len(tokens) - 1:
                    raise ValueError(
                        f"{FLAG} {self.base_url}: the server scored other tokens than it was sent "
                        f"({len(answer.prompt_tokens)} echoed and {len(answer.logprobs)} scored "
                        f"for {len(tokens)} sent): is its tokenizer the policy's?"
                    )
                scored.append(answer.logprobs)
            return scored
        finally:
            await pool.aclose()


def _tokens(data: TrainBatch, row: int) -> list[int]:
    """Row ``row``'s whole sequence: its inputs and its last target (S = T + 1 tokens)."""
    n = int(data.lengths[row])
    if n == 0:
        return []
    return [*data.input_ids[row, :n].tolist(), int(data.target_ids[row, n - 1])]
