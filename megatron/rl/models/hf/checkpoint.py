"""Hugging Face safetensors checkpoints: load into a TP-sharded GPTModel, export from its shards.

Reading: ``model.safetensors``, or ``model.safetensors.index.json`` (``weight_map``: tensor ->
shard file) with its shards. Every tensor that ``config.json`` implies must be there with the
implied shape (``mapping.hf_tensor_shapes``); any other tensor is an error, except the rotary
``inv_freq`` buffers old Llama checkpoints carry and ``lm_head.weight`` of a tied model (which,
like transformers, is ignored in favour of the embedding). Each TP rank reads only its slices
(``safetensors`` ``get_slice``), one tensor at a time (``mapping.megatron_shard_readers``), each
file mapped only while a tensor of it is read: loading holds the model plus one converted tensor
(Qwen2.5-0.5B shape on CPU: peak RSS 2.3 GiB, 5.0 GiB when the whole shard was converted first
with the files mapped throughout). Errors are ``HFCheckpointError`` naming the file and tensor.

Writing (``export_hf``): ``config.json`` (``architectures``, ``model_type``, ``torch_dtype``),
``generation_config.json`` (BOS/EOS/PAD ids), the weights as ``model.safetensors`` or, above
``max_shard_bytes``, ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``,
and the tokenizer files of ``tokenizer_dir``. ``transformers.AutoModelForCausalLM.from_pretrained``
loads the result.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.rl.models.architecture import GPTArchitecture
from megatron.rl.models.hf.config import HFModelConfig, hf_config_dict
from megatron.rl.models.hf.errors import HFCheckpointError
from megatron.rl.models.hf.mapping import (
    hf_from_megatron,
    hf_tensor_shapes,
    megatron_shard_readers,
)

if TYPE_CHECKING:
    from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _safetensors():
    """The ``safetensors`` package (the ``hf`` extra), imported when a checkpoint is read or
    written, so runs without Hugging Face checkpoints do not need it."""
    try:
        import safetensors.torch
    except ImportError as err:
        raise HFCheckpointError(
            "Hugging Face checkpoints need the safetensors package: pip install -e '.[hf]'"
        ) from err
    return safetensors


class SafetensorsSource:
    """The tensors of an HF checkpoint directory, read lazily and in slices."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise HFCheckpointError(f"{index}: no readable weight_map ({err})") from err
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.is_file():
            with _safetensors().safe_open(single, framework="pt") as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise HFCheckpointError(
                f"{self.directory}: no weights ({SINGLE_FILE} or {INDEX_FILE}; only safetensors "
                "checkpoints are supported)"
            )
        for path in sorted(set(self.files.values())):
            if not path.is_file():
                raise HFCheckpointError(f"{path}: weight shard listed in {INDEX_FILE} is missing")
        self._shapes: dict[str, tuple[int, ...]] = {}

    def _open(self, name: str):
        """The file of ``name``, memory-mapped until the ``with`` block ends: a file is mapped
        only while one of its tensors is read, so the pages read do not stay in this process's
        resident memory for the whole load."""
        return _safetensors().safe_open(self.files[name], framework="pt")

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self.files)

    def where(self, name: str) -> Path:
        """The file that holds ``name``."""
        return self.files[name]

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Full shape of ``name``; None if the checkpoint has no such tensor."""
        if name not in self.files:
            return None
        if name not in self._shapes:
            with self._open(name) as f:
                self._shapes.update((n, tuple(f.get_slice(n).get_shape())) for n in f.keys())
        return self._shapes[name]

    def read(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """``name[start:stop]`` along ``dim`` (0 or 1), reading only that slice."""
        with self._open(name) as f:
            sl = f.get_slice(name)
            return sl[start:stop] if dim == 0 else sl[:, start:stop]


def check_hf_tensors(
    source: SafetensorsSource, arch: GPTArchitecture, vocab_size: int, family: str | None = None
) -> None:
    """Every implied tensor present with its shape and nothing unknown, else HFCheckpointError
    (``family`` names the experts of a mixture of experts)."""
    expected = hf_tensor_shapes(arch, vocab_size, family)
    for name, shape in expected.items():
        actual = source.shape(name)
        if actual is None:
            raise HFCheckpointError(
                f"{source.directory}: tensor {name!r} is missing from the checkpoint "
                f"(files: {sorted({p.name for p in source.files.values()})})"
            )
        if actual != shape:
            raise HFCheckpointError(
                f"{source.where(name)}: tensor {name!r} has shape {list(actual)}, config.json "
                f"implies {list(shape)}"
            )
    for name in source.names():
        if name in expected or _IGNORED.fullmatch(name):
            continue
        if name == "lm_head.weight" and not arch.untie_embeddings_and_output_weights:
            continue  # tied model: the embedding is the output layer (as in transformers)
        raise HFCheckpointError(
            f"{source.where(name)}: unknown tensor {name!r} (not part of a "
            f"{arch.num_layers}-layer model as config.json describes it)"
        )


def hf_weight_readers(
    model: torch.nn.Module,
    directory: str | Path,
    hf: HFModelConfig,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    ep_rank: int | None = None,
    ep_size: int | None = None,
    extra: Callable[[str], bool] | None = None,
) -> dict[str, Callable[[], torch.Tensor]]:
    """For each tensor of this TP rank's ``model`` (built from ``hf.arch``), what reads its value
    from the HF checkpoint in ``directory`` when called (the checkpoint's values, in its dtype).

    TP (and, for a mixture of experts, EP) rank and size default to megatron-core's parallel
    state. Only this rank's slices (and local experts) are read. One pipeline stage only.
    ``extra`` tells the model's own tensors that the checkpoint does not hold (a LoRA model's
    adapters). ``HFCheckpointError`` for a checkpoint that does not fit ``hf``, ``ValueError`` for a model
    that does not fit the checkpoint.
    """
    if ep_size is None:
        ep_size = _parallel_state_or("get_expert_model_parallel_world_size", 1)
    if ep_rank is None:
        ep_rank = _parallel_state_or("get_expert_model_parallel_rank", 0)
    if tp_size is None:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"load_hf_checkpoint: tp_rank={tp_rank} is not in [0, {tp_size})")
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError("load_hf_checkpoint: pipeline-parallel stages are not supported")
    source = SafetensorsSource(directory)
    check_hf_tensors(source, hf.arch, hf.vocab_size, hf.family)
    names = [
        k
        for k in model.state_dict(keep_vars=True)
        if not k.endswith("_extra_state") and not (extra and extra(k))
    ]
    fused = any(k.endswith("linear_qkv.layer_norm_weight") for k in names)
    readers = megatron_shard_readers(
        hf.arch, source, hf.vocab_size, tp_rank, tp_size, fused, hf.family, ep_rank, ep_size
    )
    if set(readers) != set(names):
        raise ValueError(
            f"model does not match {directory}/config.json: model-only tensors "
            f"{sorted(set(names) - set(readers))}, "
            f"checkpoint-only {sorted(set(readers) - set(names))}"
        )
    return readers


def load_hf_checkpoint(
    model: torch.nn.Module, directory: str | Path, hf: HFModelConfig, **layout: int
) -> None:
    """Copy an HF checkpoint's weights into this TP rank's ``model`` (built from ``hf.arch``),
    one converted tensor at a time, cast to the parameters' dtypes. ``layout``: ``tp_rank``,
    ``tp_size``, ``ep_rank``, ``ep_size`` of ``hf_weight_readers``."""
    readers = hf_weight_readers(model, directory, hf, **layout)
    targets = model.state_dict(keep_vars=True)
    tp_size = layout.get("tp_size") or parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = layout.get("tp_rank")
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    with torch.no_grad():
        for name, read in readers.items():  # one converted tensor alive at a time
            value = read()
            if tuple(targets[name].shape) != tuple(value.shape):
                raise ValueError(
                    f"model tensor {name!r} has shape {list(targets[name].shape)}, the checkpoint "
                    f"gives {list(value.shape)} at TP rank {tp_rank} of {tp_size}"
                )
            targets[name].copy_(value)


def _parallel_state_or(getter: str, default: int) -> int:
    """megatron-core's parallel-state value ``getter`` when it is initialized, else ``default``."""
    if not parallel_state.model_parallel_is_initialized():
        return default
    return getattr(parallel_state, getter)()


def gather_tensor_parallel_state_dicts(
    model: torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """The CPU state dicts of every TP rank of ``model`` (or of each rank's ``state``: a LoRA
    model's merged weights), in rank order (collective over TP).

    With expert parallelism the experts of every EP rank are gathered too (collective over EP)
    and named by their global index: the result is laid out as an EP=1 model.
    """
    state = model.state_dict() if state is None else state
    local = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    local = _gather_experts(local)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [{k: v.detach().cpu().clone() for k, v in local.items()}]
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name, tensor in local.items():
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        for rank, part in enumerate(parts):
            out[rank][name] = part.cpu()
    return out


_LOCAL_EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def _gather_experts(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``local`` with every EP rank's local experts, renamed to their global index."""
    ep = _parallel_state_or("get_expert_model_parallel_world_size", 1)
    experts = {k: v for k, v in local.items() if _LOCAL_EXPERT.fullmatch(k)}
    if ep == 1 or not experts:
        return local
    count = 1 + max(int(_LOCAL_EXPERT.fullmatch(k).group(2)) for k in experts)
    out = {k: v for k, v in local.items() if k not in experts}
    group = parallel_state.get_expert_model_parallel_group()
    for name, tensor in experts.items():
        parts = [torch.empty_like(tensor) for _ in range(ep)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        head, index, tail = _LOCAL_EXPERT.fullmatch(name).groups()
        for rank, part in enumerate(parts):
            out[f"{head}{rank * count + int(index)}{tail}"] = part
    return out


def export_hf(
    directory: str | Path,
    arch: GPTArchitecture,
    state_dicts: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    *,
    family: str,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 5 * 2**30,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> Path:
    """Write ``arch``'s weights as an HF ``family`` checkpoint in ``directory``; returns it.

    ``state_dicts``: one TP=1 state dict, or every TP rank's in rank order. ``vocab_size``: rows
    to keep (default all of ``arch.vocab_size``). ``dtype``: cast the weights (default: as
    given). Token ids default to those of the tokenizer in ``tokenizer_dir``, whose files are
    copied along.
    """
    shards = [state_dicts] if isinstance(state_dicts, Mapping) else list(state_dicts)
    vocab_size = vocab_size or arch.vocab_size
    tensors = hf_from_megatron(arch, shards, vocab_size, family)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    if tokenizer_dir is not None:
        from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer

        tokenizer = HuggingFaceTokenizer(tokenizer_dir)
        if tokenizer.vocab_size > vocab_size:
            raise HFCheckpointError(
                f"{tokenizer_dir}: the tokenizer has {tokenizer.vocab_size} tokens, more than the "
                f"{vocab_size} embedding rows being exported (vocab_size)"
            )
        bos_token_id = tokenizer.bos_id if bos_token_id is None else bos_token_id
        if eos_token_id is None:
            stops = list(tokenizer.stop_ids)
            eos_token_id = stops[0] if len(stops) == 1 else stops
        pad_token_id = tokenizer.pad_id if pad_token_id is None else pad_token_id
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config_dict(
        arch, family, vocab_size, dtype_name, bos_token_id, eos_token_id, pad_token_id
    )
    _write_json(out / "config.json", config)
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if pad_token_id is not None:
        generation["pad_token_id"] = pad_token_id
    _write_json(out / "generation_config.json", generation)
    _write_weights(out, tensors, max_shard_bytes)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, out / name)
    return out


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    """One file, or shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = tensor
        size += nbytes
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    save_file = _safetensors().torch.save_file
    if len(files) == 1:
        save_file(tensors, out / SINGLE_FILE, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, part in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file(part, out / name, metadata={"format": "pt"})
        weight_map.update({tensor: name for tensor in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def load_hf_tokenizer(directory: str | Path, hf: HFModelConfig) -> HuggingFaceTokenizer:
    """``HuggingFaceTokenizer`` of ``directory``, refused if it has more tokens than ``hf`` rows."""
    from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(directory)
    if tokenizer.vocab_size > hf.vocab_size:
        raise HFCheckpointError(
            f"{directory}: the tokenizer has {tokenizer.vocab_size} tokens, more than the "
            f"checkpoint's embedding rows (config.json vocab_size={hf.vocab_size})"
        )
    return tokenizer
