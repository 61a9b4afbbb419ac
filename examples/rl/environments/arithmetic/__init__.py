"""Arithmetic example environment: generated one-step word problems for a small chat model.

Use it as ``agent_type: examples.rl.environments.arithmetic:ArithmeticEnvironment`` (needs
``math-verify``, ``pip install -e '.[math]'``, and a tokenizer with a chat template).
``problems.py`` is the seeded generator (what is generated), ``environment.py`` the environment
(prompt, held-out split, reward, and the measured difficulty on SmolLM2-135M-Instruct).
"""

from examples.rl.environments.arithmetic.environment import (
    ArithmeticArgs,
    ArithmeticEnvironment,
    arithmetic_reward,
)
from examples.rl.environments.arithmetic.problems import (
    ArithmeticProblem,
    capacity,
    generate_problems,
)

__all__ = [
    "ArithmeticArgs",
    "ArithmeticEnvironment",
    "ArithmeticProblem",
    "arithmetic_reward",
    "capacity",
    "generate_problems",
]
