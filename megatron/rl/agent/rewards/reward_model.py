"""A Hugging Face reward model (``AutoModelForSequenceClassification``) as a reward function.

Options (``RewardModelArgs``, the ``args`` of ``function: reward_model`` or the ``agent_args`` of
``agent_type: reward_model``)::

    model_dir: /models/rm      # a local directory: config.json, weights, tokenizer (no download)
    batch_size: 8              # completions per forward pass
    device: cpu                # or cuda, cuda:1, ...
    dtype: float32             # bfloat16, float16
    format: auto               # chat (the model's chat template), plain, auto (chat if it has one)
    plain_template: "{prompt}{completion}"
    transform: logit           # sigmoid, softmax (over the labels)
    label_index: 0             # which output is the score
    max_length: 2048           # tokens; longer texts lose their beginning (the completion stays)

Each group's completions are scored together: ceil(group size / batch_size) forward passes on
texts padded to the longest of their batch. Batches never mix groups, so a rollout's score
depends only on its group (a run stays reproducible; mixing groups as they arrive would make the
padding, and so the float rounding, depend on timing). Loading and every forward pass run on one
worker thread of the model's own (``torch.inference_mode``, on ``device``), so the event loop
that drives generation is never blocked; the model loads when the environment starts (rank 0 of
the trainer, or the env server), not when the config is read.

The config's checks (at start-up, naming the field): ``model_dir`` is a local directory with a
``config.json`` transformers reads, a weights file and a tokenizer that loads; ``label_index``
is below the model's ``num_labels``; ``softmax`` needs two labels or more.

Formatting: ``chat`` renders the problem's messages (or its text prompt as a user message) and
the completion as the assistant's message with the reward model's chat template; ``plain`` is
``plain_template`` with ``{prompt}`` (the prompt the policy saw, its chat template included) and
``{completion}`` replaced, tokenized with the model tokenizer's special tokens.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from megatron.rl.agent.api import RewardSourceError
from megatron.rl.agent.rewards.base import RewardFunction, Sample, Value
from megatron.rl.wire import MAX_TOKENS

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True)
class ModelInfo:
    """What the config's checks read from a reward model's directory."""

    num_labels: int
    chat_template: bool


_inspected: dict[str, ModelInfo] = {}


def inspect_model_dir(path: str) -> ModelInfo:
    """Check that ``path`` holds a reward model transformers can load, without loading its
    weights; ValueError saying what is wrong."""
    directory = Path(path)
    if not directory.is_dir():
        hint = ""
        if not directory.is_absolute() and path.count("/") == 1 and not directory.exists():
            hint = (
                f" (nothing is downloaded: fetch a Hub model first, e.g. `hf download {path} "
                "--local-dir DIR`, and give DIR)"
            )
        raise ValueError(f"{path!r} is not a local directory{hint}")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{path!r} has no config.json")
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{path!r} has no weights ({', '.join(WEIGHT_FILES)})")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"{path!r}: cannot read config.json: {_one_line(exc)}") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"{path!r}: cannot load its tokenizer: {_one_line(exc)}") from None
    info = ModelInfo(int(config.num_labels), bool(getattr(tokenizer, "chat_template", None)))
    _inspected[str(directory.resolve())] = info
    return info


def _one_line(exc: BaseException, limit: int = 500) -> str:
    """``Type: message`` on one line (transformers' messages span several), at most ``limit``
    characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RewardModelArgs(BaseModel):
    """Options of a reward model (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str = Field(
        description="Local directory of an AutoModelForSequenceClassification checkpoint with "
        "its tokenizer (nothing is downloaded)."
    )
    batch_size: int = Field(8, ge=1, le=4096, description="Completions per forward pass.")
    device: str = Field("cpu", description="torch device of the model: cpu, cuda, cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32")
    format: Literal["auto", "chat", "plain"] = Field(
        "auto", description="chat template, plain text, or chat when the tokenizer has one."
    )
    plain_template: str = Field(
        "{prompt}{completion}", description="The text of format plain ({prompt}, {completion})."
    )
    transform: Literal["logit", "sigmoid", "softmax"] = Field(
        "logit", description="The score: the label's logit, its sigmoid, or its softmax share."
    )
    label_index: int = Field(0, ge=0, description="Which output label is the score.")
    max_length: int = Field(2048, ge=2, le=MAX_TOKENS, description="Most tokens per text.")

    @field_validator("model_dir")
    @classmethod
    def _readable(cls, value: str) -> str:
        inspect_model_dir(value)
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        import torch

        try:
            torch.device(value)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"not a torch device: {err}") from None
        return value

    @field_validator("plain_template")
    @classmethod
    def _has_completion(cls, value: str) -> str:
        if "{completion}" not in value:
            raise ValueError("must contain '{completion}'")
        return value

    @field_validator("format")
    @classmethod
    def _chat_needs_template(cls, value: str, info: ValidationInfo) -> str:
        model = _info(info)
        if value == "chat" and model is not None and not model.chat_template:
            raise ValueError("the reward model's tokenizer has no chat template (use plain)")
        return value

    @field_validator("transform")
    @classmethod
    def _softmax_needs_labels(cls, value: str, info: ValidationInfo) -> str:
        model = _info(info)
        if value == "softmax" and model is not None and model.num_labels < 2:
            raise ValueError("softmax needs a model with two labels or more (it has one)")
        return value

    @field_validator("label_index")
    @classmethod
    def _label_exists(cls, value: int, info: ValidationInfo) -> int:
        model = _info(info)
        if model is not None and value >= model.num_labels:
            raise ValueError(f"the reward model has {model.num_labels} label(s)")
        return value


def _info(info: ValidationInfo) -> ModelInfo | None:
    path = info.data.get("model_dir")
    return None if path is None else _inspected.get(str(Path(path).resolve()))


class RewardModel:
    """The loaded model, its tokenizer and its worker thread."""

    def __init__(self, args: RewardModelArgs, where: str = "agent_args") -> None:
        self.args = args
        self.where = where
        """Where the options are in the config (load errors name their fields)."""
        self.forward_sizes: list[int] = []
        """The rows of every forward pass so far."""
        self.threads: set[int] = set()
        """The threads that ran them (one: the worker)."""
        self._executor: ThreadPoolExecutor | None = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._chat = False
        self._batch_size = args.batch_size

    async def _in_worker(self, fn, *args):
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward-model")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def load(self) -> None:
        """Load the weights on the worker thread (once)."""
        await self._in_worker(self._load)

    async def close(self) -> None:
        """Drop the model and stop the worker thread (a later call loads it again)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)
        self._model = self._tokenizer = None

    async def scores(self, samples: list[Sample]) -> list[float]:
        """The transformed score of each sample, computed on the worker thread."""
        texts = [(s.prompt, _messages(s), s.completion) for s in samples]
        return await self._in_worker(self._scores, texts)

    def _load(self) -> None:
        if self._model is not None:
            return
        import torch
        import transformers

        a = self.args
        device = torch.device(a.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RewardSourceError(
                f"field '{self.where}.device': {a.device}: CUDA is not available"
            )
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                a.model_dir, local_files_only=True
            )
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                a.model_dir, local_files_only=True, dtype=getattr(torch, a.dtype)
            )
        except Exception as exc:
            raise RewardSourceError(
                f"field '{self.where}.model_dir' ({a.model_dir}): cannot load the reward model: "
                f"{_one_line(exc)}"
            ) from None
        tokenizer.truncation_side = "left"  # keep the completion
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.pad_token_id is not None:
            model.config.pad_token_id = tokenizer.pad_token_id  # where the last real token is
        else:
            self._batch_size = 1  # nothing to pad with: one text per forward pass
        self._chat = a.format == "chat" or (a.format == "auto" and bool(tokenizer.chat_template))
        self._model, self._tokenizer = model.to(device).eval(), tokenizer

    def _text(self, prompt: str, messages: list[dict] | None, completion: str) -> str:
        if self._chat:
            conversation = (
                messages if messages is not None else [{"role": "user", "content": prompt}]
            )
            conversation = [*conversation, {"role": "assistant", "content": completion}]
            return self._tokenizer.apply_chat_template(conversation, tokenize=False)
        return self.args.plain_template.replace("{prompt}", prompt).replace(
            "{completion}", completion
        )

    def _scores(self, texts: list[tuple[str, list[dict] | None, str]]) -> list[float]:
        import torch

        self._load()
        self.threads.add(threading.get_ident())
        a, tokenizer = self.args, self._tokenizer
        device = next(self._model.parameters()).device
        rendered = [self._text(*t) for t in texts]
        scores: list[float] = []
        for start in range(0, len(rendered), self._batch_size):
            chunk = rendered[start : start + self._batch_size]
            encoded = tokenizer(
                chunk,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=a.max_length,
                add_special_tokens=not self._chat,  # the chat template has them
            )
            encoded = {k: v.to(device) for k, v in encoded.items()}
            with torch.inference_mode():
                logits = self._model(**encoded).logits.float()  # (B, num_labels)
            if a.transform == "softmax":
                values = torch.softmax(logits, dim=-1)[:, a.label_index]
            elif a.transform == "sigmoid":
                values = torch.sigmoid(logits[:, a.label_index])
            else:
                values = logits[:, a.label_index]
            scores += values.tolist()
            self.forward_sizes.append(len(chunk))
        return scores


def _messages(sample: Sample) -> list[dict] | None:
    if sample.problem.messages is None:
        return None
    return [{"role": m.role, "content": m.content} for m in sample.problem.messages]


class RewardModelFunction(RewardFunction):
    """``reward_model``: the score of each completion by a reward model."""

    def __init__(self, args: RewardModelArgs, where: str = "agent_args") -> None:
        self.model = RewardModel(args, where)

    async def astart(self) -> None:
        """Load the model (on its worker thread) before the first group."""
        await self.model.load()

    async def aclose(self) -> None:
        await self.model.close()

    async def score(self, samples: list[Sample]) -> list[Value]:
        return list(await self.model.scores(samples))
