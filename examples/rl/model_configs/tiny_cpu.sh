# Tiny GPT for a laptop CPU and CI: the defaults of pretrain_grpo.py, spelled out (~0.1M params).
#   source examples/rl/model_configs/tiny_cpu.sh
#   python -m megatron.trainer.launch --nproc-per-node 1 pretrain_grpo.py "${MODEL_ARGS[@]}" \
#       --rl-forced-lag 2 --env-config examples/rl/environment_configs/countdown.yaml
# Prompt + generation budget must fit --seq-length (32 tokens: every example env config fits).
MODEL_ARGS=(
    # shape: 2 layers x 64 wide, 4 heads, MLP 4x; learned positions; character vocabulary
    --num-layers 2
    --hidden-size 64
    --num-attention-heads 4
    --ffn-hidden-size 256
    --seq-length 32
    --max-position-embeddings 32
    --make-vocab-size-divisible-by 128
    # parallelism (CPU: TP and DP over gloo; pipeline parallelism is CUDA-only)
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    # size-dependent optimization: 64 rollouts per step in 2 micro-batches
    --micro-batch-size 32
    --lr 3e-3
    --min-lr 3e-4
    --clip-grad 1.0
    --inference-max-requests 64
)
