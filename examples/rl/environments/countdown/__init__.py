"""Countdown example environment (procedurally generated; format reward plus answer reward).

Use it as ``agent_type: examples.rl.environments.countdown:CountdownEnvironment``.

See ``environment.py`` for the problem generator and the exact reward, ``expression.py`` for the
safe expression parser.
"""

from examples.rl.environments.countdown.environment import (
    CountdownArgs,
    CountdownEnvironment,
    CountdownProblem,
    countdown_reward,
)

__all__ = ["CountdownArgs", "CountdownEnvironment", "CountdownProblem", "countdown_reward"]
