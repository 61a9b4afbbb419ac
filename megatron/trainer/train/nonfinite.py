"""``--check-for-nan-in-loss-and-grad``: an update whose loss or gradient is NaN or infinite is
never applied; the run stops with one message naming the step, the rank and the micro-batch.

Both policies keep a ``LossCheck`` per update: each micro-batch's loss sum is recorded as it is
computed (no synchronization), and ``LossCheck.verify`` runs once the gradients are reduced and
their global norm is known, before the LR schedule and the optimizer step:

* every rank's micro-batch losses are tested at once (one ``isfinite`` over the stacked sums);
* the global gradient norm, which the step computes anyway (the CPU tier's ``clip_grad_norm``),
  is the gradient check: one reduction per step, the same value on every rank;
* one scalar all-reduce makes every rank take the same decision (a non-finite loss need not make
  every rank's gradients non-finite), and only when something is wrong do the ranks gather what
  each found, so that every rank raises ``NonFiniteUpdate`` with the same message.

A non-finite gradient whose every loss is finite (an overflow in a backward pass) cannot be
attributed to a rank once the gradients are summed over data parallelism; the message says so.
On the CUDA tier megatron-core's own check (``DistributedDataParallelConfig.check_for_nan_in_grad``,
set by the same flag) tests each rank's gradients before that sum and raises on the rank that
found one, without the other ranks; ``LossCheck.megatron_core_error`` gives that failure this
module's message, and the launcher stops the other ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.trainer.errors import NonFiniteUpdate

FLAG = "--check-for-nan-in-loss-and-grad"


@dataclass
class LossCheck:
    """One update's micro-batch losses on this rank, and the decision every rank shares."""

    enabled: bool
    """``--check-for-nan-in-loss-and-grad``; a disabled check records and verifies nothing."""
    rank: int
    """This rank's global rank, named in the message."""
    losses: list[torch.Tensor] = field(default_factory=list)

    def record(self, loss_sum: torch.Tensor) -> None:
        """The loss sum of this rank's next micro-batch (kept on its device)."""
        if self.enabled:
            self.losses.append(loss_sum.detach().reshape(()))

    def local_problem(self) -> str | None:
        """This rank's non-finite losses (``the loss of micro-batch 1 (of 2) is nan``), or None
        (one synchronization)."""
        if not self.losses:
            return None
        finite = torch.isfinite(torch.stack(self.losses).float())
        if bool(finite.all()):
            return None
        bad = [i for i, ok in enumerate(finite.tolist()) if not ok]
        values = ", ".join(f"{float(self.losses[i]):g}" for i in bad)
        which = "micro-batch" if len(bad) == 1 else "micro-batches"
        return f"the loss of {which} {', '.join(map(str, bad))} (of {len(self.losses)}) is {values}"

    def verify(self, grad_norm: float | None, device: torch.device) -> None:
        """Raise ``NonFiniteUpdate`` on every rank when any rank's loss or ``grad_norm`` (the
        global one, None if not computed) is not finite (collective when distributed)."""
        if not self.enabled:
            return
        local = self.local_problem()
        norm_bad = grad_norm is not None and not math.isfinite(grad_norm)
        if not any_rank(local is not None or norm_bad, device):
            return
        mine = None if local is None else f"rank {self.rank}: {local}"
        problems = [p for p in gather_all(mine) if p is not None]
        if norm_bad:
            problems.append(f"the global gradient norm is {grad_norm:g}")
            if len(problems) == 1:
                problems.append(
                    "every micro-batch's loss is finite (which rank's gradients overflowed "
                    "cannot be told after their data-parallel sum)"
                )
        raise NonFiniteUpdate(f"the update was not applied ({FLAG}): " + "; ".join(problems))

    def megatron_core_error(self, exc: BaseException) -> NonFiniteUpdate | None:
        """``exc`` as a ``NonFiniteUpdate`` of this rank when it is megatron-core's
        ``check_for_nan_in_grad`` failure (raised on this rank alone, before the gradients'
        data-parallel reduction), else None."""
        text = str(exc)
        found = "found NaN in local grad norm" in text or "found Inf in local grad norm" in text
        if not (isinstance(exc, RuntimeError) and found):
            return None
        local = self.local_problem()
        return NonFiniteUpdate(
            f"the update was not applied ({FLAG}): rank {self.rank}: "
            + (f"{local}; " if local else "")
            + f"megatron-core found a non-finite gradient before the data-parallel reduction "
            f"({text})"
        )


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank (one scalar all-reduce when distributed)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_all(value: str | None) -> list[str | None]:
    """Every rank's ``value``, in rank order (collective when distributed)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    values: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
