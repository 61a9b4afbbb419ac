"""``python -m megatron.trainer.serve``'s flags: the trainer's, validated as the trainer does, plus
the server's; every refusal names its flag and exits with status 2.

The server itself (a subprocess driven by the ``openai`` client) is tested in
``tests/functional_tests/test_serve_and_evaluate.py``.
"""

from __future__ import annotations

import pytest

from megatron.rl.auth import API_KEY_ENV
from megatron.trainer.errors import UsageError
from megatron.trainer.runtime.exits import run_main
from megatron.trainer.serve import PROG, build_serve_parser, main, parse_serve_args, served_key


@pytest.fixture
def tiny(tiny_hf_checkpoints, monkeypatch) -> str:
    """The tiny llama3 checkpoint; no key and no torchrun world in the environment."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return str(tiny_hf_checkpoints["llama3"])


def refusal(argv: list[str]) -> str:
    """The message of the ``UsageError`` that ``argv`` gets."""
    with pytest.raises(UsageError) as exc:
        parse_serve_args(argv)
    return exc.value.message


def test_a_hugging_face_checkpoint_is_served_on_loopback_by_default(tiny):
    args, own = parse_serve_args(["--hf-checkpoint", tiny, "--seq-length", "64"])
    assert (own.host, own.port, own.served_model_name) == ("127.0.0.1", 8000, None)
    assert args.model.tokenizer_type == "HuggingFaceTokenizer" and args.hf is not None
    assert served_key(args) is None


@pytest.mark.parametrize(
    "extra, needles",
    [
        pytest.param([], ["no checkpoint", "--hf-checkpoint DIR", "--load DIR"], id="none"),
        pytest.param(
            ["--hf-checkpoint", "/no/such/dir"], ["--hf-checkpoint", "/no/such/dir"], id="hf-gone"
        ),
        pytest.param(["--load", "/no/such/ck"], ["--load: no such directory"], id="load-gone"),
        pytest.param(["--ckpt-step", "3"], ["--ckpt-step needs --load"], id="step-without-load"),
        pytest.param(["--port", "70000"], ["--port must be in [0, 65535]"], id="port"),
        pytest.param(["--seq-length", "0"], ["--seq-length must be >= 1"], id="trainer-check"),
    ],
)
def test_bad_flags_are_refused_by_name(extra, needles, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    message = refusal(extra)
    assert message.startswith(f"{PROG}: error:"), message
    for needle in needles:
        assert needle in message, message


def test_listening_beyond_loopback_needs_the_jobs_key(tiny, tmp_path, monkeypatch):
    argv = ["--hf-checkpoint", tiny, "--host", "0.0.0.0"]
    message = refusal(argv)
    assert "--host 0.0.0.0" in message and API_KEY_ENV in message and "--rl-api-key-file" in message
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    args, _ = parse_serve_args([*argv, "--rl-api-key-file", str(key_file)])
    assert served_key(args) == "s3cret"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert served_key(parse_serve_args(argv)[0]) == "from-env"
    assert served_key(parse_serve_args(["--hf-checkpoint", tiny, "--host", "localhost"])[0])


def test_an_unreadable_key_file_is_refused(tiny, tmp_path):
    empty = tmp_path / "key"
    empty.write_text("")
    assert "--rl-api-key-file" in refusal(
        ["--hf-checkpoint", tiny, "--rl-api-key-file", str(empty)]
    )


def test_a_torchrun_world_is_refused(tiny, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = refusal(["--hf-checkpoint", tiny])
    assert "runs in one process" in message and "torchrun" in message


def test_the_refusal_is_one_message_with_status_2(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", [PROG])
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: main([]), prog=PROG)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"{PROG}: error: invalid arguments:\n  no checkpoint")
        and err.count("error:") == 1
    )


def test_help_says_one_process_and_names_the_server_flags():
    text = build_serve_parser().format_help()
    assert "One process" in text and "world size 1" in text
    for flag in ("--host", "--port", "--served-model-name", "--hf-checkpoint", "--load"):
        assert flag in text
