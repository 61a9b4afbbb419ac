"""Reward sources beyond an environment's own ``reward``: several weighted reward functions per
environment (``functions.py``), a Hugging Face reward model (``reward_model.py``), an LLM judge
behind any OpenAI-compatible endpoint (``judge.py``), a JSONL file of prompts to score with them
(``prompts.py``) and the ``reward_model`` / ``llm_judge`` environments (``environments.py``).

Nothing is imported here: each module is imported by name (the env config names them as
strings), so the optional packages (transformers, openai) load only when an entry uses them.
"""
