"""The GRPO flags of ``pretrain_grpo.py``: group shape, ratio clipping, the loss terms' weights (one
flag per term, declared by the term), the reference policy and dynamic sampling.

Each flag is declared once, with its help; the cross-field checks are in
``flag_validation.validate_args``.
"""

from __future__ import annotations

import argparse

from megatron.rl.grpo.terms import loss_terms


def add_grpo_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the GRPO flags: group shape, ratio clipping, one weight per loss term, the reference
    policy, passes per collection and dynamic sampling."""
    g = parser.add_argument_group("GRPO")
    g.add_argument("--grpo-prompts-per-step", type=int, default=8, help="Groups per batch.")
    g.add_argument("--grpo-group-size", type=int, default=8, help="Rollouts per prompt (>= 2).")
    g.add_argument(
        "--grpo-clamp-eps-lower",
        type=float,
        default=0.2,
        help="Clip importance ratios below 1 - eps.",
    )
    g.add_argument(
        "--grpo-clamp-eps-upper",
        type=float,
        default=0.28,
        help="Clip importance ratios above 1 + eps.",
    )
    for term in loss_terms():  # one flag per loss term, declared by the term (its weight)
        g.add_argument(term.flag, type=float, default=0.0, help=term.help)
    g.add_argument(
        "--ref-load",
        type=str,
        default=None,
        help="Checkpoint directory (as written by --save) whose model weights are the reference "
        "policy of --grpo-kl-beta; read again on every start, also when resuming.",
    )
    g.add_argument(
        "--grpo-iterations",
        type=int,
        default=1,
        help="Passes over each collection (Megatron-LM's meaning; its default is 2): every "
        "global batch of every pass is a training iteration (an optimizer step; the LR "
        "schedule and the policy version advance), and ratios are taken against the policy "
        "that collected, pi_old, computed before the collection's first update.",
    )
    g.add_argument(
        "--grpo-filter-groups-with-same-reward",
        action="store_true",
        help="Dynamic sampling: train only on groups whose rewards differ. Each batch is "
        "generated as --grpo-max-generation-rounds rounds of --grpo-prompts-per-step groups, "
        "all submitted together (keeping staleness exactly --rl-forced-lag); the first "
        "--grpo-prompts-per-step groups with differing rewards are trained. When fewer "
        "qualify, the batch trains on those (the others masked out of the token-mean loss) and "
        "logs how many were dropped.",
    )
    g.add_argument(
        "--grpo-max-generation-rounds",
        type=int,
        default=1,
        help="Rounds of --grpo-prompts-per-step groups generated per batch for "
        "--grpo-filter-groups-with-same-reward (Megatron-LM regenerates dropped groups without "
        "a bound): all submitted with the batch when --rl-forced-lag > 0; at lag 0 one more "
        "round only while the batch lacks groups whose rewards differ.",
    )
