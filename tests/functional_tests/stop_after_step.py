"""``pretrain_grpo.py`` whose rank 0 stops itself (SIGSTOP) right after it logs step
``$GRPO_TEST_STOP_AFTER_STEP``: the crash point of the resume cases, fixed by the step count.

A poller that kills the job "once step N is logged" races the job: on a loaded machine a fast
case ran on to its last checkpoint before the kill, and its resume then had nothing to train.
Stopped here, the job cannot take another step before ``run_until_step_then_kill`` kills it.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[0] = str(ROOT)  # as when pretrain_grpo.py is the script

from megatron.trainer.metrics.record import MetricsWriter  # noqa: E402

STOP_AFTER = int(os.environ["GRPO_TEST_STOP_AFTER_STEP"])
log_step = MetricsWriter.write


def log_step_then_stop(self: MetricsWriter, metrics: dict) -> None:
    log_step(self, metrics)
    if metrics["step"] >= STOP_AFTER:
        os.kill(os.getpid(), signal.SIGSTOP)


MetricsWriter.write = log_step_then_stop
runpy.run_path(str(ROOT / "pretrain_grpo.py"), run_name="__main__")
