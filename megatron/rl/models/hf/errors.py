"""The one error type of Hugging Face checkpoint handling."""

from __future__ import annotations


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint or tokenizer directory cannot be used as it is.

    The message names the file (``config.json``, a ``.safetensors`` shard, the tokenizer
    directory) and the field or tensor at fault.
    """
