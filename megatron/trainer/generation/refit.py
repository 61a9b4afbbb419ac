"""``InferenceCopy``: the model a collocated refit generates with (``--rl-inference-tensor-model-
parallel-size``), on its own layout, refit from the trained model after every optimizer step."""

from __future__ import annotations

import torch

from megatron.rl.refit.collocated import CollocatedRefit
from megatron.rl.refit.layout import InferenceLayout, inference_layout
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.tiers.base import Tier


class InferenceCopy:
    """This rank's shard of the inference copy, its layout and its refit (built on every rank at
    the same point: the layout's groups and every refit are collective)."""

    def __init__(
        self,
        ctx: ParallelContext,
        tier: Tier,
        trained: torch.nn.Module,
        vocab_size: int,
        tp_size: int,
    ) -> None:
        self.layout: InferenceLayout = inference_layout(tp_size)
        self.model = tier.build_inference_copy(vocab_size, self.layout)
        gated = bool(getattr(trained.config, "gated_linear_unit", False))
        self.refit = CollocatedRefit(
            trained, self.model, ctx.tp_group, self.layout.tp_rank, tp_size, gated
        )
        self.refit()  # the weights the run starts (or resumes) with

    def refit_metrics(self) -> dict[str, float]:
        """Refit the copy from the trained weights; the step record's ``refit/*`` metrics (this
        rank's: the seconds, the bytes received from the other training TP ranks and the bytes
        written into the copy)."""
        stats = self.refit()
        return {
            "refit/seconds": stats.seconds,
            "refit/bytes_received": float(stats.bytes_received),
            "refit/bytes_written": float(stats.bytes_written),
        }
