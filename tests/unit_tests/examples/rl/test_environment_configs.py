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
        pytest.param("weighted_rewards", ["math"], [1.0], id="weighted_rewards"),
        pytest.param("llm_judge", ["judged"], [1.0], id="llm_judge"),
        pytest.param("tool_agent", ["calc"], [1.0], id="tool_agent"),
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
        "llm_judge",
        "math",
        "mixture",
        "reward_model",
        "tool_agent",
        "tool_math",
        "weighted_rewards",
    ]


def test_tool_math_config_offers_both_tools():
    """Its chat prompts need a tokenizer with a chat template; its environment is tested under
    environments/tool_math."""
    (agent,) = load_env_config(CONFIGS / "tool_math.yaml").agents
    assert agent.env_id == "tool_math" and agent.args.max_turns == 4
    problem = agent.make_problem(random.Random(derive_seed(1234, 0, 0)))
    assert [t["function"]["name"] for t in agent.tools(problem)] == ["calculator", "python"]


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


def test_weighted_rewards_config_names_its_functions(at_repo_root):
    (agent,) = load_env_config(CONFIGS / "weighted_rewards.yaml").agents
    functions = agent.reward_functions.functions
    assert [(f.name, f.weight) for f in functions] == [
        ("correct", 1.0),
        ("number", 0.1),
        ("soft_overlong_punishment", 0.5),
        ("length_match", 0.1),
        ("stopped", 0.2),
    ]


def test_llm_judge_config_scores_the_gsm8k_sample_with_a_judge(at_repo_root):
    from megatron.rl.agent.rewards.judge import LLMJudge
    from megatron.rl.agent.rewards.prompts import PromptsEnvironment

    (agent,) = load_env_config(CONFIGS / "llm_judge.yaml").agents
    assert isinstance(agent, PromptsEnvironment) and agent.num_problems() == 20
    (judge,) = agent.reward_functions.functions
    assert judge.name == "llm_judge" and isinstance(judge.function, LLMJudge)
    assert judge.function.args.base_url == "http://127.0.0.1:8001/v1"
    problem = agent.problem(0)
    assert problem.answer.endswith("#### 14") and problem.max_tokens == 256


def reward_model_config(tmp_path) -> list[dict]:
    """reward_model.yaml with its model_dir pointed at a tiny random reward model made here."""
    import yaml

    from megatron.rl.models.hf.tiny import make_tiny_reward_model

    entries = yaml.safe_load((CONFIGS / "reward_model.yaml").read_text())
    assert entries[0]["agent_args"]["model_dir"] == "runs/tiny-reward-model"
    entries[0]["agent_args"]["model_dir"] = str(make_tiny_reward_model(tmp_path / "rm"))
    return entries


def test_reward_model_config_loads_with_a_local_model(at_repo_root, tmp_path):
    from megatron.rl.agent.env_config import build_agents

    (agent,) = build_agents(reward_model_config(tmp_path)).agents
    assert agent.env_id == "rm" and agent.num_problems() == 8
    assert [f.name for f in agent.reward_functions.functions] == ["reward_model"]


@pytest.mark.parametrize(
    "name", ["countdown", "math", "mixture", "weighted_rewards", "reward_model"]
)
def test_prompts_fit_the_default_sequence_length_and_alphabet(at_repo_root, tmp_path, name):
    from megatron.rl.agent.env_config import build_agents

    tokenizer = CharTokenizer()
    if name == "reward_model":
        agents = build_agents(reward_model_config(tmp_path)).agents
    else:
        agents = load_env_config(CONFIGS / f"{name}.yaml").agents
    for agent in agents:
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
