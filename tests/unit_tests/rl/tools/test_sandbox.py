"""The python tool's sandbox: code runs and prints; what it refuses comes back as ``ToolError``
(a message for the model), never as a crash; nothing escapes its temporary directory."""

from __future__ import annotations

import asyncio

import pytest

from megatron.rl.tools.errors import ToolError
from megatron.rl.tools.sandbox import run_python


def run(code: str, **limits) -> str:
    return asyncio.run(run_python(code, **{"timeout_s": 3.0, **limits}))


def test_code_runs_imports_the_standard_library_and_prints():
    assert run("import json, math\nprint(json.dumps([math.factorial(5)]))") == "[120]\n"
    assert run("x = 1") == "(no output)"


def test_files_inside_its_temporary_directory_are_allowed():
    assert run("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())") == "hi\n"


@pytest.mark.parametrize(
    "code, needle",
    [
        pytest.param("import socket\nsocket.socket()", "socket", id="network"),
        pytest.param("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')", "socket", id="http"),
        pytest.param("print(open('/etc/passwd').read())", "opening '/etc/passwd'", id="read-passwd"),
        pytest.param("import os\nprint(os.listdir('/'))", "listing '/'", id="list-root"),
        pytest.param("import os\nos.remove('/tmp/x')", "os.remove", id="remove-outside"),
        pytest.param("import os\nos.fork()", "os.fork", id="fork"),
        pytest.param("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen", id="subprocess"),
        pytest.param("import os\nos.system('true')", "os.system", id="system"),
        pytest.param("import os\nos.execv('/bin/true', ['true'])", "os.exec", id="exec"),
        pytest.param("import ctypes", "ctypes", id="ctypes"),
        pytest.param("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "setrlimit", id="raise-limits"),
        pytest.param("x = bytearray(1 << 34)", "MemoryError", id="huge-allocation"),
        pytest.param("raise ValueError('bad input')", "ValueError: bad input", id="exception"),
    ],
)  # fmt: skip
def test_what_it_refuses_is_a_tool_error(code, needle):
    with pytest.raises(ToolError, match=needle):
        run(code)


def test_writing_outside_is_refused_and_leaves_nothing(tmp_path):
    target = tmp_path / "escaped.txt"
    with pytest.raises(ToolError, match="opening"):
        run(f"open({str(target)!r}, 'w').write('x')")
    assert not target.exists()


def test_an_infinite_loop_times_out():
    with pytest.raises(ToolError, match="timed out after 0.5 s"):
        run("while True: pass", timeout_s=0.5)


def test_the_environment_is_empty_and_output_is_capped():
    seen = run("import os\nprint(sorted(os.environ))")  # Python may set LC_CTYPE itself
    assert seen in ("[]\n", "['LC_CTYPE']\n")
    out = run("print('x' * 100000)", max_output=50)
    assert out.startswith("x" * 50) and out.endswith("(output truncated)") and len(out) < 100
