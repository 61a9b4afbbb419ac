"""GRPO post-training of a Megatron-Core GPT with forced-lag streaming rollouts.

    torchrun --nproc-per-node 1 pretrain_grpo.py --rl-forced-lag 2

See ``python pretrain_grpo.py --help`` for every flag and README.md for the design.
"""

from megatron.trainer.kernels import kernel_warnings

with kernel_warnings() as missing_kernels:  # said once, in the run's header
    from megatron.trainer.arguments import parse_args
    from megatron.trainer.grpo import train

if __name__ == "__main__":
    train(parse_args(), missing_kernels)
