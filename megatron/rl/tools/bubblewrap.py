"""The python tool's operating-system sandbox: Debian's ``bubblewrap`` (``bwrap``) around one
interpreter per call.

What the kernel enforces for the program (the command is ``command`` below):

* **its own namespaces**: user (it runs as uid/gid 65534 with no capabilities, and may not
  create further user namespaces), PID (it sees its own processes only; when the call ends the
  namespace's first process is killed and the kernel kills every process in it), network (only
  its own loopback: no route to the host's or anyone's sockets), IPC, UTS and cgroup;
* **its own mount view**: ``/usr`` (with the ``/bin``, ``/lib``, ``/lib64`` links of a merged-usr
  system) and the interpreter's prefix read-only, a fresh ``/proc`` and minimal ``/dev``, and a
  private ``/tmp`` of ``scratch_mb`` (tmpfs, its working directory). Nothing else of the host's
  file system exists in it: no ``/etc``, no home, no repository, no job files;
* **an empty environment**, a new session (no terminal to inject into), no new privileges, the
  seccomp filter of ``seccomp.py``;
* **limits** set before the program starts (``resource`` limits that an unprivileged process
  cannot raise again): address space, CPU seconds, file size, open files, processes, no core
  files; the caller adds the wall-clock limit and caps the output it reads.

``problem()`` says, in one line, why this host cannot run it (no ``bwrap``, user namespaces
disabled, an architecture without a seccomp table); the tool then refuses to start.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megatron.rl.tools import seccomp

SANDBOX_UID = 65534
"""The program's uid and gid inside (``nobody``)."""


def _system_dirs() -> list[str]:
    """``/usr`` bound read-only and ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` as the host has them
    (links on a merged-usr system, bound directories otherwise)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


@dataclass
class Launch:
    """How to start one sandboxed interpreter: the command, the descriptor it reads (the seccomp
    program) and the host user it starts as."""

    argv: list[str]
    pass_fds: tuple[int, ...]
    user: int | None
    """Host uid/gid to start ``bwrap`` as (``sandbox_user``)."""

    def popen_options(self) -> dict[str, Any]:
        """Keyword arguments of ``subprocess.Popen`` / ``asyncio.create_subprocess_exec``."""
        options: dict[str, Any] = {"pass_fds": self.pass_fds}
        if self.user is not None:
            options.update(user=self.user, group=self.user, extra_groups=[])
        return options


def _world_readable(path: str) -> bool:
    """Whether a user with no relation to the owner can reach ``path`` (every directory above
    it searchable by others, the file itself readable and executable by them)."""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001:
            return False
    return os.stat(path).st_mode & 0o005 == 0o005


def interpreter(user: int | None) -> str | None:
    """The interpreter the sandbox runs: this one, when the host user ``user`` starts
    ``bwrap`` can reach it (None: this process's user), else the system's ``/usr/bin/python3``;
    None when neither is usable."""
    own = os.path.realpath(sys.executable)
    if user is None or _world_readable(own):
        return own
    system = "/usr/bin/python3"
    if os.path.exists(system) and _world_readable(system):
        return os.path.realpath(system)
    return None


def sandbox_user() -> int | None:
    """The host uid (and gid) ``bwrap`` starts as: ``SANDBOX_UID`` when this process is root, so
    that the sandbox's processes are not root's (the kernel never enforces root's process
    limit); None (this process's own user) otherwise."""
    return SANDBOX_UID if os.geteuid() == 0 else None


@contextlib.contextmanager
def launch(python_args: list[str], scratch_mb: int = 64) -> Iterator[Launch]:
    """The sandboxed ``python python_args...``; the seccomp program's descriptor stays open until
    the ``with`` block ends (start the process inside it)."""
    user = sandbox_user()
    executable = interpreter(user)
    if executable is None:
        raise OSError(
            f"no interpreter the sandbox user (uid {user}) can run: {sys.executable} is not "
            "readable by others and there is no /usr/bin/python3"
        )
    prefix = os.path.dirname(os.path.dirname(executable))  # <prefix>/bin/python3.X
    args = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--hostname",
        "sandbox",
        *_system_dirs(),
    ]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    fd = _seccomp_fd()
    try:
        args += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(scratch_mb << 20),
            "--tmpfs",
            "/tmp",
            "--chdir",
            "/tmp",
            "--clearenv",
            "--setenv",
            "HOME",
            "/tmp",
            "--seccomp",
            str(fd),
            "--",
            executable,
            *python_args,
        ]
        yield Launch(args, (fd,), user)
    finally:
        os.close(fd)


def _seccomp_fd() -> int:
    """A descriptor of an unlinked temporary file holding the filter, positioned at 0."""
    fd, path = tempfile.mkstemp(prefix="rl-seccomp-")
    os.unlink(path)
    os.write(fd, seccomp.filter_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.lru_cache(maxsize=1)
def problem() -> str | None:
    """None when this host runs the sandbox (checked once per process by running it); otherwise
    what is missing, in one line."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    if shutil.which("bwrap") is None:
        return "'bwrap' is not on PATH (Debian/Ubuntu: apt-get install bubblewrap)"
    if not seccomp.supported():
        return f"no seccomp table for this architecture ({os.uname().machine})"
    try:
        with launch(["-I", "-S", "-c", "import os; print(os.getuid())"]) as sandbox:
            done = subprocess.run(
                sandbox.argv,
                capture_output=True,
                text=True,
                timeout=30,
                env={},
                **sandbox.popen_options(),
            )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"'bwrap' did not run: {exc}"
    if done.returncode != 0 or done.stdout.strip() != str(SANDBOX_UID):
        lines = [x for x in done.stderr.splitlines() if x.strip()] or ["no output"]
        return (
            f"'bwrap' could not create the sandbox ({lines[-1].strip()}); it needs unprivileged "
            "user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0; in a container: allowed by its seccomp profile)"
        )
    return None
