# ~1.2B-parameter GPT (24 layers x 2048, 16 heads) for GPUs, tensor-parallel over 2 GPUs.
#   source examples/rl/model_configs/gpt_1b_tp2.sh
#   python -m megatron.trainer.launch --nproc-per-node 8 pretrain_grpo.py "${MODEL_ARGS[@]}" \
#       --rl-forced-lag 2 --grpo-prompts-per-step 32 --grpo-group-size 8 \
#       --env-config examples/rl/environment_configs/mixture.yaml
# On 8 GPUs: TP 2 x DP 4. Parameters: 24 x 12 x 2048^2 (layers) + embeddings ~= 1.21e9.
# The micro-batch is per data-parallel rank: global batch (prompts x group size) must be a
# multiple of --micro-batch-size x DP, and --inference-max-requests a multiple of DP.
MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --num-attention-heads 16
    --ffn-hidden-size 8192
    --seq-length 1024
    --max-position-embeddings 1024
    --make-vocab-size-divisible-by 128
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --micro-batch-size 4
    --lr 1e-5
    --min-lr 1e-6
    --lr-warmup-iters 10
    --clip-grad 1.0
    --weight-decay 0.01
    --inference-max-requests 256
    --bf16  # CUDA tier: bf16 weights and activations, float32 main weights and gradients
    --use-distributed-optimizer  # optimizer state sharded over data-parallel ranks
)
