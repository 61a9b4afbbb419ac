"""Every ``Policy`` method on the CUDA tier (emulated on the CPU) and on the CPU tier.

    python -m torch.distributed.run --nproc-per-node=N tests/grpo_testing/emulated_cuda_policy.py \\
        --out DIR [--tp T] [--pp P] [--case [packing=CAPACITY] [variant=gspo|cispo]] ...

Each rank builds both tiers' policies from the same seed (each with its reference model, a copy
of the initial weights), runs the same calls on both: ``train`` in eval mode (NLL, and GRPO
against pi_old from ``get_logprobs``) and with a supervised NLL loss (two global batches),
``get_logprobs``, ``get_reference_policy_logprobs``,
``get_topk_logits`` and a GRPO update with the reference KL and entropy terms, and saves both
tiers' results to ``DIR/rank<r>.pt`` (``--pp`` > 1: the CUDA tier's only). One process per rank:
the emulation patches torch globally.

Each ``--case`` (default: one, unpacked, the default loss) builds fresh policies from the same
seed in the same processes (one start-up for several cases of a layout); ``rank<r>.pt`` holds one
``{tier: results}`` per case, in order.

``variant=`` runs the GRPO updates with policy-loss variants on top of the terms:
``gspo`` is GSPO with ``seq-mean-token-mean`` and sequence-level masked IS (``sequence_mask``),
``cispo`` is CISPO with off-policy sequence masking.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from grpo_testing.emulated_cuda import emulate_cuda_on_cpu  # noqa: E402

emulate_cuda_on_cpu()

from grpo_testing.batches import build_train_batch  # noqa: E402
from grpo_testing.models import VOCAB  # noqa: E402
from grpo_testing.rollouts import synthetic_groups  # noqa: E402
from grpo_testing.trainer import grpo_update, train_args  # noqa: E402

from megatron.rl.grpo.aggregation import LossAggregation  # noqa: E402
from megatron.rl.grpo.importance import ImportanceConfig  # noqa: E402
from megatron.rl.grpo.loss import GRPOLossConfig  # noqa: E402
from megatron.rl.grpo.off_policy_mask import OffPolicyMask  # noqa: E402
from megatron.rl.grpo.terms.entropy_bonus import EntropyBonus  # noqa: E402
from megatron.rl.grpo.terms.reference_kl import ReferenceKL  # noqa: E402
from megatron.trainer.checkpoint.directory import TrainState  # noqa: E402
from megatron.trainer.config import tier_config  # noqa: E402
from megatron.trainer.runtime.initialize import initialize_distributed  # noqa: E402
from megatron.trainer.tiers.cpu import CPUTier  # noqa: E402
from megatron.trainer.tiers.cuda import CUDATier  # noqa: E402
from megatron.trainer.tiers.reference import build_reference_model  # noqa: E402
from megatron.trainer.train.losses import GRPOLoss, TokenMeanNLL  # noqa: E402
from megatron.trainer.train.policy import PolicyConfig  # noqa: E402
from megatron.trainer.train.step import MicroBatchCache, StepConfig  # noqa: E402

K = 5

VARIANTS = {
    None: ({}, None),
    "gspo": (
        dict(
            clamp_eps_lower=3e-4,
            clamp_eps_upper=4e-4,
            policy_loss="gspo",
            aggregation=LossAggregation("seq-mean-token-mean", None),
        ),
        ImportanceConfig(3.0, "sequence_mask", 0.05),
    ),
    "cispo": (dict(policy_loss="cispo", off_policy_mask=OffPolicyMask(0.05)), None),
}
"""``variant=`` -> (``GRPOLossConfig`` fields, ``StepConfig.importance``)."""


def run_policy(tier_class, cfg, ctx, packing: int | None, variant: str | None = None) -> dict:
    """The results of every method on ``tier_class``'s policy."""
    tier = tier_class(tier_config(cfg), ctx)
    torch.manual_seed(7)
    model = tier.build_model(VOCAB)
    reference = build_reference_model(tier, model, VOCAB, needs_reference=True)
    state = TrainState(model, *tier.build_optimizer(model))
    fields, importance = VARIANTS[variant]
    loss = GRPOLossConfig(
        **{"clamp_eps_lower": 0.2, "clamp_eps_upper": 0.28, **fields},
        terms=(ReferenceKL(0.1), EntropyBonus(0.01)),
    )
    config = StepConfig(
        loss,
        VOCAB,
        2,
        clip_grad=0.5,
        old_logprobs=True,
        packing_capacity=packing,
        importance=importance,
    )
    policy = tier.build_policy(state, PolicyConfig.of(config), reference)
    data = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), pad_id=0)
    (evaluated,) = policy.train(data, TokenMeanNLL(), eval_mode=True)
    logprobs = policy.get_logprobs(data)  # the same forward as the evaluation's
    upfront_loss = GRPOLoss(config, logprobs, policy.get_reference_policy_logprobs(data))
    (upfront,) = policy.train(data, upfront_loss, eval_mode=True)
    trained = policy.train(data, TokenMeanNLL(), gbs=4, mbs=2)
    top = policy.get_topk_logits(data, K)
    # the variants' two updates share pi_old (as --grpo-iterations 2 does): the second one's
    # ratios differ from 1
    caches = None if variant is None else [MicroBatchCache() for _ in range(4 // ctx.dp_size)]
    grpo = [grpo_update(policy, data, config, caches) for _ in range(2)]
    return {
        "nll": [evaluated.loss] + [r.loss for r in trained],
        "nll_of_logprobs": float(-(logprobs * data.loss_mask).sum() / data.loss_mask.sum()),
        "upfront_ratio_mean": upfront.metrics["ratio_mean"],
        "grad_norm": [r.grad_norm for r in trained] + [r.grad_norm for r in grpo],
        "lr": [r.lr for r in trained] + [r.lr for r in grpo],
        "logprobs": policy.get_logprobs(data),
        "ref_logprobs": policy.get_reference_policy_logprobs(data, micro_batch_size=4),
        "topk_values": top.values,
        "topk_indices": top.indices,
        "grpo_loss": [r.loss for r in grpo],
        "grpo_metrics": [r.metrics for r in grpo],
        "valid": torch.arange(data.input_ids.shape[1])[None] < data.lengths[:, None],
    }


def parse_case(fields: list[str]) -> tuple[int | None, str | None]:
    """``[packing=CAPACITY] [variant=NAME]`` -> (packing capacity, variant); None: not given."""
    case: dict[str, str] = {}
    for field in fields:
        key, _, value = field.partition("=")
        if key not in ("packing", "variant") or not value or key in case:
            raise SystemExit(f"--case: expected packing=CAPACITY or variant=NAME, got {field!r}")
        case[key] = value
    variant = case.get("variant")
    if variant not in VARIANTS:
        raise SystemExit(f"--case: variant={variant} is not one of gspo, cispo")
    packing = case.get("packing")
    if packing is not None and not packing.isdigit():
        raise SystemExit(f"--case: packing={packing} is not a positive integer")
    return (int(packing) if packing is not None else None), variant


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1, help="> 1: the CUDA tier only")
    parser.add_argument(
        "--case",
        nargs="*",
        action="append",
        default=None,
        metavar="FIELD",
        help="one run: packing=CAPACITY and/or variant=gspo|cispo (repeatable)",
    )
    opts = parser.parse_args()
    cases = [parse_case(fields) for fields in opts.case or [[]]]
    cfg = train_args(  # the KL term's weight is the StepConfig's (ReferenceKL(0.1))
        tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp, ref_load=None
    )
    torch.cuda.is_available = lambda: False  # gloo and the CPU as the context's device
    ctx = initialize_distributed(cfg)
    torch.cuda.is_available = lambda: True
    results = []
    for packing, variant in cases:
        tiers = {"cuda": run_policy(CUDATier, cfg, ctx, packing, variant)}
        if opts.pp == 1:  # the CPU tier has no pipeline stages
            tiers["cpu"] = run_policy(CPUTier, cfg, ctx, packing, variant)
        results.append(tiers)
    torch.save(results, Path(opts.out) / f"rank{ctx.rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
