# ~8B-parameter GPT (40 layers x 4096, 32 heads) for one 8-GPU node, tensor-parallel over 8 GPUs.
#   source examples/rl/model_configs/gpt_8b_tp8.sh
#   python -m megatron.trainer.launch --nproc-per-node 8 pretrain_grpo.py "${MODEL_ARGS[@]}" \
#       --rl-forced-lag 2 --env-config examples/rl/environment_configs/mixture.yaml
# Across nodes (data parallel over nodes) use the SLURM launcher in examples/rl/ with this file.
# Parameters: 40 x (4 x 4096^2 + 2 x 4096 x 16384) (layers) + embeddings ~= 8.06e9.
# Runs on the CUDA tier (refused on CPU: --bf16, --use-distributed-optimizer). Pipeline
# parallelism works there too (e.g. --tensor-model-parallel-size 4 --pipeline-model-parallel-size
# 2). Memory of the model states: bf16 weights (2 B/param), float32 gradients (4 B) and float32
# main weights + Adam moments (12 B, sharded over the data-parallel ranks by
# --use-distributed-optimizer): ~18 B x 8e9 / 8 GPUs ~= 18 GB per GPU at DP 1, before activations
# and the KV cache of the rollout engine.
MODEL_ARGS=(
    --num-layers 40
    --hidden-size 4096
    --num-attention-heads 32
    --ffn-hidden-size 16384
    --seq-length 1024
    --max-position-embeddings 1024
    --make-vocab-size-divisible-by 128
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 1
    --micro-batch-size 2
    --lr 1e-6
    --min-lr 1e-7
    --lr-warmup-iters 10
    --clip-grad 1.0
    --weight-decay 0.01
    --inference-max-requests 64
    --bf16  # CUDA tier: bf16 weights and activations, float32 main weights and gradients
    --use-distributed-optimizer  # optimizer state sharded over data-parallel ranks
)
