"""The env-config YAML: a list of ``{agent_type, agent_args, weight}`` entries.

Example::

    - agent_type: digits          # built-ins: digits, remote, reward_only, prompts, reward_model,
                                  # llm_judge, openai_agent; or "package.module:Class"
      agent_args: {task: copy, min_digits: 1, max_digits: 3}
      weight: 3
    - agent_type: digits
      env_id: add                 # optional name in metrics (default: "<agent_type><index>")
      agent_args: {task: add, max_digits: 2}
      weight: 1
    - agent_type: digits
      env_id: sort
      agent_args: {task: sort}
      evaluation_only: true       # no training groups; evaluated by --eval-interval (so is weight: 0)
    - agent_type: digits
      env_id: copy-shaped
      agent_args: {task: copy}
      reward_funcs:               # the reward: a weighted sum of reward functions
        - {function: environment, weight: 1.0}
        - {function: regex, weight: 0.1, args: {pattern: "^[0-9]+$"}}

As in Megatron-LM, an entry with ``weight: 0`` or ``evaluation_only: true`` gets no training
groups but is evaluated; at least one entry must train. Every problem is reported at start-up as
an ``EnvConfigError`` naming the file, the entry and the field, before any model is built; so is
an optional package the agent declares in ``Agent.required_modules`` that does not import.

``reward_funcs`` (a single-turn environment's entry only) replaces the environment's reward by
the weighted sum of reward functions: built-in ones, user code, a reward model, an LLM judge
(``megatron/rl/agent/rewards/functions.py``). ``agent_type: prompts`` (a JSONL file of prompts)
has no reward of its own and needs them; ``reward_model`` and ``llm_judge`` are a prompt source
scored by one reward model or judge (``megatron/rl/agent/rewards/environments.py``).
``openai_agent`` runs a user's agent written against the ``openai`` package
(``megatron/rl/agent/openai_agent.py``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatron.rl.agent.api import Agent
from megatron.rl.agent.mixture import MixtureAgent
from megatron.rl.agent.rewards.functions import RewardConfigError, attach_reward_functions

BUILTIN_AGENT_TYPES = {
    "digits": "megatron.rl.environments.digits:DigitTaskEnvironment",
    "remote": "megatron.rl.agent.remote:RemoteAgent",
    "reward_only": "megatron.rl.agent.reward_only:RewardOnlyAdapter",
    "prompts": "megatron.rl.agent.rewards.prompts:PromptsEnvironment",
    "reward_model": "megatron.rl.agent.rewards.environments:RewardModelEnvironment",
    "llm_judge": "megatron.rl.agent.rewards.environments:LLMJudgeEnvironment",
    "openai_agent": "megatron.rl.agent.openai_agent:OpenAIAgentEnvironment",
}
"""Short names accepted as ``agent_type``."""

DEFAULT_ENV_CONFIG: list[dict[str, Any]] = [
    {"agent_type": "digits", "env_id": "copy", "agent_args": {"task": "copy"}, "weight": 1.0}
]
"""The embedded default used when no ``--env-config`` is given."""


class EnvConfigError(ValueError):
    """An env config that cannot be used; the message names file, entry and field."""


class EnvEntry(BaseModel):
    """One entry of the env-config list."""

    model_config = ConfigDict(extra="forbid")

    agent_type: str = Field(min_length=1)
    agent_args: dict[str, Any] = Field(default_factory=dict)
    weight: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    env_id: str | None = None
    evaluation_only: bool = False
    reward_funcs: list[Any] | None = Field(
        None,
        min_length=1,
        description="Reward functions whose weighted sum is the environment's reward "
        "(megatron/rl/agent/rewards/functions.py).",
    )

    @property
    def trains(self) -> bool:
        """Whether the entry gets training groups (weight > 0 and not evaluation-only)."""
        return self.weight > 0 and not self.evaluation_only


def resolve_agent_type(agent_type: str) -> type[Agent]:
    """The ``Agent`` subclass named by ``agent_type`` (built-in name or ``module:Class``)."""
    target = BUILTIN_AGENT_TYPES.get(agent_type, agent_type)
    if ":" not in target:
        known = ", ".join(sorted(BUILTIN_AGENT_TYPES))
        raise ValueError(f"unknown agent_type {agent_type!r} (built-ins: {known}; or module:Class)")
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import agent_type {agent_type!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Agent)):
        raise ValueError(f"agent_type {agent_type!r} is not an Agent subclass")
    return cls


def missing_module(cls: type[Agent]) -> str | None:
    """Why one of ``cls.required_modules`` cannot be imported, with its install command (None
    when all of them import)."""
    for module, install in cls.required_modules.items():
        try:
            importlib.import_module(module)
        except ImportError as err:
            return f"needs the {module!r} package, which cannot be imported ({err}): {install}"
    return None


def build_agents(entries: list[dict[str, Any]], source: str = "<default>") -> MixtureAgent:
    """Validate ``entries`` and instantiate the weighted mixture of their agents."""
    if not isinstance(entries, list) or not entries:
        raise EnvConfigError(f"env config {source}: expected a non-empty list of entries")
    agents, trains, weights = [], [], []
    for index, raw in enumerate(entries):
        where = f"env config {source}, entry {index}"
        try:
            entry = EnvEntry.model_validate(raw)
        except ValidationError as err:
            raise EnvConfigError(f"{where}: {_describe(err)}") from None
        try:
            cls = resolve_agent_type(entry.agent_type)
        except ValueError as err:
            raise EnvConfigError(f"{where}, field 'agent_type': {err}") from None
        where = f"{where} (agent_type {entry.agent_type!r})"
        missing = missing_module(cls)
        if missing is not None:
            raise EnvConfigError(f"{where}: {missing}")
        with _imports_reported(where):  # a package the class does not declare
            try:
                args = cls.Args.model_validate(entry.agent_args)
            except ValidationError as err:
                raise EnvConfigError(f"{where}: {_describe(err, 'agent_args')}") from None
            agent = cls.create(entry.env_id or f"{entry.agent_type}{index}", args)
            try:
                if entry.reward_funcs is not None:
                    attach_reward_functions(agent, entry.reward_funcs)
                elif getattr(agent, "requires_reward_functions", False) and (
                    agent.reward_functions is None
                ):
                    raise RewardConfigError(
                        f"field 'reward_funcs': agent_type {entry.agent_type!r} has no reward of "
                        "its own: list the reward functions that score it"
                    )
            except RewardConfigError as err:
                raise EnvConfigError(f"{where}: {err}") from None
            agents.append(agent)
        trains.append(entry.trains)
        weights.append(entry.weight)
    ids = [a.env_id for a in agents]
    if len(set(ids)) != len(ids):
        raise EnvConfigError(f"env config {source}: env_id values must be unique, got {ids}")
    if not any(trains):
        raise EnvConfigError(
            f"env config {source}: no entry trains (each has 'weight: 0' or 'evaluation_only: "
            "true'); give at least one entry a positive weight"
        )
    return MixtureAgent(
        [a for a, t in zip(agents, trains) if t],
        [w for w, t in zip(weights, trains) if t],
        evaluation_only=[a for a, t in zip(agents, trains) if not t],
    )


def load_env_config(path: str | Path | None) -> MixtureAgent:
    """Agents of the YAML file at ``path``, or of the embedded default when ``path`` is None."""
    if path is None:
        return build_agents(DEFAULT_ENV_CONFIG)
    path = Path(path)
    try:
        entries = yaml.safe_load(path.read_text())
    except OSError as err:
        raise EnvConfigError(f"env config {path}: cannot read: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise EnvConfigError(f"env config {path}: invalid YAML: {err}") from None
    return build_agents(entries, str(path))


@contextlib.contextmanager
def _imports_reported(where: str) -> Iterator[None]:
    """An ``ImportError`` raised while an entry is built, as an ``EnvConfigError`` naming it."""
    try:
        yield
    except ImportError as err:
        name = repr(err.name) if err.name else "a package"
        raise EnvConfigError(f"{where}: needs {name}, which cannot be imported ({err})") from None


def _describe(err: ValidationError, prefix: str = "") -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in (prefix, *e["loc"]) if x != "")
        parts.append(f"field '{loc}': {e['msg']}" if loc else f"the entry: {e['msg']}")
    return "; ".join(parts)
