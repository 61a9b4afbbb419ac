"""GRPO post-training of a Megatron-Core GPT with forced-lag streaming rollouts.

    python -m megatron.trainer.launch --nproc-per-node 1 pretrain_grpo.py --rl-forced-lag 2

See ``python pretrain_grpo.py --help`` for every flag and README.md for the design. An expected
error ends the run with one message and status 1 (``megatron/trainer/runtime/exits.py``).
"""

from megatron.trainer.runtime.exits import run_main
from megatron.trainer.runtime.kernels import kernel_warnings


def main() -> None:
    """Validate the flags, run on the chosen C allocator (``--cpu-allocator``), then train (the
    training libraries load only for a valid command; megatron-core's missing-kernel warnings
    are said once, in the run's header)."""
    with kernel_warnings() as missing_kernels:
        from megatron.trainer.runtime.allocator import start_on_chosen_allocator

        start_on_chosen_allocator()  # may start this command again, preloading the library
        from megatron.trainer.flags.parse import parse_args

        cfg = parse_args()
        from megatron.trainer.grpo import train

    train(cfg, missing_kernels)


if __name__ == "__main__":
    run_main(main)
