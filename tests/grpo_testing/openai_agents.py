"""Agents for the ``openai_agent`` environment's functional tests (importable by spawned trainers:
``tests/`` is on their path)."""

from __future__ import annotations

from examples.rl.environments.tool_agent import agent as tool_agent


def checked_solve(task) -> float:
    """The example calculator agent (two tool rounds, then the answer), which also checks what
    the server answered: every turn's prompt is the previous turn's prompt and generated tokens
    followed by the new messages' tokens, and every generated token has a policy version. Any
    violation raises, so the rollout becomes a placeholder that the test counts."""
    from openai import OpenAI

    with OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as client:
        reward, completions = tool_agent.episode(client, task)
    turns = [c.choices[0].model_extra for c in completions]
    if len(turns) != tool_agent.TOOL_ROUNDS + 1:
        raise AssertionError(f"{len(turns)} turns instead of {tool_agent.TOOL_ROUNDS + 1}")
    for t, (before, turn) in enumerate(zip(turns, turns[1:]), 1):
        history = before["prompt_token_ids"] + before["token_ids"]
        if turn["prompt_token_ids"][: len(history)] != history:
            raise AssertionError(f"turn {t}'s prompt does not extend turn {t - 1} token-exactly")
    for turn in turns:
        if len(turn["policy_versions"]) != len(turn["token_ids"]):
            raise AssertionError("a generated token without its policy version")
    return reward
