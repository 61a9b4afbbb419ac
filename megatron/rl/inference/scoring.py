"""Scoring a sequence: the logprob of each of its tokens given those before it, from a plain
forward of the model (no KV cache, nothing sampled).

Both backends' runners score with ``ScoringForward``: the trained model object, its
vocab-parallel logits gathered over the tensor-parallel group, the padded vocabulary masked, and
the log-softmax at temperature 1 (the distribution a greedy row's logprob is from). The values
are computed exactly as ``sampling.sample_with_alternatives`` computes a generated token's, so
where the forward agrees with the engine's (the CPU tier's cached forward reproduces the model),
a scored token's logprob equals the one the engine reported when it generated it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from megatron.rl.inference.protocol import ScoreOutput, ScoreWork
from megatron.rl.inference.sampling import top_alternatives
from megatron.rl.lora.model import selected_adapters


class ScoringForward:
    """Scores ``ScoreWork`` on this rank's model shard (collective over ``tp_group``: every rank
    of a replica runs the same jobs in the same order)."""

    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int,
        device: torch.device,
        tp_group: dist.ProcessGroup | None = None,
        precision: Callable[[], AbstractContextManager] | None = None,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.device = device
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.precision = precision
        """The forward's precision context (the CPU tier's autocast; None: the model's dtype)."""

    @torch.no_grad()
    def __call__(self, jobs: list[ScoreWork]) -> list[ScoreOutput]:
        """One forward per job, in job order (a job's values never depend on the others)."""
        return [self._score(job) for job in jobs]

    def _score(self, job: ScoreWork) -> ScoreOutput:
        ids = torch.tensor([job.tokens], device=self.device)  # (1, T)
        positions = torch.arange(len(job.tokens), device=self.device)[None, :]  # (1, T)
        with selected_adapters(self.model, job.adapter):
            if self.precision is None:
                logits = self.model(ids, positions, None)  # (1, T, V/tp)
            else:
                with self.precision():
                    logits = self.model(ids, positions, None)
        logits = self._gather_vocab(logits[0, :-1].float())  # (T-1, V_padded)
        logprobs = torch.log_softmax(logits, dim=-1)  # (T-1, V_padded)
        targets = ids[0, 1:, None].to(logprobs.device)  # (T-1, 1)
        chosen = logprobs.gather(-1, targets).squeeze(-1)  # (T-1,)
        top_ids, top_values = top_alternatives(logprobs, job.top_logprobs)  # (T-1, n)
        tops = [
            tuple(zip(row_ids, row_values))
            for row_ids, row_values in zip(top_ids.tolist(), top_values.tolist())
        ]
        return ScoreOutput(logprobs=chosen.tolist(), top_logprobs=tops)

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(T, V/tp) vocab-parallel logits -> (T, V_padded) on the CPU, padding ids -inf."""
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        logits = logits.cpu()
        logits[:, self.vocab_size :] = float("-inf")
        return logits
