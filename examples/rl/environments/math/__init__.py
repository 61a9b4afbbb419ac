"""Math example environment (local JSONL of {question, answer}; boxed-answer scoring).

Use it as ``agent_type: examples.rl.environments.math:MathEnvironment`` with
``agent_args: {path: FILE.jsonl}``. ``tiny_arithmetic.jsonl`` next to this file is a small fixture
written in the built-in character tokenizer's alphabet. See ``environment.py`` for the exact
reward, ``answers.py`` for answer extraction and normalization, ``dataset.py`` for the file format.
"""

from examples.rl.environments.math.answers import (
    answers_match,
    extract_boxed,
    final_answer,
    normalize_answer,
)
from examples.rl.environments.math.dataset import (
    MathDatasetError,
    MathRecord,
    load_jsonl,
)
from examples.rl.environments.math.environment import MathArgs, MathEnvironment

__all__ = [
    "MathArgs",
    "MathDatasetError",
    "MathEnvironment",
    "MathRecord",
    "answers_match",
    "extract_boxed",
    "final_answer",
    "load_jsonl",
    "normalize_answer",
]
