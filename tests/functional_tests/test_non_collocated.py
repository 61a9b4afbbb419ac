"""``--refit-mode non-collocated`` end to end: the lag one collection behind, exact on every
step and across a resume; bitwise reruns whatever the timing; and the failures of the inference
ranks (an error, a kill -9, a rank that falls behind), each ending the run with one message.

The golden cases ``noncollocated_lag2_resume`` and ``noncollocated_remote_env`` are compared with
their golden values in ``test_pretrain_grpo.py``; these tests read their metrics again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from golden_values import (
    ROOT,
    TOLERANCES,
    checkpoint_of_iteration,
    load_case,
    read_metrics,
    run_training,
    subprocess_env,
    training_command,
)
from launching import kill_job, process_tree
from test_clean_endings import TIMEOUT_MINUTES, TINY, WATCHDOG, assert_one_message, error_lines, run

DETERMINISTIC = list(TOLERANCES)  # every guarded metric; timings are not


def test_non_collocated_generation_runs_exactly_one_collection_behind(runs):
    """--refit-mode non-collocated: window c generates with the weights sent at collection
    c-1's start; the generator then runs at L - 1, so batch c was submitted min(c, L) versions
    before it is trained, as collocated, and its tokens are 1..L versions old (batch 0's: 0), on
    every step, the resumed ones included; every refit is a delta of what changed since the
    previous one."""
    for m in runs("noncollocated_lag2_resume"):
        expected = min(m["step"], 2)
        assert (m["staleness_min"], m["staleness_max"]) == (expected, expected), m["step"]
        assert min(1, m["step"]) <= m["token_staleness_min"] <= m["token_staleness_max"]
        assert m["token_staleness_max"] <= expected and m["in_flight_batches"] == 2
        assert m["lag"] == 2
        if m["step"] == 0:  # window 1's weights are window 0's: a delta with nothing in it
            assert m["refit/changed_share"] == 0 == m["refit/bytes_sent"]
        else:
            assert 0 < m["refit/changed_share"] <= 1 and m["refit/bytes_sent"] > 0


def test_non_collocated_reruns_are_bitwise_equal_whatever_the_timing(runs):
    """The same flags twice, once with the environment behind an HTTP env server that generates
    through the inference rank's endpoint (other timing, other processes): every guarded metric
    equal, not close. The weight swaps fall where the step count puts them."""
    local = run_training(2, load_case("noncollocated_remote_env")["args"])
    remote = runs("noncollocated_remote_env")
    assert [{k: m[k] for k in DETERMINISTIC} for m in local] == [
        {k: m[k] for k in DETERMINISTIC} for m in remote
    ]


def test_two_inference_replicas_sample_what_one_does_and_resume_exactly(runs, tmp_path):
    """--rl-inference-replicas 2 (1 training rank + 2 inference ranks): the replicas split each
    window's requests and both take every refit, so the run samples the one-replica run's
    tokens (losses to float rounding); killed after a save, the resume (both replicas' KV caches
    back) continues it bitwise."""
    args = {
        **load_case("noncollocated_remote_env")["args"],
        "rl-inference-replicas": 2,
        "save": tmp_path / "saved",
        "save-interval": 3,
    }
    whole = run_training(3, args)
    for a, b in zip(runs("noncollocated_remote_env"), whole, strict=True):
        assert b["reward_mean"] == a["reward_mean"] and b["staleness_max"] == a["staleness_max"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    load = checkpoint_of_iteration(tmp_path / "saved", 3, tmp_path / "load")
    resumed = run_training(3, {**args, "load": load, "save": tmp_path / "again"})
    assert [{k: m[k] for k in DETERMINISTIC} for m in resumed] == [
        {k: m[k] for k in DETERMINISTIC} for m in whole[3:]
    ]


NON_COLLOCATED = {**TINY, "refit-mode": "non-collocated"}
"""One training rank and one inference rank (``--nproc-per-node 2``)."""


def test_a_failure_on_the_inference_rank_is_one_message_from_the_trainer(tmp_path):
    """--refit-mode non-collocated: the inference rank's error reaches training rank 0, which
    names the inference rank and the error; the job exits 1 within seconds."""
    config = tmp_path / "envs.yaml"
    config.write_text("- agent_type: grpo_testing.fakes:RaisingDigits\n  env_id: raising\n")
    args = {
        **NON_COLLOCATED,
        "train-iters": 20,
        "env-config": config,
        "rl-max-failed-rollout-fraction": 0.1,
    }
    proc, seconds = run(training_command(2, args))
    assert proc.returncode == 1 and seconds < 90, proc.stderr[-3000:]
    messages = [line for line in error_lines(proc.stderr) if "error:" in line]
    assert len(messages) == 1, messages
    assert messages[0].startswith("pretrain_grpo.py: error: the inference rank 1 failed:")
    assert "'raising'" in messages[0] and "above the limit of 10%" in messages[0]


def test_a_killed_inference_rank_ends_the_run_with_one_message_naming_it(tmp_path):
    """kill -9 of the inference rank mid-run: the trainer's next refit or receive fails at once
    (no hang), and the one message names the inference rank."""
    metrics = tmp_path / "m.jsonl"
    cmd = training_command(2, {**NON_COLLOCATED, "train-iters": 5000, "metrics-file": metrics})
    job = subprocess.Popen(
        cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(metrics) if metrics.exists() else []) < 3:
            assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()[-3000:]
            time.sleep(0.2)
        inference = [p for p in process_tree(job.pid) if _rank_of(p) == "1"]
        assert len(inference) == 1
        os.kill(inference[0], signal.SIGKILL)
        _, stderr = job.communicate(timeout=60)
    finally:
        kill_job(job.pid)
    assert job.returncode != 0
    messages = [line for line in error_lines(stderr.decode()) if "error:" in line]
    assert len(messages) == 1, messages
    assert "the inference rank 1 ended or stopped answering" in messages[0], messages[0]


def _rank_of(pid: int) -> str | None:
    """The RANK a launcher gave process ``pid`` (None: not a worker, or gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.slow  # about a minute on 2 cores; Watchdog.waiting_for's unit test runs in CI
def test_an_inference_rank_that_falls_behind_is_named_by_the_watchdog(tmp_path):
    """--refit-mode non-collocated with an environment that never answers from batch 1: the
    inference rank's window 1 (during step 0) never ends, and the trainer's watchdog names what
    step 1 waits for."""
    config = tmp_path / "envs.yaml"
    config.write_text(
        "- agent_type: grpo_testing.fakes:SilentDigits\n  env_id: silent\n"
        "  agent_args: {silent_from_batch: 1}\n"
    )
    args = {**NON_COLLOCATED, **WATCHDOG, "env-config": config}
    args["metrics-file"] = tmp_path / "metrics.jsonl"
    proc, seconds = run(training_command(2, args))
    assert_one_message(
        proc,
        f"no progress in {TIMEOUT_MINUTES:g} min: step 1 (waiting for the inference rank 1 to "
        "take the weights of version 1) has not finished (watchdog, --watchdog-timeout-minutes)",
    )
    assert proc.returncode == 1 and seconds < 90
