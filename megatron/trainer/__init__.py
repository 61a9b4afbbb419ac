"""The Megatron GRPO trainer: flags, the training loop, checkpoints, launch and serving."""

from megatron.rl import deferred_compile

deferred_compile.install()
