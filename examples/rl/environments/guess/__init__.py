"""Guess-the-number example environment (multi-turn, higher/lower feedback).

Use it as ``agent_type: examples.rl.environments.guess:GuessEnvironment``; see ``environment.py``
for the game and its reward.
"""

from examples.rl.environments.guess.environment import (
    GuessArgs,
    GuessEnvironment,
    feedback,
    guess_reward,
    parse_guess,
)

__all__ = ["GuessArgs", "GuessEnvironment", "feedback", "guess_reward", "parse_guess"]
