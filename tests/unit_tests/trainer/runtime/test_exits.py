"""How the training program ends: one message for expected errors, a traceback for bugs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron.rl.rollout.faults import EnvironmentFailures
from megatron.trainer.errors import PeerFailed, UsageError
from megatron.trainer.runtime.exits import EXPECTED_MARK, run_main


def end(main, monkeypatch, rank: int = 0, argv=(), env=None) -> tuple[int, str]:
    """Run ``main`` under ``run_main``; (status, stderr)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr("sys.argv", ["pretrain_grpo.py", *argv])
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        run_main(main)
    return exc.value.code


def raiser(exc: BaseException):
    def main():
        raise exc

    return main


@pytest.mark.parametrize(
    "exc",
    [SystemExit("--load CK: cannot read iteration 2"), EnvironmentFailures("environment 'x'")],
)
def test_an_expected_error_is_one_line_on_rank_0_and_nothing_elsewhere(exc, monkeypatch, capsys):
    assert end(raiser(exc), monkeypatch) == 1
    assert capsys.readouterr().err == f"pretrain_grpo.py: error: {exc}\n"
    assert end(raiser(exc), monkeypatch, rank=1) == 1
    assert capsys.readouterr().err == ""


def test_debug_tracebacks_adds_the_traceback(monkeypatch, capsys):
    exc = SystemExit("--load CK: cannot read iteration 2")
    assert end(raiser(exc), monkeypatch, argv=["--debug-tracebacks"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith(f"pretrain_grpo.py: error: {exc}\n")
    assert end(raiser(exc), monkeypatch, env={"GRPO_DEBUG_TRACEBACKS": "1"}) == 1
    assert capsys.readouterr().err.startswith("Traceback")


def test_a_bug_keeps_its_traceback_and_is_recorded_for_the_launcher(monkeypatch, capsys, tmp_path):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ZeroDivisionError):
        run_main(raiser(ZeroDivisionError("division by zero")))
    data = json.loads(error_file.read_text())
    assert data[EXPECTED_MARK] is None
    assert "ZeroDivisionError" in data["message"]["extraInfo"]["py_callstack"]


def test_usage_errors_exit_2_and_peers_exit_quietly(monkeypatch, capsys, tmp_path):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    message = "pretrain_grpo.py: error: invalid arguments:\n  --lr must be > 0, got -1.0"
    assert end(raiser(UsageError(message)), monkeypatch) == 2
    assert capsys.readouterr().err == message + "\n"
    assert json.loads(error_file.read_text())[EXPECTED_MARK] == "own"
    assert end(raiser(PeerFailed("rank 0: --load CK")), monkeypatch, rank=1) == 1
    assert capsys.readouterr().err == ""
    assert json.loads(error_file.read_text())[EXPECTED_MARK] == "peer"
    assert end(raiser(SystemExit(143)), monkeypatch) == 143
    assert end(raiser(KeyboardInterrupt()), monkeypatch) == 130


@pytest.mark.parametrize(
    "exc, printed",
    [
        pytest.param(
            SystemExit("pretrain_grpo.py: error: --hf-checkpoint: no config.json"),
            "megatron.trainer.serve: error: --hf-checkpoint: no config.json",
            id="trainer-message",
        ),
        pytest.param(
            SystemExit("--load CK: cannot read iteration 2"),
            "megatron.trainer.serve: error: --load CK: cannot read iteration 2",
            id="bare-message",
        ),
        pytest.param(
            UsageError("pretrain_grpo.py: error: --env-config: no such file"),
            "megatron.trainer.serve: error: --env-config: no such file",
            id="usage-error",
        ),
    ],
)
def test_another_command_prints_the_trainers_messages_under_its_own_name(
    exc, printed, monkeypatch, capsys
):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        run_main(raiser(exc), prog="megatron.trainer.serve")
    assert capsys.readouterr().err == printed + "\n"


def test_the_collector_is_frozen_after_every_atexit_handler_of_main(tmp_path):
    """The program's own ``atexit`` handlers (a metrics writer's last flush, wandb) run before
    ``gc.freeze``; a handler registered before ``run_main`` sees the collector frozen."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import atexit, gc\n"
        "from megatron.trainer.runtime.exits import run_main\n"
        "BASE = gc.get_freeze_count()\n"  # Python 3.12 starts with some objects frozen
        "atexit.register(lambda: print('before run_main', gc.get_freeze_count() > BASE))\n"
        "def main():\n"
        "    atexit.register(lambda: print('in main', gc.get_freeze_count() > BASE))\n"
        "run_main(main)\n"
        "run_main(main)\n"  # a second call registers the freeze once, still before main's
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n") == [
        "in main False",
        "in main False",
        "before run_main True",
        "",
    ]
