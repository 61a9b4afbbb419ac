#!/usr/bin/env bash
# The prepared GPU check: real-shape speed against the hardware's limits, in at most 9 minutes of
# wall time on one H100/H200, each part under its own cap so a slow part cannot starve the rest.
#
# On this machine, once:   ../shared/device/fetch-wheels.sh .whl
# Through the device tool:  run(command="bash tools/device_check.sh $OUT", carry=[".whl"],
#                               timeout_s=590)
# then copy $OUT/gpu.md and $OUT/gpu.json into benchmarks/results/.
# CPU dry run (CI: tests/unit_tests/tools/test_device_check.py): the same parts at a tiny shape on
# the CPU tier, so the script cannot rot between lendings:
#   bash tools/device_check.sh OUT --dry-run
#
# Parts, in priority order (caps in seconds):
#   a  the gpu-marked tests (90)
#   b  tools/bench_cuda.py, Llama-3.2-1B shape, bf16, 512 new tokens: megatron-core's engine at
#      batch 64 with training (140) and at batch 256 (60); our local engine at batch 64 (60)
#   c  whole GRPO steps on the 1B shape (its 128256-row output layer, fixed lengths) at L=0 and
#      L=2 (120 together)
#   d  tools/refit_bandwidth.py on the 1B shape's weights: device copy, device-host-device, gloo
#      between two processes, CUDA IPC between two processes on the GPU (45)
#   (TRL's GRPOTrainer side by side is not run: transformers and trl exceed the carried 64 MiB.)
set -uo pipefail
out=$(realpath -m "${1:?usage: tools/device_check.sh OUT_DIR [--dry-run]}")
dry=${2:-}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}  # the test of the dry run passes its own interpreter
mkdir -p "$out"
: > "$out/parts.jsonl"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONWARNINGS=ignore

part() {  # part NAME CAP COMMAND...: its output in NAME.log, its status and seconds in parts.jsonl
    local name=$1 cap=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$cap" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "{\"part\": \"$name\", \"rc\": $rc, \"cap\": $cap, \"seconds\": $(( $(date +%s) - start ))}" \
        >> "$out/parts.jsonl"
}

if [ "$dry" = "--dry-run" ]; then
    shape=(--shape tiny --cpu-dry-run)
    gen=(--prompt-len 16 --gen-tokens 16 --seq-length 64)
    train=(--batch-size 8 --micro-batch-size 4 --train-steps 1 --warmup-steps 1)
    batches=(8 16)
    tests=(--collect-only)
    model=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 192
           --num-query-groups 2 --make-vocab-size-divisible-by 512)
    steps=2 tokens=8 prompts=2 seq=64
else
    shape=(--shape llama-3.2-1b)
    gen=(--prompt-len 128 --gen-tokens 512 --seq-length 640)
    train=(--batch-size 64 --micro-batch-size 8 --train-steps 3 --warmup-steps 1)
    batches=(64 256)
    tests=()
    model=(--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --ffn-hidden-size 8192
           --num-query-groups 8 --make-vocab-size-divisible-by 128256 --bf16)
    steps=4 tokens=256 prompts=8 seq=320
fi

mapfile -t gpu_files < <(grep -rlE "mark\.gpu" tests/ --include='*.py' | sort)
part a_gpu_tests 90 "$py" -m pytest -m gpu -q -p no:cacheprovider "${tests[@]}" "${gpu_files[@]}"
part b_engine_batch${batches[0]} 140 "$py" tools/bench_cuda.py "${shape[@]}" "${gen[@]}" \
    "${train[@]}" --gen-requests "${batches[0]}"
part b_engine_batch${batches[1]} 60 "$py" tools/bench_cuda.py "${shape[@]}" "${gen[@]}" \
    --skip-training --gen-requests "${batches[1]}"
part b_local_engine_batch${batches[0]} 60 "$py" tools/bench_cuda.py "${shape[@]}" "${gen[@]}" \
    --skip-training --engine local --gen-requests "${batches[0]}"
grpo=("$py" -m megatron.trainer.launch --nproc-per-node 1 pretrain_grpo.py "${model[@]}"
      --swiglu --normalization RMSNorm --position-embedding-type rope --group-query-attention
      --disable-bias-linear --seq-length "$seq" --max-position-embeddings "$seq"
      --rl-ignore-eos --rl-default-max-tokens "$tokens" --grpo-prompts-per-step "$prompts"
      --grpo-group-size 8 --micro-batch-size 8 --train-iters "$steps" --seed 1234)
for lag in 0 2; do  # whole steps of the 1B shape, every rollout exactly $tokens tokens long
    part c_grpo_lag$lag 60 "${grpo[@]}" --rl-forced-lag $lag \
        --inference-max-requests $(( 8 * prompts * (lag + 1) )) \
        --metrics-file "$out/c_grpo_lag$lag.jsonl"
done
part d_refit_bandwidth 45 "$py" tools/refit_bandwidth.py "${shape[0]}" "${shape[1]}" --repeats 3
"$py" tools/device_report.py "$out" ${dry:+--dry-run}
