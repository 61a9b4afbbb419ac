"""A checkpoint does not change the run: stopped at any step and resumed, every metric equals the
run that was never stopped, bitwise.

Checkpoints save the requests in flight as they are (their tokens, logprobs, policy versions and
KV cache, ``megatron/rl/inference/engine_snapshot.py``) instead of finishing them with the current
weights, so a save off the ``--save-interval`` grid (a signal, ``--exit-interval``) changes
nothing the run generates. Each case runs the uninterrupted job without ``--save``, the same job
stopped after a step (SIGTERM at a random step, or ``--exit-interval``), and its resume.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
from golden_values import (
    env_server,
    python_command,
    read_metrics,
    remote_env_config,
    run_training,
    training_command,
)
from sigterm import stop_with_sigterm
from test_clean_endings import run
from test_pretrain_grpo import DETERMINISTIC

LAG2 = {
    "rl-forced-lag": 2,
    "train-iters": 10,
    "lr-warmup-iters": 2,
    "seed": 1234,
    "grpo-prompts-per-step": 4,
    "grpo-group-size": 4,
    "micro-batch-size": 8,
}
"""Small (16 rollouts a step), with two batches in flight at every save."""
UNTIL_SIGNAL = {**LAG2, "train-iters": 1000, "exit-interval": 20}
"""A run that a signal stops: too long to end before it (a signal is seen at the end of a step,
a few tiny steps after it is sent), cut at step 20 by ``--exit-interval`` all the same."""
COMPARED = [
    *DETERMINISTIC,
    "lr",
    "ratio_mean",
    "zero_variance_group_fraction",
    "complete_groups",
    "placeholder_rollouts",
    "in_flight_batches",
    "generated_tokens",
    "engine_steps",
    "engine_rows_per_step",
]
"""Every metric but timings (and the reassembly's queue depth, which depends on when rewards
come back)."""


def assert_same_run(
    resumed: list[dict], uninterrupted: list[dict], in_process: bool = True
) -> None:
    """Every step logged, each equal to the uninterrupted run's in every deterministic metric
    (``in_process``: the queue depth too, which only an in-process environment fixes)."""
    assert [m["step"] for m in resumed] == [m["step"] for m in uninterrupted]
    for metric in COMPARED + ["queue_depth"] * in_process:
        assert [m.get(metric) for m in resumed] == [m.get(metric) for m in uninterrupted], metric


def stopped_then_resumed(args: dict, tmp_path: Path, exit_at: int) -> list[dict]:
    """The metrics of the job ``args`` (one process) stopped by ``--exit-interval exit_at``, which
    saves there off the ``--save-interval`` grid, then resumed from that checkpoint to its end."""
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    stopped = {**args, "save": save, "save-interval": 1000, "metrics-file": metrics}
    proc, _ = run(python_command({**stopped, "exit-interval": exit_at}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(exit_at)
    proc, _ = run(python_command({**stopped, "load": save}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(metrics)


@pytest.fixture(scope="module")
def uninterrupted():
    """The job as launched, never saved, run once per (processes, flags) for the module."""
    cache: dict[tuple, list[dict]] = {}

    def get(nproc: int, args: dict) -> list[dict]:
        key = (nproc, tuple(sorted((k, str(v)) for k, v in args.items())))
        if key not in cache:
            cache[key] = run_training(nproc, args)
        return cache[key]

    return get


@pytest.mark.parametrize(
    "launcher, nproc, status",
    [
        pytest.param(None, 1, 143, id="python"),
        pytest.param("megatron.trainer.launch", 2, 143, id="launcher-dp2"),
        pytest.param("torch.distributed.run", 1, 1, id="plain-torchrun"),
    ],
)
def test_sigterm_at_a_random_step_then_resume_equals_the_uninterrupted_run(
    uninterrupted, tmp_path: Path, launcher: str | None, nproc: int, status: int
) -> None:
    """SIGTERM mid-run (plain python, our launcher with DP=2, torchrun): the step finishes, the
    pipeline is saved as it stands (iteration off the save grid), exit 128 + 15; the resume
    continues the run that was never stopped, bitwise, token staleness included."""
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    args = {**UNTIL_SIGNAL, "save": save, "save-interval": 1000, "metrics-file": metrics}
    launch = (
        (lambda a: python_command(a))
        if launcher is None
        else (lambda a: training_command(nproc, a, launcher=launcher))
    )
    after = random.Random().randrange(2, 6)
    code, seconds, out = stop_with_sigterm(launch(args), metrics, after_steps=after)
    assert code == status  # plain torchrun: its SignalException (the workers exited 143)
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert (
        iteration < 20
        and f"SIGTERM: stopped after step {iteration - 1}, saved iteration {iteration}" in out
    )
    assert not list(save.glob("*.partial"))
    assert sorted(p.name for p in (save / f"iter_{iteration:07d}" / "inflight_kv").iterdir()) == [
        f"rank_{r:05d}.pt" for r in range(nproc)
    ]  # the cache of the two batches in flight, each rank its replica's
    proc, _ = run(launch({**args, "load": save}), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(read_metrics(metrics), uninterrupted(nproc, UNTIL_SIGNAL))
    print(
        f"SIGTERM ({launcher or 'python'}) after {after} steps: saved {iteration}, exit {code} "
        f"{seconds:.1f} s after the signal; resumed run equal to the uninterrupted one"
    )


def test_sigterm_to_the_launchers_process_group_then_resume_is_exact(
    uninterrupted, tmp_path: Path
) -> None:
    """What a terminal's Ctrl-C or a scheduler's kill of the job's process group does: every
    process gets the signal at once."""
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    args = {**UNTIL_SIGNAL, "save": save, "save-interval": 1000, "metrics-file": metrics}
    cmd = training_command(2, args, launcher="megatron.trainer.launch")
    code, _, _ = stop_with_sigterm(cmd, metrics, after_steps=3, process_group=True)
    assert code in (143, -signal.SIGTERM)
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) < 20
    proc, _ = run(training_command(2, {**args, "load": save}, launcher="megatron.trainer.launch"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(read_metrics(metrics), uninterrupted(2, UNTIL_SIGNAL))


@pytest.mark.parametrize(
    "flags, exit_at",
    [
        pytest.param({}, 3, id="lag2"),
        pytest.param(
            {"grpo-filter-groups-with-same-reward": True, "grpo-max-generation-rounds": 2},
            4,
            id="lag2-dynamic-sampling",
        ),
    ],
)
def test_exit_interval_off_the_save_grid_then_resume_is_exact(
    uninterrupted, tmp_path: Path, flags: dict, exit_at: int
) -> None:
    """``--exit-interval`` saves where the ``--save-interval`` grid does not; the resumed run is
    the uninterrupted one (and, at L=2, so is the run that saves after every step)."""
    args = {**LAG2, **flags}
    resumed = stopped_then_resumed(args, tmp_path, exit_at)
    reference = uninterrupted(1, args)
    assert_same_run(resumed, reference)
    if not flags:  # a save at every step changes nothing either
        saving = run_training(1, {**args, "save": tmp_path / "grid", "save-interval": 1})
        assert_same_run(saving, reference)


def test_remote_environment_run_resumes_exactly(uninterrupted, tmp_path: Path) -> None:
    """The agents of unfinished groups run again on the env server after the resume; their
    requests reach the restored engine over HTTP and are answered by key."""
    with env_server(
        tmp_path, "- agent_type: digits\n  env_id: copy\n  agent_args: {task: copy}\n"
    ) as (url, _):
        args = {**LAG2, "env-config": remote_env_config(tmp_path, url, ["copy"])}
        resumed = stopped_then_resumed(args, tmp_path, 3)
        reference = uninterrupted(1, args)
    assert_same_run(resumed, reference, in_process=False)
    assert all(m["staleness_min"] == m["staleness_max"] == min(m["step"], 2) for m in reference)
