"""torchrun for ``pretrain_grpo.py`` that ends the way the script does.

    python -m megatron.trainer.launch --nproc-per-node 2 pretrain_grpo.py --rl-forced-lag 2

Same flags as ``torchrun`` (it runs ``torch.distributed.run``'s own ``run`` in this process); only
how the job ends differs. torchrun (torch 2.13) turns every non-zero worker exit into an uncaught
``ChildFailedError`` (a 35-53 line traceback and failure table) and a SIGTERM to itself into an
uncaught ``SignalException`` (traceback, status 1), whatever the workers did; neither can be
changed from a worker. Here:

* a worker that ended with an expected error (``megatron/trainer/runtime/exits.py`` marks it in
  torchelastic's error file) has printed its one message; the launcher adds nothing and exits
  with the worker's status;
* a worker stopped by a signal (SIGTERM from Slurm, torchrun's forwarding) ends the job with its
  128 + signum, and a SIGTERM/SIGINT to the launcher itself, which torchelastic forwards to the
  workers and waits for, ends it with 128 + signum too;
* any other failure (a bug) gets one line naming the rank and its status; the worker's traceback
  is above it.

Workers get ``--shutdown-timeout`` (default here ``DEFAULT_SHUTDOWN_TIMEOUT_S``, not 30 s) to
save a checkpoint and exit after a forwarded signal before torchelastic kills them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from megatron.trainer.runtime.exits import EXPECTED_MARK, freeze_collector_at_exit

DEFAULT_SHUTDOWN_TIMEOUT_S = 300
"""Seconds a signalled worker has to save and exit (torchrun's own default is 30)."""


def main(argv: list[str] | None = None) -> int:
    """Launch like torchrun; return the job's exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    freeze_collector_at_exit()  # a faster end (megatron/trainer/runtime/exits.py)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        args.shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT_S
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    # torchelastic logs each failure at ERROR; the report below replaces it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        return report(exc.failures, args.training_script)
    return 0


def report(failures: dict, script: str) -> int:
    """The job's status for the failed workers (torchelastic ``ProcessFailure``s by global
    rank). Quiet when an expected error was printed by its rank 0 or every worker was stopped by
    a signal; else one line: the expected message of another rank, or the rank of a bug."""
    by_time = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    name = os.path.basename(script)
    own = [(r, f) for r, f in by_time if f.error_file_data.get(EXPECTED_MARK) == "own"]
    if own:
        if all(r != 0 for r, _ in own):  # rank 0 prints; it failed otherwise, or was stopped
            message = _message(own[0][1])
            prefix = "" if message.startswith(f"{name}: error:") else f"{name}: error: "
            print(f"{prefix}{message}", file=sys.stderr, flush=True)
        # a rank that recorded its error may still be stopped by torchelastic before it exits
        statuses = [f.exitcode for r, f in sorted(own, key=lambda o: o[0]) if f.exitcode > 0]
        return statuses[0] if statuses else 1
    bugs = [
        (r, f)
        for r, f in by_time
        if signal_of(f.exitcode) is None and f.error_file_data.get(EXPECTED_MARK) != "peer"
    ]
    if not bugs:
        stopped = [signal_of(f.exitcode) for _, f in by_time if signal_of(f.exitcode)]
        return 128 + stopped[0] if stopped else 1
    rank, failure = bugs[0]
    what = _message(failure)
    print(
        f"{name}: rank {rank} failed with exit status {failure.exitcode}"
        + (f" ({what})" if what else "")
        + "; its output is above",
        file=sys.stderr,
        flush=True,
    )
    return failure.exitcode if failure.exitcode > 0 else 1


def _message(failure) -> str:
    """The message a worker wrote into its error file ('' without one)."""
    detail = failure.error_file_data.get("message", {})
    what = detail.get("message", "") if isinstance(detail, dict) else str(detail)
    return "" if what == "<NONE>" else what


def signal_of(exitcode: int) -> int | None:
    """The stop signal behind a worker's exit code (killed by it, or its 128 + signum after a
    clean stop), else None."""
    if exitcode < 0:
        return -exitcode
    stops = (signal.SIGTERM, signal.SIGINT)
    return next((int(s) for s in stops if exitcode == 128 + s), None)


if __name__ == "__main__":
    sys.exit(main())
