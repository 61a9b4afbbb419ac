"""YAML run files (``--config``, ``flags/run_file.py``): the file's flags, the command line's on top,
its mistakes named, and the resolved flags written back as a run file that parses to the same."""

from __future__ import annotations

import pytest

from megatron.trainer.errors import UsageError
from megatron.trainer.flags.parse import build_parser, parse_args
from megatron.trainer.flags.run_file import dump, file_tokens, resolved


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, tokens",
    [
        pytest.param("rl-forced-lag: 2\n", ["--rl-forced-lag", "2"], id="dashes"),
        pytest.param("rl_forced_lag: 2\n", ["--rl-forced-lag", "2"], id="underscores"),
        pytest.param("bf16: true\n", ["--bf16"], id="switch-on"),
        pytest.param(
            "rl-use-sequence-packing: false\n", ["--no-rl-use-sequence-packing"], id="switch-off"
        ),
        pytest.param("bf16: false\n", [], id="switch-off-without-a-no-form"),
        pytest.param("save: null\n", [], id="null-keeps-the-default"),
        pytest.param("eval-pass-k: [1, 4]\n", ["--eval-pass-k", "1", "4"], id="list"),
    ],
)
def test_a_run_file_becomes_the_flags_it_names(tmp_path, text, tokens):
    assert file_tokens(write(tmp_path, text), build_parser()) == (tokens, [])


def test_the_command_line_overrides_the_file_wherever_config_stands(tmp_path):
    path = write(tmp_path, "seed: 3\nrl-forced-lag: 2\n")
    for argv in (["--config", path, "--seed", "7"], ["--seed", "7", "--config", path]):
        args = parse_args(argv)
        assert (args.training.seed, args.rollouts.forced_lag) == (7, 2)


def test_a_key_that_is_not_a_flag_is_named_with_the_closest_flag(tmp_path):
    path = write(tmp_path, "rl-forced-lagg: 2\nseed: 1\n")
    with pytest.raises(UsageError) as exc:
        parse_args(["--config", path])
    assert exc.value.message == (
        f"pretrain_grpo.py: error: --config {path}: rl-forced-lagg: not a flag; did you mean "
        "rl-forced-lag? (--help-all lists every flag)"
    )


@pytest.mark.parametrize("text", ["- a\n- b\n", "a: [\n"], ids=["not-a-mapping", "bad-yaml"])
def test_a_file_that_is_not_a_mapping_of_flags_is_one_message(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as exc:
        parse_args(["--config", path])
    assert f"--config {path}: " in exc.value.message and len(exc.value.message.splitlines()) == 1


def test_the_resolved_flags_parse_back_to_the_same_flags(tmp_path):
    args = parse_args(
        [
            "--rl-forced-lag",
            "2",
            "--lr",
            "3e-4",
            "--bf16",
            "--eval-pass-k",
            "1",
            "2",
            "--rl-inference-logprobs-is-correction",
            "--rl-importance-sampling-truncation-coef",
            "none",
        ]
    )
    config = resolved(args)
    assert config["rl-forced-lag"] == 2 and config["bf16"] is True
    assert config["rl-importance-sampling-truncation-coef"] == "none"  # None is no cap here
    again = parse_args(["--config", write(tmp_path, dump(config))])
    assert resolved(again) == config
