"""The RL library: environments, rollouts, GRPO math, inference engines, refit (no global args)."""

from megatron.rl import deferred_compile

deferred_compile.install()
