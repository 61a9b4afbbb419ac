"""The progress watchdog (``--watchdog-timeout-minutes``): a run that stops making progress stops
itself, saying where every rank waits.

Every rank runs a ``Watchdog`` thread. The training loop (``grpo.py``) runs each phase in a
``with watchdog.phase(name):`` block: start-up (from torch.distributed's start: the model built
and loaded, the rollout pipeline started, ``--val-at-start``), each training step (collection and
update), each evaluation, each checkpoint save; when a block ends, the phase around it begins
again. The phases begin at the same point of the program on every rank (just after a
collective), so the ranks' deadlines agree. When a phase has not finished after the
timeout, the watchdog of every rank, at about the same moment:

1. writes the Python stacks of every thread of its process (``faulthandler``), and the await chain
   of every task of the event loops it was shown (rank 0's generation and evaluation loops, where
   a rollout that never ends waits), to ``watchdog-<start time>-rank<R>.txt`` in ``directory``;
2. records the message in torchelastic's error file (``exits.write_error_file``), and rank 0
   prints it, the run's one message: ``pretrain_grpo.py: error: no progress in 30 min: step 12
   has not finished (watchdog, --watchdog-timeout-minutes); rank 0 waits in ...; the Python
   stacks of every rank are in DIR/watchdog-<start time>-rank*.txt``;
3. waits ``grace_s`` (so that no rank exits, and breaks the collectives its peers wait in, before
   they have written their stacks), then ends the process with ``os._exit(1)``: no ``finally``
   runs, so nothing is saved or flushed half-way; a save that was in progress leaves only its
   ``iter_N.partial/`` folder, which no tracker names and the next save of iteration N replaces.

Meanwhile ``FIRED`` is set: ``exits.run_main`` then ends nothing itself (a collective that fails
because a peer already exited is not a bug to report) and lets the watchdog exit.

Limits: a thread that holds the GIL without releasing it (a C extension spinning in a lock) keeps
the watchdog from running; ``faulthandler`` reads Python frames only, not C stacks.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron.trainer.runtime.exits import TRAINER_PROG, write_error_file

FIRED = threading.Event()
"""Set once this process's watchdog has fired: the process is about to exit with status 1."""
OUR_CODE = Path(__file__).resolve().parents[2]
"""``megatron/`` of this repository: the frames a message points at are under it."""


class Watchdog:
    """Ends the process when a phase of the run does not finish within ``timeout_s``."""

    def __init__(
        self,
        timeout_s: float,
        directory: Path,
        run_started: str,
        rank: int,
        flag: str = "--watchdog-timeout-minutes",
        grace_s: float = 5.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.directory = directory
        self.run_started = run_started
        self.rank = rank
        self.flag = flag
        self.grace_s = grace_s
        self._phase = ("start-up", time.monotonic())
        self._loops: list[asyncio.AbstractEventLoop] = []
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        """Whether it watches (a timeout of 0 turns it off)."""
        return self.timeout_s > 0

    @property
    def current(self) -> str:
        """The phase being watched."""
        return self._phase[0]

    def stacks_file(self, rank: int | str) -> Path:
        """Where rank ``rank`` writes its stacks (``"*"``: the pattern of every rank's)."""
        return self.directory / f"watchdog-{self.run_started}-rank{rank}.txt"

    def start(self, phase: str = "start-up") -> None:
        """Begin watching ``phase``."""
        self.begin(phase)
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
            self._thread.start()

    def begin(self, phase: str) -> None:
        """The previous phase finished; ``phase`` (e.g. ``"step 12"``) gets a new timeout."""
        self._phase = (phase, time.monotonic())  # one assignment: read whole by the thread

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Run the block as ``phase`` (``begin``); when it ends, however it ends, the phase it
        interrupted begins again with a new timeout."""
        outer = self.current
        self.begin(phase)
        try:
            yield
        finally:
            self.begin(outer)

    @contextmanager
    def waiting_for(self, what: str) -> Iterator[None]:
        """Run the block as part of the current phase, named in its message (``step 12 (waiting
        for batch 12 from the inference rank 2)``), on the same deadline."""
        phase, began = self._phase
        self._phase = (f"{phase} ({what})", began)
        try:
            yield
        finally:
            if self._phase[0] == f"{phase} ({what})":
                self._phase = (phase, self._phase[1])

    def watch_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Include the tasks of ``loop`` (None: nothing) in this rank's stacks file."""
        if loop is not None:
            self._loops.append(loop)

    def close(self) -> None:
        """Stop watching (the run ended); idempotent."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        while True:
            phase, began = self._phase
            left = began + self.timeout_s - time.monotonic()
            if left <= 0:
                self._fire(phase)
            if self._closed.wait(left):
                return

    def _fire(self, phase: str) -> None:
        """Write the stacks, say why, exit 1 (module docstring)."""
        FIRED.set()
        written = self._write_stacks(phase)
        message = self.message(phase, main_thread_position(), written)
        write_error_file(message, "own")  # every rank: the launcher prints one if rank 0 cannot
        if self.rank == 0:
            print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        time.sleep(self.grace_s)
        os._exit(1)

    def message(self, phase: str, position: str, written: bool) -> str:
        """The run's one line: what did not finish, where this rank waits, where the stacks
        are."""
        where = (
            f"the Python stacks of every rank are in {self.stacks_file('*')}"
            if written
            else f"could not write {self.stacks_file(self.rank)}: the stacks are on stderr"
        )
        return (
            f"{TRAINER_PROG}: error: no progress in {self.timeout_s / 60:g} min: {phase} has not "
            f"finished (watchdog, {self.flag}); rank {self.rank} waits in {position}; {where}"
        )

    def _write_stacks(self, phase: str) -> bool:
        """This rank's stacks into its file (stderr if it cannot be written); whether the file
        was written."""
        path = self.stacks_file(self.rank)
        header = (
            f"watchdog of {TRAINER_PROG}: rank {self.rank}, pid {os.getpid()}, host "
            f"{socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            f"{phase} has not finished after {self.timeout_s / 60:g} min ({self.flag})\n\n"
            "Python stacks of every thread (most recent call first):\n"
        )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:  # append: faulthandler writes to its fd
                f.truncate(0)
                f.write(header)
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
                f.write("".join(self._task_lines()))
            return True
        except OSError:
            sys.stderr.write(header)
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            sys.stderr.write("".join(self._task_lines()))
            return False

    def _task_lines(self) -> Iterator[str]:
        for loop in self._loops:
            if loop.is_closed():
                continue
            tasks = pending_tasks(loop)
            yield f"\nasyncio tasks of event loop {id(loop):#x} ({len(tasks)} pending):\n"
            for task in tasks:
                yield f"Task {task.get_name()!r}, awaiting (outermost first):\n"
                yield from await_chain(task.get_coro())


def pending_tasks(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task]:
    """The unfinished tasks of ``loop``, read from another thread while the loop waits."""
    try:
        return sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    except RuntimeError:  # the task set kept changing: the loop is not waiting
        return []


def await_chain(coro: Any) -> Iterator[str]:
    """One line per coroutine (or generator) of the chain ``coro`` awaits, outermost first."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            yield f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_qualname}\n'
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


def main_thread_position() -> str:
    """``file:line (function)`` of the innermost frame of this repository's code on the main
    thread (relative to the repository), or of its innermost frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    innermost = frame
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(OUR_CODE):
            relative = path.relative_to(OUR_CODE.parent)
            return f"{relative}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    if innermost is None:
        return "?"
    return f"{innermost.f_code.co_filename}:{innermost.f_lineno} ({innermost.f_code.co_name})"


def wait_for_exit() -> None:
    """Block the calling thread while the fired watchdog ends the process."""
    while True:
        time.sleep(3600)
