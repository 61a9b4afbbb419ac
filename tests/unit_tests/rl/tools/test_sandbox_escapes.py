"""The bubblewrap sandbox, attacked as a policy that controls the model's output would: every
test asserts on a side effect on the host (the file that must not exist, the listener that must
see no connection, the signal that must not arrive, the process that must not survive), never on
an exception inside the sandbox."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron.rl.tools import bubblewrap
from megatron.rl.tools.errors import ToolError
from megatron.rl.tools.sandbox import run_python

pytestmark = pytest.mark.skipif(
    bubblewrap.problem() is not None and not os.environ.get("CI"),
    reason=f"no bubblewrap sandbox here: {bubblewrap.problem()}",
)  # CI installs bubblewrap (.ci/run): there a missing sandbox fails


def attack(code: str, timeout_s: float = 4.0) -> str:
    """Run ``code`` in the sandbox; what it printed, or the error it ended with."""
    try:
        return asyncio.run(run_python(code, timeout_s=timeout_s, max_output=100_000))
    except ToolError as exc:
        return f"error: {exc}"


def tries(*attempts: str) -> str:
    """A program that makes every attempt, each in its own ``try`` (one failing does not stop
    the others)."""
    blocks = []
    for attempt in filter(None, attempts):
        body = "\n".join("    " + line for line in attempt.strip().splitlines())
        blocks.append(f"try:\n{body}\nexcept BaseException as exc:\n    print('failed:', exc)")
    return "import os, sys, subprocess, time, socket, signal\n" + "\n".join(blocks)


# ------------------------------------------------------------------ files outside the sandbox

ROUTES = {
    "open": "open(T, 'w').write('x')",
    "os-open": "os.close(os.open(T, os.O_WRONLY | os.O_CREAT))",
    "dir-fd": "d = os.open(os.path.dirname(T), os.O_RDONLY)\n"
    "os.close(os.open(os.path.basename(T), os.O_WRONLY | os.O_CREAT, dir_fd=d))",
    "symlink": "os.symlink(T, 'link')\nopen('link', 'w').write('x')",
    "hard-link": "open('f', 'w').write('x')\nos.link('f', T)",
    "rename": "open('f', 'w').write('x')\nos.rename('f', T)",
    "mkfifo": "os.mkfifo(T)",
    "shell": "subprocess.run(['sh', '-c', 'echo x > ' + T])",
    "os-system": "os.system('touch ' + T)",
    "posix-spawn": "os.waitpid(os.posix_spawn('/bin/touch', ['touch', T], {}), 0)",
    "fork-exec": "pid = os.fork()\nif pid == 0:\n    os.execv('/bin/touch', ['touch', T])\n"
    "os.waitpid(pid, 0)",
    "ctypes-libc": "import ctypes\nctypes.CDLL(None).system(('touch ' + T).encode())",
    "makedirs-then-write": "os.makedirs(os.path.dirname(T), exist_ok=True)\n"
    "open(T, 'w').write('x')",
    "symlink-race": "import threading\nopen('f', 'w').write('x')\nstop = []\n"
    "def flip():\n    while not stop:\n        for target in ('f', T):\n"
    "            try:\n                os.remove('l')\n            except OSError:\n"
    "                pass\n            try:\n                os.symlink(target, 'l')\n"
    "            except OSError:\n                pass\n"
    "threading.Thread(target=flip, daemon=True).start()\n"
    "for _ in range(2000):\n    try:\n        open('l', 'a').write('x')\n"
    "    except OSError:\n        pass\nstop.append(1)",
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_no_route_creates_a_file_outside(tmp_path, route):
    """Beside the test's own files, in the user's home and in the repository: nothing appears."""
    targets = [
        tmp_path / "escaped",
        Path.home() / f".rl-sandbox-escape-{uuid.uuid4().hex}",
        Path(__file__).resolve().parent / f"rl-sandbox-escape-{uuid.uuid4().hex}",
    ]
    for target in targets:
        attack(f"T = {str(target)!r}\n" + tries(ROUTES[route]))
        assert not target.exists(), f"{route} created {target}"


def test_the_interpreter_and_system_files_cannot_be_changed():
    """Writing into the interpreter's standard library or ``/usr`` (the sandbox's read-only
    mounts) changes nothing on the host."""
    import json as victim

    path = Path(victim.__file__)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    interpreter = bubblewrap.interpreter(bubblewrap.sandbox_user())
    stdlib = os.path.dirname(os.__file__) if interpreter == os.path.realpath(sys.executable) else ""
    out = attack(
        tries(
            f"open({str(path)!r}, 'a').write('raise SystemExit')",
            (
                f"open({os.path.join(stdlib, 'json', '__init__.py')!r}, 'a').write('x')"
                if stdlib
                else ""
            ),
            "open('/usr/bin/rl-sandbox-escape', 'w').write('x')",
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "assert libc.mount(b'none', b'/usr', None, 0x20 | 1 << 5, None) != 0",  # remount
        )
    )
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before, out
    assert not Path("/usr/bin/rl-sandbox-escape").exists()


def test_scratch_space_is_bounded():
    out = attack("open('big', 'wb').write(b'x' * (200 << 20))", timeout_s=10)
    assert out.startswith("error:") and ("No space" in out or "File too large" in out), out


# ------------------------------------------------------------------------------- the network


def test_no_connection_reaches_a_listener_on_the_hosts_loopback():
    canary = socket.socket()
    canary.bind(("127.0.0.1", 0))
    canary.listen(8)
    canary.settimeout(0.3)
    port = canary.getsockname()[1]
    connect = f'socket.create_connection(("127.0.0.1", {port}), timeout=1)'
    out = attack(
        tries(
            connect,
            f"socket.create_connection(('localhost', {port}), timeout=1)",
            f"socket.socket(socket.AF_INET6).connect(('::1', {port}))",
            f"subprocess.run([sys.executable, '-c', 'import socket; {connect}'], timeout=2)",
            f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))",
        )
    )
    with pytest.raises(socket.timeout):
        canary.accept()
    canary.close()
    assert "failed:" in out  # the attempts ran (and the direct connection was refused)


# ------------------------------------------------------------------ the parent and the host


def test_no_signal_reaches_the_host_and_no_scheduling_change_does(monkeypatch):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    affinity = os.sched_getaffinity(0)
    host = os.getpid()
    try:
        out = attack(
            tries(
                f"os.kill({host}, signal.SIGUSR1)",
                "os.kill(os.getppid(), signal.SIGUSR1)",
                f"os.killpg({host}, signal.SIGUSR1)",
                f"os.setpriority(os.PRIO_PROCESS, {host}, 19)",
                f"os.sched_setaffinity({host}, {{0}})",
                "import ctypes\nctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0)",  # ATTACH
                "for pid in range(1, 4096):\n    try:\n        os.kill(pid, signal.SIGUSR1) "
                "if pid != os.getpid() else None\n    except OSError:\n        pass",
            )
        )
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [], out
    assert os.getpriority(os.PRIO_PROCESS, 0) == nice
    assert os.sched_getaffinity(0) == affinity


def test_the_parents_environment_and_secrets_are_out_of_reach(monkeypatch):
    secret = f"job-key-{uuid.uuid4().hex}"
    monkeypatch.setenv("RL_ENV_SERVER_KEY", secret)
    out = attack(
        tries(
            "print(dict(os.environ))",
            f"print(open('/proc/{os.getpid()}/environ').read())",
            "for pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
            "            print(open(f'/proc/{pid}/environ').read())\n"
            "        except OSError as exc:\n            print(exc)",
            "print(open('/proc/self/environ').read())",
            "print(os.listdir('/proc'))",
        )
    )
    assert secret not in out


def test_no_process_outlives_the_call():
    marker = f"rl-sandbox-survivor-{uuid.uuid4().hex}"
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}]"
    attack(
        tries(
            f"subprocess.Popen({sleeper}, start_new_session=True)",
            f"if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, {sleeper})\n    os._exit(0)",
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
            "print('started', flush=True)\ntime.sleep(30)",  # the call times out here
        ),
        timeout_s=1.5,
    )
    time.sleep(0.5)
    survivors = []
    for entry in Path("/proc").iterdir():
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                survivors.append(entry.name)
        except OSError:
            continue
    assert survivors == []


def test_process_creation_is_bounded():
    """A fork bomb gets at most the call's process limit, and the call still ends on time."""
    started = time.monotonic()
    out = attack(
        "import os, time\nn = 0\ntry:\n    while n < 10000:\n        if os.fork() == 0:\n"
        "            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError:\n"
        "    pass\nprint(n)",
        timeout_s=6,
    )
    assert time.monotonic() - started < 8
    assert int(out) < 16, out
