"""How ``pretrain_grpo.py`` ends: one message for an expected error, a traceback for a bug.

``run_main(main)`` runs the program and maps what ends it to what is printed and the status:

* the last step: nothing, 0;
* ``UsageError`` (bad flags): argparse's or ``flags.resolve.resolve``'s messages on global rank 0, 2;
* ``SystemExit(int)`` (a stop on SIGTERM/SIGINT: 128 + signum) and Ctrl-C before the handlers
  are installed (130): nothing more, that status;
* ``SystemExit(str)`` and ``expected_errors()`` (bad input, an unreadable checkpoint, failing
  environments, an unreachable env server, a reward model that does not load, a non-finite loss
  or gradient, inference ranks that failed or ended):
  ``pretrain_grpo.py: error: <message>`` on global rank 0, 1;
* ``PeerFailed``, ``GenerationAborted`` (another rank failed and reports it): nothing, 1;
* any other exception (a bug): its traceback, 1;
* anything, once the watchdog fired (``megatron/trainer/runtime/watchdog.py``: no progress for
  ``--watchdog-timeout-minutes``): nothing; the watchdog has said why (rank 0) and ends the
  process with 1 (a collective that failed because a peer already exited is no bug).

The other commands of the package (``megatron.trainer.serve``, ``megatron.trainer.evaluate``) end
the same way under their own ``prog``, which replaces ``pretrain_grpo.py`` in the messages.

With ``--debug-tracebacks`` or ``GRPO_DEBUG_TRACEBACKS=1`` expected errors print their traceback
too. Under torchrun every failing rank also writes the message into torchelastic's error file
(``TORCHELASTIC_ERROR_FILE``), marked expected; ``megatron.trainer.launch`` reads that mark to end
with the worker's status and no report of its own, and plain torchrun shows the message as the
root cause instead of a link to its documentation.

At the very end, after every other ``atexit`` handler, ``run_main`` freezes the garbage collector
(``gc.freeze``): the interpreter's shutdown then frees the modules by reference counting alone
instead of also walking every object torch and megatron-core created, about 1 s of each process's
end on one CPU core (``python tools/import_cost.py``). Objects freed by reference count still run
their ``__del__``; only objects in reference cycles are left to the operating system.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

from megatron.trainer.errors import PeerFailed, UsageError

TRAINER_PROG = "pretrain_grpo.py"
DEBUG_ENV = "GRPO_DEBUG_TRACEBACKS"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
EXPECTED_MARK = "grpo_expected_error"
"""Key of the error file that marks an expected error (read by ``megatron.trainer.launch``):
``"own"`` (this rank's message; printed by it when it is global rank 0) or ``"peer"`` (another
rank failed and reports it)."""


def expected_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are a run's expected end, reported by their message alone (imported
    here, late, so that a bad flag exits before the libraries load)."""
    from megatron.rl.agent.api import RewardSourceError
    from megatron.rl.agent.remote import RemoteEnvironmentError
    from megatron.rl.refit.bridge import BridgeBroken
    from megatron.rl.rollout.faults import EnvironmentFailures
    from megatron.trainer.errors import InferenceRanksFailed, NonFiniteUpdate, RefitMismatch

    return (
        EnvironmentFailures,
        RemoteEnvironmentError,
        RewardSourceError,
        NonFiniteUpdate,
        RefitMismatch,
        InferenceRanksFailed,
        BridgeBroken,
    )


def quiet_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of ranks whose failure another rank reports."""
    from megatron.rl.inference.step_group import GenerationAborted

    return (PeerFailed, GenerationAborted)


def debug_tracebacks(argv: list[str]) -> bool:
    """Whether expected errors print their traceback too."""
    return "--debug-tracebacks" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def global_rank() -> int:
    """This process's rank as the launcher set it (0 without one)."""
    return int(os.environ.get("RANK", "0"))


def run_main(main: Callable[[], None], prog: str = TRAINER_PROG) -> None:
    """Run ``main()`` and exit as the module docstring says."""
    freeze_collector_at_exit()
    debug = debug_tracebacks(sys.argv[1:])
    try:
        main()
    except BaseException as exc:
        wait_if_watchdog_fired()
        if isinstance(exc, SystemExit) and exc.code in (None, 0):  # --help, a clean stop
            raise
        report_exit(exc, prog, debug)
        raise
    wait_if_watchdog_fired()


def freeze_collector_at_exit() -> None:
    """``gc.freeze`` as an ``atexit`` handler, registered once per process, on the first call: so
    it runs after the handlers registered later (the module docstring says why)."""
    global _FREEZE_REGISTERED
    if not _FREEZE_REGISTERED:
        atexit.register(gc.freeze)
        _FREEZE_REGISTERED = True


_FREEZE_REGISTERED = False


def report_exit(exc: BaseException, prog: str, debug: bool) -> None:
    """Print and record ``exc`` as the module docstring says and exit; return for an exception
    the caller re-raises (a bug, or ``SystemExit`` with a status)."""
    if isinstance(exc, KeyboardInterrupt):
        sys.exit(130)
    if isinstance(exc, UsageError):
        message = as_prog(exc.message, prog)
        if global_rank() == 0:
            print(message, file=sys.stderr, flush=True)
        write_error_file(message, "own")
        sys.exit(2)
    if isinstance(exc, quiet_errors()):
        if debug:
            traceback.print_exc()
        write_error_file(getattr(exc, "message", str(exc)), "peer")
        sys.exit(1)
    if isinstance(exc, SystemExit):
        if isinstance(exc.code, int):  # argparse, a stop on a signal
            write_error_file(f"exit status {exc.code}", "own")
            return
        expected_exit(prog, str(exc.code), debug)
    if isinstance(exc, expected_errors()):
        expected_exit(prog, str(exc), debug)
    if isinstance(exc, Exception):  # a bug: the traceback is the report
        write_error_file(f"{type(exc).__name__}: {exc}", None, trace=True)


def wait_if_watchdog_fired() -> None:
    """Leave the ending to the watchdog once it fired (it exits the process with status 1)."""
    watchdog = sys.modules.get("megatron.trainer.runtime.watchdog")  # only ever set once imported
    if watchdog is not None and watchdog.FIRED.is_set():
        watchdog.wait_for_exit()


def expected_exit(prog: str, message: str, debug: bool) -> None:
    """Print ``message`` once (global rank 0), record it for the launcher and exit 1."""
    if debug:
        traceback.print_exc()
    message = as_prog(message, prog)
    if global_rank() == 0:
        prefix = "" if message.startswith(f"{prog}: error:") else f"{prog}: error: "
        print(f"{prefix}{message}", file=sys.stderr, flush=True)
    write_error_file(message, "own")
    sys.exit(1)


def as_prog(message: str, prog: str) -> str:
    """``message`` as program ``prog`` says it: the trainer's modules write their messages as
    ``pretrain_grpo.py: error: ...``, which the other commands built on them
    (``megatron.trainer.serve``, ``megatron.trainer.evaluate``) print under their own name."""
    trainer = f"{TRAINER_PROG}: error:"
    if prog == TRAINER_PROG or not message.startswith(trainer):
        return message
    return f"{prog}: error:{message.removeprefix(trainer)}"


def write_error_file(message: str, expected: str | None, trace: bool = False) -> None:
    """Write torchelastic's error file of this worker, if it has one (``expected``: the mark,
    ``"own"``, ``"peer"`` or None for a bug)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": traceback.format_exc() if trace else message,
                "timestamp": str(int(time.time())),
            },
        },
        EXPECTED_MARK: expected,
    }
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass  # the report on stderr stands; torchrun then shows its generic line
