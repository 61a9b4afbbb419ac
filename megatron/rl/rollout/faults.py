"""The environment fault policy, one for in-process and remote environments.

* ``run_group``: an exception raised by an environment's own code while it produces a group
  becomes a group of masked placeholder rollouts (zero loss weight, error text kept). Inference
  failures (``INFRASTRUCTURE_ERRORS``: the engine, an unreachable inference server or env server)
  propagate: the run cannot continue without them. The generator's group workers (in process) and
  the env server's ``/v1/grouped_rollouts`` both call it, so a raising environment gives the same
  groups, and the same training run, wherever it runs.
* ``FaultLog``: the first occurrence of each distinct error of each environment is logged once,
  with its traceback when there is one (placeholders an environment made itself, or that came
  back from an env server, carry their error text only).
* ``FailureBudget``: the run-level limit on the share of failed rollouts per environment (the
  trainer's ``--rl-max-failed-rollout-fraction``) and the rule that a batch whose every rollout
  failed cannot be trained; exceeding either raises ``EnvironmentFailures`` naming the
  environment.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter
from dataclasses import dataclass

from megatron.rl.agent.api import Agent, placeholder_rollout
from megatron.rl.agent.mixture import MixtureAgent
from megatron.rl.agent.remote import RemoteEnvironmentError
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import EngineError
from megatron.rl.inference.remote import InferenceUnavailable
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup

logger = logging.getLogger(__name__)

INFRASTRUCTURE_ERRORS: tuple[type[BaseException], ...] = (
    EngineError,
    InferenceUnavailable,
    RemoteEnvironmentError,
)
"""Failures of what generates, not of an environment: they end the run (or, behind the env
server, become an HTTP error the trainer sees). Whatever httpx raises on a call to an inference
server or an env server (an exception group from beneath it included) arrives as one of these
(``http_client.call_json`` raises ``RemoteCallError``, which the remote interfaces turn into
``InferenceUnavailable`` or ``RemoteEnvironmentError``; only a 4xx answer about the request
itself is the environment's ``InvalidInferenceRequest``), never as an error of the
environment's own code."""


class EnvironmentFailures(RuntimeError):
    """Too many rollouts of an environment failed; the message names it and its first error."""


class FaultLog:
    """Logs the first occurrence of each distinct (environment, error) once."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self.log = log
        self.first_error: dict[str, str] = {}
        """The first error text of each environment."""
        self._seen: set[tuple[str, str]] = set()

    def exception(self, env_id: str, request: GroupedRolloutRequest, exc: BaseException) -> None:
        """Record an exception an environment raised (logged with its traceback, once)."""
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        if self._first(env_id, f"{type(exc).__name__}@{where}", _text(exc)):
            text = "".join(traceback.format_exception(exc)).rstrip()
            self.log.warning(
                "environment %r raised on group %d/%d (its groups become placeholder rollouts; "
                "each distinct error is logged once):\n%s",
                env_id,
                request.batch_id,
                request.index_in_batch,
                text,
            )

    def group(self, group: RolloutGroup) -> None:
        """Record the placeholder rollouts of a finished group (logged once per error kind)."""
        for rollout in group.rollouts:
            if rollout.error is not None:
                kind = rollout.error.split(":", 1)[0]
                if self._first(rollout.env_id, kind, rollout.error):
                    self.log.warning(
                        "environment %r: a rollout of group %d/%d failed (masked; each distinct "
                        "error is logged once): %s",
                        rollout.env_id,
                        group.batch_id,
                        group.index_in_batch,
                        rollout.error,
                    )

    def _first(self, env_id: str, kind: str, text: str) -> bool:
        self.first_error.setdefault(env_id, text)
        if (env_id, kind) in self._seen:
            return False
        self._seen.add((env_id, kind))
        return True


async def run_group(
    agent: Agent,
    request: GroupedRolloutRequest,
    inference: InferenceInterface,
    faults: FaultLog,
) -> RolloutGroup:
    """``agent.group_rollout`` under the fault policy (module docstring)."""
    try:
        group = await agent.group_rollout(request, inference)
    except INFRASTRUCTURE_ERRORS:
        raise
    except Exception as exc:  # the environment's own code failed: mask the group, keep the error
        env_id = environment_of(agent, request).env_id
        faults.exception(env_id, request, exc)
        rollouts = [placeholder_rollout(env_id, request, exc)] * request.group_size
        return RolloutGroup(
            batch_id=request.batch_id, index_in_batch=request.index_in_batch, rollouts=rollouts
        )
    faults.group(group)
    return group


def environment_of(agent: Agent, request: GroupedRolloutRequest) -> Agent:
    """The environment that serves ``request`` (the assigned one of a mixture)."""
    while isinstance(agent, MixtureAgent):
        agent = agent.agent_for(request)
    return agent


@dataclass
class FailureBudget:
    """Failed-rollout accounting of the trained batches, per environment."""

    max_fraction: float
    """Stop once an environment's share of failed rollouts exceeds this (1: never)."""
    min_rollouts: int
    """Rollouts an environment must have produced before its share is judged."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_fraction <= 1:
            raise ValueError(f"max_fraction must be in [0, 1], got {self.max_fraction}")
        self.total: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()

    def check(self, batch_id: int, groups: list[RolloutGroup], faults: FaultLog) -> None:
        """Count ``groups``; raise ``EnvironmentFailures`` when the batch cannot be trained or an
        environment is over budget."""
        rollouts = [r for g in groups for r in g.rollouts]
        for r in rollouts:
            self.total[r.env_id] += 1
            self.failed[r.env_id] += r.is_placeholder
        if rollouts and all(r.is_placeholder for r in rollouts):
            envs = sorted({r.env_id for r in rollouts})
            raise EnvironmentFailures(
                f"every rollout of batch {batch_id} failed in its environment "
                f"({', '.join(envs)}): {rollouts[0].error}"
            )
        for env, total in sorted(self.total.items()):
            share = self.failed[env] / total
            if total >= self.min_rollouts and share > self.max_fraction:
                raise EnvironmentFailures(
                    f"environment {env!r}: {self.failed[env]} of its {total} rollouts so far "
                    f"failed ({share:.0%}), above the limit of {self.max_fraction:.0%}; its first "
                    f"error: {faults.first_error.get(env, '?')}"
                )


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
