"""Trained tokens/s of a GRPO train step with and without sequence packing, on a mixed-length batch.

    python tools/packing_throughput.py [--seq-length 256 --rollouts 64 --micro-batch-size 32]

The batch is ``--rollouts`` synthetic rollouts (one group per ``--group-size``) whose lengths are
spread uniformly over [``--min-length``, ``--seq-length``]: prompt tokens then generated tokens,
random ids, random rewards. The same batch is trained with ``CPUPolicy.train`` unpacked (each
micro-batch right-padded to its longest rollout) and packed (``--rl-use-sequence-packing``: rows of
``--seq-length`` tokens, block-diagonal causal mask), alternating, from the same initial weights;
reported is the median over ``--repeats`` of real (non-padding) tokens per second of the step, and
the packed/unpacked ratio. Model flags are those of ``pretrain_grpo.py`` (default: the tiny model).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the test helpers: grpo_testing

from grpo_testing.batches import build_train_batch  # noqa: E402

from megatron.rl.grpo.batch import TrainBatch  # noqa: E402
from megatron.rl.tokenizer import CharTokenizer  # noqa: E402
from megatron.rl.wire import RolloutGroup, TokenRollout  # noqa: E402
from megatron.trainer import config  # noqa: E402
from megatron.trainer.checkpoint.directory import TrainState  # noqa: E402
from megatron.trainer.config import model_build, optimizer_settings  # noqa: E402
from megatron.trainer.flags.parse import check  # noqa: E402
from megatron.trainer.model.provider import build_model  # noqa: E402
from megatron.trainer.runtime.initialize import initialize_distributed  # noqa: E402
from megatron.trainer.tiers.cpu import CPUPolicy  # noqa: E402
from megatron.trainer.train.losses import GRPOLoss  # noqa: E402
from megatron.trainer.train.optimizer import build_optimizer  # noqa: E402
from megatron.trainer.train.policy import PolicyConfig  # noqa: E402


def mixed_length_batch(
    rollouts: int, group_size: int, min_length: int, max_length: int, vocab: int, seed: int
) -> TrainBatch:
    """``rollouts`` trajectories with lengths uniform in [min_length, max_length]."""
    rng = random.Random(seed)
    groups = []
    for g in range(rollouts // group_size):
        members = []
        for _ in range(group_size):
            n = rng.randint(min_length, max_length)
            prompt = rng.randint(1, max(1, n // 4))
            tokens = [rng.randrange(2, vocab) for _ in range(n)]
            members.append(
                TokenRollout(
                    env_id="bench",
                    problem_id=str(g),
                    prompt="",
                    completion="",
                    reward=rng.random(),
                    tokens=tokens,
                    generation_mask=[False] * prompt + [True] * (n - prompt),
                    logprobs=[-rng.uniform(0.5, 3.0) for _ in range(n - prompt)],
                    policy_versions=[0] * (n - prompt),
                    submission_policy_version=0,
                    temperature=1.0,
                )
            )
        groups.append(RolloutGroup(batch_id=0, index_in_batch=g, rollouts=members))
    return build_train_batch(groups, pad_id=0)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, build the model and the batch, time both layouts, print the result."""
    tool = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tool.add_argument("--rollouts", type=int, default=64)
    tool.add_argument("--group-size", type=int, default=8)
    tool.add_argument("--min-length", type=int, default=8)
    tool.add_argument("--repeats", type=int, default=7)
    known, rest = tool.parse_known_args(argv)
    cfg, problems = check(["--lr-warmup-iters", "0", *rest], cuda=torch.cuda.is_available())
    if cfg is None:
        raise SystemExit("\n".join(problems))
    ctx = initialize_distributed(cfg)
    vocab = CharTokenizer().vocab_size
    seq_length, seed = cfg.model.seq_length, cfg.training.seed
    batch = mixed_length_batch(
        known.rollouts, known.group_size, known.min_length, seq_length, vocab, seed
    )
    layouts = {"unpacked": None, "packed": seq_length}
    states = {}
    for name in layouts:
        torch.manual_seed(seed)
        model = build_model(model_build(cfg), vocab, ctx.device)
        states[name] = TrainState(model, *build_optimizer(model, optimizer_settings(cfg)))
    rates: dict[str, list[float]] = {name: [] for name in layouts}
    losses: dict[str, float] = {}
    for _ in range(known.repeats + 1):  # the first round warms up
        for name, capacity in layouts.items():
            step = dataclasses.replace(config.step_config(cfg, vocab), packing_capacity=capacity)
            policy = CPUPolicy(states[name], PolicyConfig.of(step), ctx)
            (result,) = policy.train(batch, GRPOLoss(step))
            rates[name].append(result.trained_tokens / result.seconds)
            losses.setdefault(name, result.loss)
    lengths, arch = batch.lengths.tolist(), cfg.architecture_flags
    print(
        f"batch: {len(lengths)} rollouts, lengths {min(lengths)}..{max(lengths)} "
        f"(mean {statistics.fmean(lengths):.1f}), seq-length {seq_length}, micro-batch "
        f"{cfg.training.micro_batch_size}, model {arch['num_layers']}x{arch['hidden_size']}, "
        f"threads {torch.get_num_threads()}"
    )
    median = {name: statistics.median(r[1:]) for name, r in rates.items()}
    for name in layouts:
        rate, loss = median[name], losses[name]
        print(f"{name:>9}: {rate:10.0f} trained tokens/s (first-step loss {loss:+.6e})")
    print(f"gain: {median['packed'] / median['unpacked']:.2f}x")


if __name__ == "__main__":
    main()
