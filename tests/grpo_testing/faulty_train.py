"""``pretrain_grpo.py`` with one injected fault, for the tests of how a failing run ends.

    python -m megatron.trainer.launch --nproc-per-node 2 tests/grpo_testing/faulty_train.py \\
        --hang-rank 1 --hang-at-step 2 [flags of pretrain_grpo.py]
    ... tests/grpo_testing/faulty_train.py --inf-logits-rank 1 --inf-logits-at-step 1 \\
        --inf-logits-micro-batch 1 [flags]

* ``--hang-rank R --hang-at-step N``: rank R sleeps forever instead of entering step N's
  gradient all-reduce, where the other ranks of its data-parallel group wait for it.
* ``--inf-logits-rank R --inf-logits-at-step N --inf-logits-micro-batch M``: on rank R, the
  model's logits of the first row of micro-batch M of step N's update are all +inf (an overflow),
  so that row's logprobs, and the micro-batch's loss, are NaN.

Everything else is ``pretrain_grpo.py`` (same flags, same ending through ``exits.run_main``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import megatron.trainer.grpo as grpo  # noqa: E402
import megatron.trainer.tiers.cpu as cpu_tier  # noqa: E402
from megatron.trainer.flags.parse import parse_args  # noqa: E402
from megatron.trainer.runtime.exits import run_main  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def fault_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest (``pretrain_grpo.py``'s flags)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--hang-rank", type=int, default=None)
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--inf-logits-rank", type=int, default=None)
    p.add_argument("--inf-logits-at-step", type=int, default=None)
    p.add_argument("--inf-logits-micro-batch", type=int, default=0)
    return p.parse_known_args(argv)


def hang_at(step: int) -> None:
    """Instead of entering step ``step``'s gradient all-reduce, this rank sleeps forever (its
    data-parallel peers wait in that collective)."""
    train_step, allreduce = grpo.Run.train_step, cpu_tier.allreduce_gradients
    where = {"step": -1}

    def counting(run, collection, iteration):
        where["step"] = iteration
        return train_step(run, collection, iteration)

    def hanging(params, group):
        while where["step"] == step:
            time.sleep(3600)
        allreduce(params, group)

    grpo.Run.train_step = counting
    cpu_tier.allreduce_gradients = hanging


def inf_logits_at(step: int, micro_batch: int) -> None:
    """The model's first logits row of ``micro_batch`` of ``step``'s update is +inf."""
    train_step, build_model = grpo.Run.train_step, cpu_tier.CPUTier.build_model
    where = {"step": -1, "forwards": 0}

    def counting(run, collection, iteration):
        where.update(step=iteration, forwards=0)
        return train_step(run, collection, iteration)

    def poison(module, inputs, logits):
        if not module.training or where["step"] != step:  # training forwards of the step only
            return logits
        where["forwards"] += 1
        if where["forwards"] - 1 != micro_batch:
            return logits
        logits = logits.clone()
        logits[0] = torch.inf
        return logits

    def build_and_hook(tier, vocab_size, load=None):
        model = build_model(tier, vocab_size, load)
        model.register_forward_hook(poison)
        return model

    grpo.Run.train_step = counting
    cpu_tier.CPUTier.build_model = build_and_hook


def main() -> None:
    """Inject the fault asked for on this rank, then train as ``pretrain_grpo.py`` does."""
    faults, rest = fault_options(sys.argv[1:])
    if faults.hang_rank == RANK:
        hang_at(faults.hang_at_step)
    if faults.inf_logits_rank == RANK:
        inf_logits_at(faults.inf_logits_at_step, faults.inf_logits_micro_batch)
    grpo.train(parse_args(rest))


if __name__ == "__main__":
    run_main(main)
