"""The README's "Post-train a Hugging Face model" section as a new user runs it, up to the first
step: the install line has the extras the command's environments need, the command uses the
launcher, and with the checkpoint of the section's tiny-checkpoint tool every start-up check
passes (flags, ``config.json``, the env config). The training itself is the README's claim,
checked by hand (``--train-iters 2``: a few minutes on 2 cores)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from megatron.rl.agent.env_config import load_env_config
from megatron.trainer.flags.parse import parse_args
from megatron.trainer.grpo import load_agent

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ["python", "-m", "megatron.trainer.launch", "--nproc-per-node", "1", "pretrain_grpo.py"]


def hf_section() -> str:
    """The section's text."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Post-train a Hugging Face model")
    return readme[start : readme.index("\n## ", start + 1)]


def bash_commands(section: str) -> list[str]:
    """The commands of the section's first bash block (continuations joined, comments out)."""
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def with_value(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced."""
    i = argv.index(flag) + 1
    return [*argv[:i], value, *argv[i + 1 :]]


@pytest.fixture
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the section's paths are relative to the repository root


def test_the_install_line_has_the_extras_the_command_needs(at_repo_root):
    install, command = bash_commands(hf_section())
    extras = re.fullmatch(r"pip install torch==[\d.]+ -e '\.\[([\w,]+)\]'", install.strip())
    assert extras, install
    installs = {f"pip install -e '.[{extra}]'" for extra in extras.group(1).split(",")}
    assert "pip install -e '.[hf]'" in installs  # transformers, safetensors, tokenizers
    agent = load_env_config(flag_value(shlex.split(command), "--env-config"))
    needed = {hint for env in agent.evaluated for hint in type(env).required_modules.values()}
    assert needed and needed <= installs


def test_the_command_starts_with_the_tools_tiny_checkpoint(tmp_path, at_repo_root):
    section = hf_section()
    tool_call = re.search(r"`python (tools/make_tiny_hf_checkpoint\.py [^`]+)`", section)
    tool_path, *tool_argv = shlex.split(tool_call.group(1))
    spec = importlib.util.spec_from_file_location("make_tiny_hf_checkpoint", ROOT / tool_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tiny = tmp_path / "tiny"
    tool.main(with_value(tool_argv, "--out", str(tiny)))

    argv = shlex.split(bash_commands(section)[1])
    assert argv[: len(LAUNCH)] == LAUNCH  # the launcher "Errors and signals" recommends
    flags = with_value(argv[len(LAUNCH) :], "--hf-checkpoint", str(tiny))
    flags = with_value(flags, "--save", str(tmp_path / "ck"))
    flags = with_value(flags, "--save-hf", str(tmp_path / "hf"))
    args = parse_args(flags)  # UsageError (status 2) on any refused flag
    assert args.model.seq_length <= args.hf.arch.max_position_embeddings
    load_agent(args)  # UsageError on a bad env config or one that does not fit the flags


def recipe_commands() -> list[list[str]]:
    """The argv of each command of the SmolLM2 recipe's bash block."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("### The recipe: arithmetic word problems, measured")
    return [shlex.split(c) for c in bash_commands(readme[start : readme.index("\n## ", start)])]


def test_the_smollm2_recipe_passes_every_start_up_check(smollm2_checkpoint, at_repo_root, tmp_path):
    """The evaluate, train and serve commands of the recipe, on the converted checkpoint: every
    flag accepted and the env config fits them (the run itself is benchmarks/results/recipe.*)."""
    from megatron.trainer.evaluate import parse_evaluate_args
    from megatron.trainer.serve import parse_serve_args

    evaluate, train, serve = recipe_commands()
    assert evaluate[:3] == ["python", "-m", "megatron.trainer.evaluate"]
    assert train[: len(LAUNCH)] == LAUNCH and serve[:3] == [
        "python",
        "-m",
        "megatron.trainer.serve",
    ]
    flags = with_value(train[len(LAUNCH) :], "--hf-checkpoint", str(smollm2_checkpoint))
    flags = with_value(flags, "--save-hf", str(tmp_path / "hf"))
    flags = with_value(flags, "--metrics-file", str(tmp_path / "m.jsonl"))
    args = parse_args(flags)
    assert (args.training.bf16, args.training.recompute_granularity, args.training.min_lr) == (
        True,
        "full",
        0.0,
    )
    load_agent(args)
    parse_evaluate_args(with_value(evaluate[3:], "--hf-checkpoint", str(smollm2_checkpoint)))
    parse_serve_args(with_value(serve[3:], "--hf-checkpoint", str(smollm2_checkpoint)))
