"""The ``python`` tool: run a model's code in a sandboxed subprocess.

Each call runs ``python -I -S`` (isolated: no user site, no ``PYTHON*`` variables, no
``site``) with an empty environment, in a fresh temporary directory that is its working
directory and is deleted afterwards. A prelude, before running the code:

* sets resource limits: address space (``memory_mb``; a huge allocation is a ``MemoryError``),
  CPU seconds, size of written files;
* installs an audit hook (PEP 578) that refuses, with ``PermissionError``: sockets (no network),
  processes (``subprocess``, ``os.system``, ``os.exec*``, ``os.fork``, ``os.posix_spawn``,
  signals), ``ctypes``, changing the limits, and file access outside the temporary directory
  (reading is also allowed inside the standard library, which imports need).

The wall-clock ``timeout_s`` kills the process (an infinite loop), and the output the tool
returns is capped at ``max_output`` characters. Anything that goes wrong is a ``ToolError``
whose message (the exception's last line) goes back to the model. This contains mistakes and
casual misuse by a policy model; it is not a boundary against a determined attacker (run the
env server in a container for that).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from typing import Any

from megatron.rl.tools.errors import ToolError

_PRELUDE = r"""
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

SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints (no network, no files "
        "outside a temporary directory, a few seconds at most).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program."}},
            "required": ["code"],
        },
    },
}
"""The tool's OpenAI function schema."""


async def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output: int = 2000,
) -> str:
    """What ``code`` prints (at most ``max_output`` characters, ``(no output)`` when nothing);
    ``ToolError`` when it raised (its last line), was refused, ran out of memory or time."""
    with tempfile.TemporaryDirectory(prefix="rl-python-tool-") as tmp:
        limits = [str(memory_mb << 20), str(max(1, int(timeout_s) + 1)), str(16 << 20)]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", _PRELUDE, tmp, *limits,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=tmp,
            env={},
        )  # fmt: skip
        try:
            out, err, code_rc = await asyncio.wait_for(
                _communicate(process, code.encode(), max_output), timeout_s
            )
        except asyncio.TimeoutError:
            raise ToolError(f"timed out after {timeout_s:g} s") from None
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
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
