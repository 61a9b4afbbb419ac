"""Golden-value regression cases: run a case's training job, compare its per-step metrics.

A case is a folder ``test_cases/<name>/`` holding ``model_config.yaml``::

    nproc_per_node: 1                             # torchrun processes
    args: {rl-forced-lag: 2, train-iters: 12}     # flags of pretrain_grpo.py
    env_server: |                                 # optional: serve this env config from a real
      - agent_type: digits                        #   uvicorn env server; the trainer reaches it
        env_id: copy                              #   through `remote` agents
    env_config: |                                 # optional: this env config, in process
      - agent_type: digits
    tiny_hf_checkpoint: {family: qwen2, seed: 1}  # optional: train a tiny random Hugging Face
                                                  #   checkpoint (megatron.rl.models.hf.tiny)
                                                  #   made for the run (--hf-checkpoint)
    teacher: {rl-forced-lag: 0, train-iters: 10}  # optional: train a run of these flags with
                                                  #   --save first; its checkpoint is the
                                                  #   run's --distill-teacher
    resume: {save-interval: 10, kill-after-step: 12}   # optional: save every 10 steps, kill -9
                                                  #   the job once step 12 is logged, resume
    requires: [transfer_queue, ray]               # optional: modules the case needs (an extra);
                                                  #   skipped where one is not installed
    tolerances: {loss: {rtol: 1.0e-3}}            # optional overrides of TOLERANCES

and ``golden_values.json``: ``{metric: [value per step]}`` for every metric in ``TOLERANCES``.
A value matches when ``|actual - golden| <= atol + rtol * |golden|``.

    python tests/functional_tests/golden_values.py                          # compare all cases
    python tests/functional_tests/golden_values.py --case lag2              # one case
    python tests/functional_tests/golden_values.py --case lag2 --update-golden   # rewrite
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

import yaml
from launching import (  # re-exported: the tests import them from here
    ROOT,
    checkpoint_of_iteration,
    env_server,
    flag_argv,
    free_port,
    python_command,
    read_metrics,
    remote_env_config,
    run_training,
    run_until_step_then_kill,
    subprocess_env,
    training_command,
)

__all__ = [  # the launching helpers the tests import from here, beside the cases' own names
    "ROOT",
    "checkpoint_of_iteration",
    "env_server",
    "flag_argv",
    "free_port",
    "python_command",
    "read_metrics",
    "remote_env_config",
    "run_training",
    "subprocess_env",
    "training_command",
]

CASES = Path(__file__).parent / "test_cases"

EXACT = {"rtol": 0.0, "atol": 0.0}
TOLERANCES: dict[str, dict[str, float]] = {
    # Float metrics: bitwise on one machine; the margin absorbs other CPUs' kernels. The loss sums
    # near-cancelling advantage-weighted terms, so it also gets an absolute floor.
    "loss": {"rtol": 1e-4, "atol": 1e-6},
    "grad_norm": {"rtol": 1e-4, "atol": 1e-6},
    "lr": {"rtol": 1e-9, "atol": 0.0},
    "reward_mean": {"rtol": 1e-6, "atol": 1e-6},
    "reward_std": {"rtol": 1e-6, "atol": 1e-6},
    "completion_tokens_mean": {"rtol": 1e-9, "atol": 0.0},
    "clip_fraction": {"rtol": 1e-4, "atol": 1e-6},
    "mismatch_kl": {"rtol": 1e-3, "atol": 1e-7},
    # The lag contract and the environment accounting: exact.
    "staleness_min": EXACT,
    "staleness_mean": EXACT,
    "staleness_max": EXACT,
    "token_staleness_min": EXACT,
    "token_staleness_mean": {"rtol": 0.0, "atol": 1e-9},
    "token_staleness_max": EXACT,
    "placeholder_rollouts": EXACT,
}
"""Guarded metrics and their default tolerances (a case may override entries)."""


# ----------------------------------------------------------------------------- cases


def case_names() -> list[str]:
    """Every case folder, sorted."""
    return sorted(p.name for p in CASES.iterdir() if (p / "model_config.yaml").is_file())


def missing_modules(name: str) -> list[str]:
    """The modules case ``name`` requires (``requires:``) that are not installed here."""
    return [m for m in load_case(name).get("requires", []) if importlib.util.find_spec(m) is None]


def load_case(name: str) -> dict:
    """The parsed ``model_config.yaml`` of case ``name``."""
    path = CASES / name / "model_config.yaml"
    if not path.is_file():
        raise SystemExit(f"--case {name}: no {path} (cases: {', '.join(case_names())})")
    return yaml.safe_load(path.read_text())


def tolerances(case: dict) -> dict[str, dict[str, float]]:
    """The case's tolerances: the defaults with its overrides."""
    merged = {k: dict(v) for k, v in TOLERANCES.items()}
    for metric, tol in (case.get("tolerances") or {}).items():
        merged[metric] = {"rtol": 0.0, "atol": 0.0, **tol}
    return merged


def prepare_case(case: dict, workdir: Path, stack: contextlib.ExitStack) -> dict:
    """The flags of ``case`` with what it asks for made in ``workdir`` (a tiny Hugging Face
    checkpoint, an env config, an env server entered into ``stack``, a distillation teacher)."""
    args = dict(case["args"])
    if "tiny_hf_checkpoint" in case:
        from megatron.rl.models.hf.tiny import make_tiny_checkpoint

        tiny = case["tiny_hf_checkpoint"]
        args["hf-checkpoint"] = make_tiny_checkpoint(
            tiny["family"], workdir / "tiny_hf", seed=tiny.get("seed", 0)
        )
    if "env_config" in case:
        args["env-config"] = workdir / "envs.yaml"
        args["env-config"].write_text(case["env_config"])
    if "env_server" in case:
        url, _ = stack.enter_context(env_server(workdir, case["env_server"]))
        entries = yaml.safe_load(case["env_server"])
        env_ids = [e.get("env_id") or f"{e['agent_type']}{i}" for i, e in enumerate(entries)]
        args["env-config"] = remote_env_config(workdir, url, env_ids)
    if "teacher" in case:  # trained here with --save; its checkpoint is the teacher
        teacher = workdir / "teacher"
        run_training(1, {**case["teacher"], "save": teacher})
        args["distill-teacher"] = teacher
    return args


def run_case(name: str) -> list[dict]:
    """Per-step metrics of case ``name`` (for a resume case: logged before the kill up to the
    checkpoint, then the resumed run's)."""
    case = load_case(name)
    nproc = case["nproc_per_node"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        args = prepare_case(case, workdir, stack)
        if "resume" not in case:
            return run_training(nproc, args)
        resume = case["resume"]
        save = {"save": workdir / "ckpt", "save-interval": resume["save-interval"]}
        first = workdir / "before_kill.jsonl"
        run_until_step_then_kill(nproc, {**args, **save}, first, resume["kill-after-step"])
        saved_at = int((workdir / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
        resumed = run_training(nproc, {**args, **save, "load": workdir / "ckpt"})
        return [m for m in read_metrics(first) if m["step"] < saved_at] + resumed


def compare(name: str, metrics: list[dict], golden: dict | None = None) -> list[tuple]:
    """Mismatches ``(step, metric, golden, actual, difference)``; empty when all match.

    ``golden`` defaults to the case's ``golden_values.json``.
    """
    case = load_case(name)
    if golden is None:
        golden = json.loads((CASES / name / "golden_values.json").read_text())
    problems: list[tuple] = []
    for metric, tol in tolerances(case).items():
        want = golden.get(metric)
        if want is None:
            problems.append(("-", metric, "missing", "-", "-"))
            continue
        got = [m.get(metric, math.nan) for m in metrics]
        if len(got) != len(want):
            problems.append(("-", metric, f"{len(want)} steps", f"{len(got)} steps", "-"))
            continue
        for m, g, w in zip(metrics, got, want):
            if not abs(g - w) <= tol["atol"] + tol["rtol"] * abs(w):
                problems.append((m["step"], metric, w, g, g - w))
    return problems


def format_table(problems: list[tuple]) -> str:
    """A readable table of mismatches: step, metric, golden, actual, difference."""
    rows = [("step", "metric", "golden", "actual", "difference")]
    rows += [tuple(f"{v:.10g}" if isinstance(v, float) else str(v) for v in p) for p in problems]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [
        "  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def update(name: str, metrics: list[dict]) -> None:
    """Rewrite the golden values of case ``name`` from ``metrics``."""
    golden = {metric: [m[metric] for m in metrics] for metric in tolerances(load_case(name))}
    (CASES / name / "golden_values.json").write_text(json.dumps(golden, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", help="case name (repeatable; default: all)")
    parser.add_argument(
        "--update-golden", action="store_true", help="rewrite the cases' golden_values.json"
    )
    opts = parser.parse_args()
    failed = False
    for name in opts.case or case_names():
        if missing_modules(name):
            print(f"{name}: skipped (not installed: {', '.join(missing_modules(name))})")
            continue
        metrics = run_case(name)
        if opts.update_golden:
            update(name, metrics)
            print(f"{name}: golden values updated ({len(metrics)} steps)")
            continue
        problems = compare(name, metrics)
        failed |= bool(problems)
        print(f"{name}: " + ("OK" if not problems else "MISMATCH\n" + format_table(problems)))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
