"""``InferenceCopy``: the model a collocated refit generates with (``--rl-inference-tensor-model-
parallel-size``), on its own layout, refit from the trained model after every optimizer step."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from megatron.rl.refit.collocated import CollocatedRefit
from megatron.rl.refit.layout import InferenceLayout, inference_layout
from megatron.rl.refit.stages import StageRefit
from megatron.trainer.errors import RefitMismatch
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
        verify: bool = False,
    ) -> None:
        stages = parallel_state.get_pipeline_model_parallel_world_size() > 1
        self.layout: InferenceLayout = inference_layout(tp_size, tier.config.model.moe or stages)
        self.model = tier.build_inference_copy(vocab_size, self.layout)
        # the GPTs inside the wrappers (CUDA: DDP and Float16Module), so the names match
        source, target = unwrap_model(trained), unwrap_model(self.model)
        gated = bool(getattr(source.config, "gated_linear_unit", False))
        groups = ctx.tp_group, self.layout.tp_group
        self.refit: CollocatedRefit | StageRefit
        if stages:  # every stage's weights into each rank's whole copy
            pp_group = parallel_state.get_pipeline_model_parallel_group()
            self.refit = StageRefit(source, target, *groups, gated, pp_group)
        else:
            self.refit = CollocatedRefit(source, target, *groups, gated)
        self.verify = verify
        """``--rl-verify-model-weights-swap``: check every refit."""
        self.refit()  # the weights the run starts (or resumes) with
        self._check(version=None)

    def _check(self, version: int | None) -> None:
        """Raise ``RefitMismatch`` (on every rank) if ``verify`` and the copy differs."""
        if not self.verify:
            return
        names = self.refit.mismatches()
        if names:
            when = "at the start" if version is None else f"for policy version {version}"
            raise RefitMismatch(
                f"--rl-verify-model-weights-swap: after the refit {when}, the inference copy "
                f"differs from the trained weights in {', '.join(names)}"
            )

    def refit_metrics(self, version: int) -> dict[str, float]:
        """Refit the copy from the trained weights of policy ``version`` (checked with
        ``verify``); the step record's ``refit/*`` metrics, this rank's: the seconds, the bytes
        received from the other training TP ranks, the bytes written into the copy, and the
        share of its elements whose bfloat16 value did not change."""
        stats = self.refit()
        self._check(version)
        return {
            "refit/seconds": stats.seconds,
            "refit/bytes_received": float(stats.bytes_received),
            "refit/bytes_written": float(stats.bytes_written),
            "refit/unchanged_bf16_share": stats.unchanged_bf16,
        }
