"""The python tool, both isolations: code runs and prints; failures come back as ``ToolError`` (a
message for the model), never as a crash; time, memory and output are bounded. The audit hook's
refusals are tested here; the bubblewrap sandbox's guarantees, by side effects, in
``test_sandbox_escapes.py``."""

from __future__ import annotations

import asyncio
import os

import pytest

from megatron.rl.tools import bubblewrap
from megatron.rl.tools.errors import ToolError
from megatron.rl.tools.sandbox import run_python

needs_bubblewrap = pytest.mark.skipif(
    bubblewrap.problem() is not None and not os.environ.get("CI"),
    reason=f"no bubblewrap sandbox here: {bubblewrap.problem()}",
)  # CI installs bubblewrap (.ci/run): there a missing sandbox fails


@pytest.fixture(params=[pytest.param("bubblewrap", marks=needs_bubblewrap), "unsafe-audit-hook"])
def isolation(request) -> str:
    return request.param


def run(code: str, **limits) -> str:
    return asyncio.run(run_python(code, **{"timeout_s": 3.0, **limits}))


def test_code_runs_imports_the_standard_library_and_prints(isolation):
    code = "import json, math\nprint(json.dumps([math.factorial(5)]))"
    assert run(code, isolation=isolation) == "[120]\n"
    assert run("x = 1", isolation=isolation) == "(no output)"


def test_files_inside_its_temporary_directory_are_allowed(isolation):
    code = "open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())"
    assert run(code, isolation=isolation) == "hi\n"


@pytest.mark.parametrize(
    "code, needle",
    [
        pytest.param("x = bytearray(1 << 34)", "MemoryError", id="huge-allocation"),
        pytest.param("raise ValueError('bad input')", "ValueError: bad input", id="exception"),
    ],
)
def test_errors_come_back_as_their_last_line(isolation, code, needle):
    with pytest.raises(ToolError, match=needle):
        run(code, isolation=isolation)


@pytest.mark.parametrize(
    "code, needle",
    [
        pytest.param("import socket\nsocket.socket()", "socket", id="network"),
        pytest.param(
            "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')",
            "socket",
            id="http",
        ),
        pytest.param(
            "print(open('/etc/passwd').read())", "opening '/etc/passwd'", id="read-passwd"
        ),
        pytest.param("import os\nprint(os.listdir('/'))", "listing '/'", id="list-root"),
        pytest.param("import os\nos.remove('/tmp/x')", "os.remove", id="remove-outside"),
        pytest.param("import os\nos.fork()", "os.fork", id="fork"),
        pytest.param(
            "import subprocess\nsubprocess.run(['true'])", "subprocess.Popen", id="subprocess"
        ),
        pytest.param("import os\nos.system('true')", "os.system", id="system"),
        pytest.param("import os\nos.execv('/bin/true', ['true'])", "os.exec", id="exec"),
        pytest.param("import ctypes", "ctypes", id="ctypes"),
        pytest.param(
            "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
            "setrlimit",
            id="raise-limits",
        ),
    ],
)
def test_the_audit_hook_refuses_with_a_tool_error(code, needle):
    with pytest.raises(ToolError, match=needle):
        run(code, isolation="unsafe-audit-hook")


def test_writing_outside_is_refused_and_leaves_nothing(tmp_path, isolation):
    target = tmp_path / "escaped.txt"
    with pytest.raises(ToolError):
        run(f"open({str(target)!r}, 'w').write('x')", isolation=isolation)
    assert not target.exists()


def test_an_infinite_loop_times_out(isolation):
    with pytest.raises(ToolError, match="timed out after 0.5 s"):
        run("while True: pass", timeout_s=0.5, isolation=isolation)


def test_the_environment_is_empty_and_output_is_capped(isolation):
    seen = run("import os\nprint(sorted(os.environ))", isolation=isolation)
    # Python may set LC_CTYPE itself; bubblewrap sets HOME and PWD to the scratch directory
    assert set(eval(seen)) <= {"LC_CTYPE", "HOME", "PWD"}
    out = run("print('x' * 100000)", max_output=50, isolation=isolation)
    assert out.startswith("x" * 50) and out.endswith("(output truncated)") and len(out) < 100
