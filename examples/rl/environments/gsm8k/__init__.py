"""GSM8K example environment: GSM8K-format math from local JSONL/Parquet files (read with
``datasets``), scored with ``math-verify`` (``pip install -e '.[math]'``).

Use it as ``agent_type: examples.rl.environments.gsm8k:GSM8KEnvironment`` with
``agent_args: {data_files: FILE.jsonl}``. ``gsm8k_sample.jsonl`` next to this file holds 20
problems written for this repository in GSM8K's format. See ``environment.py`` for the prompt and
the reward, ``answers.py`` for answer extraction and verification, ``dataset.py`` for reading.
"""

from examples.rl.environments.gsm8k.answers import (
    extract_answer,
    stated_answer,
    states_answer,
    verify_answer,
)
from examples.rl.environments.gsm8k.dataset import (
    GSM8KDatasetError,
    GSM8KRecord,
    final_answer,
    load_records,
)
from examples.rl.environments.gsm8k.environment import GSM8KArgs, GSM8KEnvironment

__all__ = [
    "GSM8KArgs",
    "GSM8KDatasetError",
    "GSM8KEnvironment",
    "GSM8KRecord",
    "extract_answer",
    "final_answer",
    "load_records",
    "stated_answer",
    "states_answer",
    "verify_answer",
]
