"""Agents: the environment side of RL (prompts, multi-turn interaction, rewards)."""
