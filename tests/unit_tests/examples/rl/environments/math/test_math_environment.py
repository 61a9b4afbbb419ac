"""Math environment: problems from the JSONL fixture, rewards, determinism and start-up errors."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from examples.rl.environments.math import MathArgs, MathEnvironment, load_jsonl
from megatron.rl.agent.api import Problem
from megatron.rl.agent.env_config import EnvConfigError, build_agents
from megatron.rl.seeding import derive_seed
from megatron.rl.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[6]
FIXTURE = ROOT / "examples/rl/environments/math/tiny_arithmetic.jsonl"
AGENT_TYPE = "examples.rl.environments.math:MathEnvironment"


def env(**kwargs) -> MathEnvironment:
    return MathEnvironment("math", MathArgs(path=str(FIXTURE), **kwargs))


def test_fixture_is_written_in_the_tokenizer_alphabet():
    records = load_jsonl(FIXTURE)
    assert len(records) == 8
    tokenizer = CharTokenizer()
    for r in records:
        tokenizer.encode(r.question)
        if r.line != 7:  # line 7's reference is boxed on purpose
            tokenizer.encode(r.answer)
    assert records[6].answer == r"\boxed{8}"


@pytest.mark.parametrize(
    "line, prompt, answer",
    [
        pytest.param(1, "12+30=", "42", id="line1"),
        pytest.param(3, "9-12=", "-3", id="negative"),
        pytest.param(5, "25*4=", "100", id="numeric-answer"),
        pytest.param(7, "2*2*2=", "8", id="boxed-reference-unboxed"),
    ],
)
def test_every_record_can_be_drawn(line, prompt, answer):
    e = env()
    seen = {}
    rng = random.Random(0)
    for _ in range(200):
        p = e.make_problem(rng)
        seen[p.problem_id] = p
    p = seen[f"tiny_arithmetic.jsonl:{line}"]
    assert (p.prompt, p.answer, p.max_tokens) == (prompt, answer, None)
    assert len(seen) == 8


def test_prompts_are_deterministic_from_seeds():
    e = env()
    draw = [e.make_problem(random.Random(derive_seed(1234, 0, i))) for i in range(20)]
    again = [e.make_problem(random.Random(derive_seed(1234, 0, i))) for i in range(20)]
    assert draw == again
    assert len({p.prompt for p in draw}) > 3


def test_template_and_budget():
    e = env(prompt_template="? {question}", max_tokens=6)
    p = e.make_problem(random.Random(0))
    assert p.prompt.startswith("? ") and p.prompt.endswith("=")
    assert p.max_tokens == 6


def test_template_braces_are_not_format_fields():
    e = env(prompt_template=r"\boxed{} {question}")
    assert e.make_problem(random.Random(0)).prompt.startswith(r"\boxed{} ")


@pytest.mark.parametrize(
    "completion, require_boxed, reward",
    [
        pytest.param("42", False, 1.0, id="bare-correct"),
        pytest.param("42.0", False, 1.0, id="equivalent-spelling"),
        pytest.param("6*7=42", False, 1.0, id="after-equals"),
        pytest.param(r"\boxed{42}", False, 1.0, id="boxed"),
        pytest.param(r"\boxed{41} 42", False, 0.0, id="boxed-wrong-wins"),
        pytest.param("41", False, 0.0, id="wrong"),
        pytest.param("4", False, 0.0, id="prefix"),
        pytest.param("", False, 0.0, id="empty"),
        pytest.param(r"\boxed{} = 6*7 = 42", False, 0.0, id="empty-box-is-the-answer"),
        pytest.param(r"\boxed{ }", False, 0.0, id="blank-box"),
        pytest.param("42", True, 0.0, id="unboxed-when-required"),
        pytest.param(r"\boxed{42}", True, 1.0, id="boxed-when-required"),
    ],
)
def test_reward(completion, require_boxed, reward):
    e = env(require_boxed=require_boxed)
    problem = Problem(problem_id="p", prompt="12+30=", answer="42")
    assert e.reward(problem, completion) == reward


def test_template_must_contain_the_question():
    with pytest.raises(ValidationError, match="prompt_template"):
        MathArgs(path=str(FIXTURE), prompt_template="no question here")


def test_malformed_jsonl_fails_at_start_up_naming_config_field_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    entries = [{"agent_type": AGENT_TYPE, "agent_args": {"path": str(data)}}]
    with pytest.raises(EnvConfigError) as err:
        build_agents(entries, "envs.yaml")
    message = str(err.value)
    assert "envs.yaml, entry 0" in message
    assert "field 'agent_args.path'" in message
    assert re.search(re.escape(f"{data} line 2: missing field 'answer'"), message)


def test_missing_path_is_reported(tmp_path):
    entries = [{"agent_type": AGENT_TYPE, "agent_args": {}}]
    with pytest.raises(EnvConfigError, match="field 'agent_args.path'"):
        build_agents(entries, "envs.yaml")
