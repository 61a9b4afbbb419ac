"""The example env configs load, and every prompt they draw fits the tiny model's sequence."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

from megatron.rl.agent.api import SingleTurnEnvironment
from megatron.rl.agent.env_config import EnvConfigError, load_env_config
from megatron.rl.agent.multi_turn import MultiTurnEnvironment
from megatron.rl.seeding import derive_seed
from megatron.rl.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[4]
CONFIGS = ROOT / "examples/rl/environment_configs"
SEQ_LENGTH, DEFAULT_MAX_TOKENS = 32, 16  # pretrain_grpo.py defaults (and tiny_cpu.sh)


@pytest.fixture
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' data paths are relative to the launch directory


@pytest.mark.parametrize(
    "name, env_ids, weights",
    [
        pytest.param("countdown", ["countdown"], [1.0], id="countdown"),
        pytest.param("math", ["math"], [1.0], id="math"),
        pytest.param("mixture", ["copy", "countdown", "math"], [2.0, 1.0, 1.0], id="mixture"),
        pytest.param("guess", ["guess"], [1.0], id="guess"),
    ],
)
def test_config_loads(at_repo_root, name, env_ids, weights):
    mixture = load_env_config(os.path.join("examples/rl/environment_configs", f"{name}.yaml"))
    assert [a.env_id for a in mixture.agents] == env_ids
    assert list(mixture.weights) == weights


def test_every_config_is_listed():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == [
        "arithmetic",
        "countdown",
        "gsm8k",
        "guess",
        "math",
        "mixture",
    ]


def test_gsm8k_config_loads_its_sample(at_repo_root, tmp_path, monkeypatch):
    """The GSM8K config needs a tokenizer with a chat template, so it is not in the character
    tokenizer's checks above; its environment is tested under environments/gsm8k."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    (agent,) = load_env_config(CONFIGS / "gsm8k.yaml").agents
    assert agent.env_id == "gsm8k" and len(agent.records) == 20
    problem = agent.make_problem(random.Random(derive_seed(1234, 0, 0)))
    assert [m.role for m in problem.messages] == ["system", "user"]
    assert problem.max_tokens == 256


@pytest.mark.parametrize("module", [pytest.param(m, id=m) for m in ("datasets", "math_verify")])
def test_gsm8k_without_the_math_extra_names_the_entry_and_the_install(
    at_repo_root, monkeypatch, module
):
    """The GSM8K environment imports datasets and math-verify only when it reads and scores: a
    missing one stops the config's load naming the entry and the extra to install."""
    monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError
    with pytest.raises(EnvConfigError) as info:
        load_env_config(CONFIGS / "gsm8k.yaml")
    message = str(info.value)
    assert "gsm8k.yaml, entry 0 (agent_type 'examples.rl.environments.gsm8k:" in message
    assert f"'{module}' package" in message and message.endswith("pip install -e '.[math]'")


def test_arithmetic_config_builds_its_problems():
    """Like GSM8K's, its chat prompts need a tokenizer with a chat template; its environment is
    tested under environments/arithmetic."""
    (agent,) = load_env_config(CONFIGS / "arithmetic.yaml").agents
    assert agent.env_id == "arithmetic" and agent.num_problems() == 2000
    assert agent.args.operations == ["add", "subtract"] and agent.args.system_prompt is None
    problem = agent.make_problem(random.Random(derive_seed(1234, 0, 0)))
    assert [m.role for m in problem.messages] == ["user"] and problem.max_tokens == 64


@pytest.mark.parametrize("name", ["countdown", "math", "mixture"])
def test_prompts_fit_the_default_sequence_length_and_alphabet(at_repo_root, name):
    tokenizer = CharTokenizer()
    for agent in load_env_config(CONFIGS / f"{name}.yaml").agents:
        assert isinstance(agent, SingleTurnEnvironment)
        for i in range(300):
            p = agent.make_problem(random.Random(derive_seed(1234, i, 0)))
            tokenizer.encode(p.prompt)
            assert len(p.prompt) + (p.max_tokens or DEFAULT_MAX_TOKENS) <= SEQ_LENGTH, p


def test_a_whole_guess_episode_fits_the_default_sequence_length(at_repo_root):
    (agent,) = load_env_config(CONFIGS / "guess.yaml").agents
    assert isinstance(agent, MultiTurnEnvironment)
    a = agent.args
    problem = agent.make_problem(random.Random(1))
    guesses, answers = a.max_turns * a.guess_tokens, a.max_turns - 1
    assert len(CharTokenizer().encode(problem.prompt + "+-")) - 2 + guesses + answers <= SEQ_LENGTH
