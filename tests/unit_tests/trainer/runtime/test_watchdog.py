"""The progress watchdog: a phase that does not finish in time ends the process with status 1,
one message on rank 0 and this rank's stacks (threads and event-loop tasks) in a file; phases
that finish in time keep it quiet. The whole run: ``tests/functional_tests/test_clean_endings.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron.trainer.flags.parse import check
from megatron.trainer.runtime.watchdog import Watchdog

ROOT = Path(__file__).resolve().parents[4]

PROGRAM = """
import asyncio, sys, time
from pathlib import Path
from megatron.trainer.runtime.exits import run_main
from megatron.trainer.runtime.watchdog import Watchdog

def main():
    # "raise": the error comes 0.5 s after the watchdog fired and 1.5 s before its grace ends
    grace_s = 2.0 if sys.argv[2] == "raise" else 0.2
    watchdog = Watchdog(1.0, Path(sys.argv[1]), "T", rank=0, grace_s=grace_s)
    loop = asyncio.new_event_loop()
    watchdog.watch_loop(loop)

    async def stuck_environment():
        await asyncio.Event().wait()

    async def window():
        await asyncio.gather(loop.create_task(stuck_environment(), name="group-3"))

    watchdog.start("start-up")
    for _ in range(10):  # steps that finish in time
        with watchdog.phase("step 0"):
            time.sleep(0.1)
    with watchdog.phase("step 1"):
        if sys.argv[2] == "raise":  # what a collective does once a peer exited
            time.sleep(1.5)
            raise RuntimeError("Connection closed by peer")
        if sys.argv[2] == "finish":
            watchdog.close()
            return
        loop.run_until_complete(window())

run_main(main)
"""


def run_program(tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "stacks"), how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_phase_past_its_timeout_ends_the_process_with_its_stacks_and_one_message(tmp_path):
    start = time.monotonic()
    proc = run_program(tmp_path, "hang")
    assert proc.returncode == 1 and time.monotonic() - start < 30
    stacks = tmp_path / "stacks" / "watchdog-T-rank0.txt"
    assert proc.stderr.strip() == (
        "pretrain_grpo.py: error: no progress in 0.0166667 min: step 1 has not finished "
        "(watchdog, --watchdog-timeout-minutes); rank 0 waits in megatron/trainer/runtime/exits.py:"
        f"{exits_main_line()} (run_main); the Python stacks of every rank are in "
        f"{tmp_path / 'stacks' / 'watchdog-T-rank*.txt'}"
    )
    text = stacks.read_text()
    assert "step 1 has not finished after 0.0166667 min" in text
    assert " in run_until_complete" in text  # the main thread's stack (faulthandler)
    assert "in main.<locals>.window" in text  # and the event loop's tasks with their chains
    assert "Task 'group-3', awaiting" in text and "in main.<locals>.stuck_environment" in text


def exits_main_line() -> int:
    """The line of ``exits.run_main`` that calls ``main()``."""
    lines = (ROOT / "megatron/trainer/runtime/exits.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == "main()")


def test_an_error_after_the_watchdog_fired_is_not_reported_as_a_bug(tmp_path):
    proc = run_program(tmp_path, "raise")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Connection closed" not in proc.stderr
    assert proc.stderr.count("error: no progress") == 1


def test_phases_that_finish_in_time_keep_it_quiet(tmp_path):
    proc = run_program(tmp_path, "finish")
    assert proc.returncode == 0 and proc.stderr == "" and not (tmp_path / "stacks").exists()


def test_a_phase_block_resumes_the_phase_it_interrupted_however_it_ends(tmp_path):
    watchdog = Watchdog(0, tmp_path, "T", rank=0)
    watchdog.start("start-up")
    with watchdog.phase("step 3"):
        assert watchdog.current == "step 3"
        with pytest.raises(RuntimeError), watchdog.phase("the evaluation after step 3"):
            assert watchdog.current == "the evaluation after step 3"
            raise RuntimeError("the evaluation failed")
        assert watchdog.current == "step 3"
    assert watchdog.current == "start-up"


def test_waiting_for_names_what_the_phase_waits_for_on_the_same_deadline(tmp_path):
    watchdog = Watchdog(0, tmp_path, "T", rank=0)
    watchdog.begin("step 3")
    began = watchdog._phase[1]
    with watchdog.waiting_for("waiting for a batch from the inference rank 1"):
        assert watchdog.current == "step 3 (waiting for a batch from the inference rank 1)"
        assert watchdog._phase[1] == began  # no new timeout: the step's own deadline
    assert watchdog._phase == ("step 3", began)


def test_a_timeout_of_0_starts_no_thread(tmp_path):
    watchdog = Watchdog(0, tmp_path, "T", rank=0)
    watchdog.start()
    assert not watchdog.enabled and watchdog._thread is None
    watchdog.close()


@pytest.mark.parametrize(
    "argv, distributed, watchdog",
    [
        pytest.param([], 31, 30.0, id="defaults"),
        pytest.param(["--watchdog-timeout-minutes", "0"], 10, 0.0, id="off"),
        pytest.param(["--watchdog-timeout-minutes", "0.25"], 10, 0.25, id="short"),
        pytest.param(["--distributed-timeout-minutes", "5"], 5, 30.0, id="explicit-collective"),
    ],
)
def test_the_collective_timeout_outlasts_the_watchdog_unless_given(argv, distributed, watchdog):
    args, errors = check(argv, 1, False)
    assert errors == []
    assert (
        args.parallelism.distributed_timeout_minutes,
        args.training.watchdog_timeout_minutes,
    ) == (
        distributed,
        watchdog,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["--watchdog-timeout-minutes", "-1"], "--watchdog-timeout-minutes must be"),
        pytest.param(["--watchdog-timeout-minutes", "nan"], "--watchdog-timeout-minutes must be"),
        pytest.param(["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must"),
    ],
)
def test_bad_timeouts_are_reported_by_name(argv, message):
    errors = check(argv, world_size=1, cuda=False)[1]
    assert any(e.startswith(message) for e in errors), errors
