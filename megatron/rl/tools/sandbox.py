"""The ``python`` tool: run a model's code in a sandbox the operating system enforces.

Model output is untrusted input (a policy rewarded for solving tasks searches for whatever
works), so the default isolation, ``bubblewrap``, is the kernel's: each call runs ``python -I -S``
(no user site, no ``PYTHON*`` variables, no ``site``) in a fresh bubblewrap sandbox
(``bubblewrap.py``: own user, PID, network, IPC and mount namespaces, read-only interpreter, a
private tmpfs as working directory, no environment, the seccomp filter of ``seccomp.py``) under
resource limits: address space (``memory_mb``; a huge allocation is a ``MemoryError``), CPU
seconds, file size, open files, ``processes``. The program may start processes, open sockets and
write files: inside the sandbox none of that reaches the host, and every process it started is
killed when the call ends. Where the host cannot run the sandbox, the tool refuses to start
(``python_tool``), naming what is missing.

``unsafe-audit-hook`` is the old in-process guard, for hosts without user namespaces whose
operator accepts the risk: an audit hook (PEP 578) in the child interpreter refuses sockets,
processes, ``ctypes`` and files outside its temporary directory. It contains mistakes, not an
adversary: code in the same interpreter can reach around an audit hook.

Both: the wall-clock ``timeout_s`` kills the call (an infinite loop), and the output returned is
capped at ``max_output`` characters. Anything that goes wrong is a ``ToolError`` whose message
(the exception's last line) goes back to the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from typing import Any, Literal

from megatron.rl.tools import bubblewrap
from megatron.rl.tools.errors import ToolError

Isolation = Literal["bubblewrap", "unsafe-audit-hook"]
"""How the python tool isolates the model's code (module docstring)."""
ISOLATIONS: tuple[str, ...] = ("bubblewrap", "unsafe-audit-hook")

_LIMITS = r"""
import resource, sys
memory, cpu, fsize, processes = (int(x) for x in sys.argv[1:5])
code = sys.stdin.read()
sys.dont_write_bytecode = True
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_NPROC, processes)):
    resource.setrlimit(limit, (value, value))
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""
"""The bubblewrap program's prelude: limits the program cannot raise again, then the code."""

_AUDIT_HOOK_PRELUDE = r"""
import os, resource, sys
tmp, memory, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
code = sys.stdin.read()
sys.dont_write_bytecode = True
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
def make_hook(tmp):  # locals only: the code cannot reach them through __main__
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    tmp = realpath(tmp)
    readable = (tmp,) + tuple(realpath(p) for p in sys.path if p)
    REFUSED = ("socket.", "subprocess.", "os.system", "os.exec", "os.fork", "os.forkpty",
               "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "os.putenv", "os.unsetenv",
               "ctypes.", "resource.setrlimit", "resource.prlimit", "sys.remote_exec",
               "os.startfile", "webbrowser.open", "pty.spawn")
    READS = ("os.listdir", "os.scandir")
    WRITES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.link", "os.symlink",
              "os.truncate", "os.chmod", "os.chown", "os.utime", "os.chdir", "shutil.")
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path, roots):
        if isinstance(path, int):
            return True
        path = realpath(fsdecode(path))
        return any(path == r or path.startswith(r + sep) for r in roots)

    def hook(event, args):
        if event.startswith(REFUSED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & WRITE_FLAGS)
            if path is not None and not inside(path, (tmp,) if writes else readable):
                raise PermissionError(f"sandbox: opening {path!r} is not allowed")
        elif event.startswith(READS) and args and args[0] is not None:
            if not inside(args[0], readable):
                raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")
        elif event.startswith(WRITES):
            for path in args[:2]:
                if isinstance(path, (str, bytes)) and not inside(path, (tmp,)):
                    raise PermissionError(f"sandbox: {event} on {path!r} is not allowed")

    return hook

sys.addaudithook(make_hook(tmp))
del make_hook
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""
"""The unsafe-audit-hook program's prelude: limits, the hook, then the code."""

SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints (no network, no files "
        "but its own temporary directory, a few seconds at most).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program."}},
            "required": ["code"],
        },
    },
}
"""The tool's OpenAI function schema."""


def isolation_problem(isolation: Isolation) -> str | None:
    """Why ``isolation`` cannot run on this host (one line), or None."""
    if isolation not in ISOLATIONS:
        return f"unknown isolation {isolation!r} (choose from {', '.join(ISOLATIONS)})"
    return bubblewrap.problem() if isolation == "bubblewrap" else None


async def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output: int = 2000,
    isolation: Isolation = "bubblewrap",
    processes: int = 16,
    scratch_mb: int = 64,
) -> str:
    """What ``code`` prints (at most ``max_output`` characters, ``(no output)`` when nothing);
    ``ToolError`` when it raised (its last line), was refused, ran out of memory or time.
    ``processes`` bounds the processes it may run at once, ``scratch_mb`` its files (bubblewrap)."""
    limits = [str(memory_mb << 20), str(max(1, int(timeout_s) + 1)), str(16 << 20)]
    with contextlib.ExitStack() as stack:
        if isolation == "bubblewrap":
            sandbox = stack.enter_context(
                bubblewrap.launch(["-I", "-S", "-c", _LIMITS, *limits, str(processes)], scratch_mb)
            )
            argv, options = sandbox.argv, sandbox.popen_options()
        elif isolation == "unsafe-audit-hook":
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rl-python-tool-"))
            argv = [sys.executable, "-I", "-S", "-c", _AUDIT_HOOK_PRELUDE, tmp, *limits]
            options: dict[str, Any] = {"cwd": tmp}
        else:
            raise ToolError(isolation_problem(isolation))
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={},
            start_new_session=True,
            **options,
        )
        try:
            out, err, code_rc = await asyncio.wait_for(
                _communicate(process, code.encode(), max_output), timeout_s
            )
        except TimeoutError:
            raise ToolError(f"timed out after {timeout_s:g} s") from None
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, 9)  # anything left in its session (the audit hook's case)
            await process.wait()
    if code_rc != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exited with status {code_rc}"
        raise ToolError(reason[:max_output])
    return out or "(no output)"


async def _communicate(
    process: asyncio.subprocess.Process, stdin: bytes, cap: int
) -> tuple[str, str, int]:
    """Feed ``stdin``, read stdout and stderr (each kept up to ``cap`` characters, the rest
    drained so the child never blocks on a full pipe), and wait for the exit status."""
    assert process.stdin and process.stdout and process.stderr

    async def feed() -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            process.stdin.write(stdin)
            await process.stdin.drain()
        process.stdin.close()

    async def read(stream: asyncio.StreamReader, tail: bool = False) -> str:
        kept = bytearray()
        while chunk := await stream.read(1 << 16):
            kept = (kept + chunk)[-4 * cap :] if tail else kept + chunk[: 4 * cap - len(kept)]
        text = kept.decode("utf-8", "replace")
        if tail or len(text) <= cap:
            return text
        return text[:cap] + "\n... (output truncated)"

    _, out, err = await asyncio.gather(
        feed(), read(process.stdout), read(process.stderr, tail=True)
    )
    return out, err, await process.wait()
