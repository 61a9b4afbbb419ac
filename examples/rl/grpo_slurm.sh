#!/usr/bin/env bash
# Launch GRPO with forced lag on a SLURM allocation: one torchrun per node, one rank per GPU.
#   sbatch --nodes=2 --gpus-per-node=8 examples/rl/grpo_slurm.sh --tensor-model-parallel-size 2
#SBATCH --job-name=grpo
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
RUN_DIR=${RUN_DIR:-runs/grpo-$SLURM_JOB_ID}
mkdir -p "$RUN_DIR"

srun torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
    pretrain_grpo.py \
    --rl-forced-lag 2 \
    --metrics-file "$RUN_DIR/metrics.jsonl" \
    --save "$RUN_DIR/checkpoints" --save-interval 100 \
    "$@"
