#!/usr/bin/env bash
# GRPO with forced lag on a Slurm allocation: one srun task per node, each a torchrun with
# --nproc-per-node ranks, joined by a c10d rendezvous on the first node. Optionally the
# environments run behind the FastAPI env server on one extra node. Requeue-safe: a restarted job
# resumes with --load from the newest checkpoint in its run directory.
#
#   sbatch --nodes=2 --gpus-per-node=8 examples/rl/slurm/train_grpo.sh \
#       --model-config examples/rl/model_configs/gpt_1b_tp2.sh \
#       --env-config examples/rl/environment_configs/mixture.yaml -- --train-iters 2000
#
# Options (before "--"; everything after it, or from the first unknown argument on, is passed to
# pretrain_grpo.py and overrides the model config):
#   --model-config FILE   bash file that sets the array MODEL_ARGS=(...), or a file of flags only
#   --env-config FILE     env-config YAML (default: the trainer's built-in task)
#   --env-server-node     serve --env-config from the env server on the allocation's last node;
#                         the other nodes train (so submit with --nodes=<training nodes + 1>)
#   --env-server-port N   port of that env server (default 8000)
#   --inference-server-port N  port of rank 0's inference server, which the env server calls
#                         (default 8001); the env server sends the key to that port of the
#                         training nodes only (--allowed-inference-url)
#   --run-dir DIR         checkpoints/, metrics.jsonl, env server log (default runs/<job>-<id>)
#   --nproc-per-node N    ranks per node (default: the node's GPUs, else 1)
#   --rdzv-port N         port of the c10d rendezvous on the first node (default 29500)
#   --python EXE          Python with the project installed (default: python)
#
# Run it from the repository root (or sbatch --chdir=REPO); relative paths are resolved there.
# The script sets --save, --load and --metrics-file itself. The job log is slurm-<job>-<id>.out
# in the submission directory (sbatch --output overrides); trainer lines carry their task (node)
# number. Slurm sends SIGUSR1 300 s before the time limit (--signal) and the job requeues itself;
# preemption with PreemptMode=REQUEUE and scontrol requeue restart it the same way. scancel
# (SIGTERM) stops the trainer after its current step: it drains, saves a checkpoint and exits 143.
# A key generated per run (MEGATRON_RL_API_KEY) guards the env server and the trainer's inference
# server.
#SBATCH --job-name=grpo
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

log() { echo "[train_grpo.sh $(date '+%F %T')] $*"; }
die() {
    log "error: $*" >&2
    exit 2
}

MODEL_CONFIG=""
ENV_CONFIG=""
ENV_SERVER_NODE=0
ENV_SERVER_PORT=8000
INFERENCE_SERVER_PORT=8001
RUN_DIR=""
NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-1}
RDZV_PORT=29500
PYTHON=python
OPTIONS=" --model-config --env-config --env-server-port --run-dir --nproc-per-node --rdzv-port "
OPTIONS+="--python --inference-server-port "
while (($#)); do
    case $1 in
        --env-server-node) ENV_SERVER_NODE=1 && shift && continue ;;
        --) shift && break ;;
        -h | --help) sed -n '2,/^#SBATCH/{/^#SBATCH/d;s/^# \{0,1\}//;p}' "$0" && exit 0 ;;
    esac
    name=${1%%=*}
    [[ $OPTIONS == *" $name "* ]] || break # the trainer's flags start here
    if [[ $1 == *=* ]]; then
        value=${1#*=} && shift
    else
        (($# >= 2)) || die "$1 needs a value"
        value=$2 && shift 2
    fi
    case $name in
        --model-config) MODEL_CONFIG=$value ;;
        --env-config) ENV_CONFIG=$value ;;
        --env-server-port) ENV_SERVER_PORT=$value ;;
        --inference-server-port) INFERENCE_SERVER_PORT=$value ;;
        --run-dir) RUN_DIR=$value ;;
        --nproc-per-node) NPROC_PER_NODE=$value ;;
        --rdzv-port) RDZV_PORT=$value ;;
        --python) PYTHON=$value ;;
    esac
done
USER_FLAGS=("$@")

[[ -n ${SLURM_JOB_ID:-} ]] || die "submit this script with sbatch (no SLURM_JOB_ID)"
[[ -f pretrain_grpo.py ]] || die "no pretrain_grpo.py in $PWD: submit from the repository root" \
    "or pass sbatch --chdir=REPO"
[[ -n $MODEL_CONFIG ]] || die "--model-config FILE is required (e.g." \
    "examples/rl/model_configs/tiny_cpu.sh)"
[[ -f $MODEL_CONFIG ]] || die "--model-config $MODEL_CONFIG: no such file"
[[ -z $ENV_CONFIG || -f $ENV_CONFIG ]] || die "--env-config $ENV_CONFIG: no such file"
((!ENV_SERVER_NODE)) || [[ -n $ENV_CONFIG ]] || die "--env-server-node needs --env-config"

# The model config: a bash file defining MODEL_ARGS=(...), or (every non-comment line starting
# with "-") a plain list of flags.
if awk '!/^[[:space:]]*(#|-|$)/ { found = 1 } END { exit !found }' "$MODEL_CONFIG"; then
    unset MODEL_ARGS
    # shellcheck source=/dev/null
    source "$MODEL_CONFIG"
    [[ "$(declare -p MODEL_ARGS 2>/dev/null)" == "declare -a"* ]] ||
        die "--model-config $MODEL_CONFIG must set the bash array MODEL_ARGS=(...)"
else
    eval "MODEL_ARGS=( $(<"$MODEL_CONFIG")"$'\n'")"
fi

# Nodes: the address Slurm itself uses for a node (NodeAddr, by default its name).
node_addr() { scontrol show node "$1" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2; }
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
TRAIN_NODES=("${NODES[@]}")
if ((ENV_SERVER_NODE)); then
    ((${#NODES[@]} >= 2)) || die "--env-server-node takes a node of its own: submit with" \
        "--nodes=<training nodes + 1> (this job has ${#NODES[@]})"
    SERVER_NODE=${NODES[-1]}
    TRAIN_NODES=("${NODES[@]:0:${#NODES[@]}-1}")
fi
NNODES=${#TRAIN_NODES[@]}
RDZV_ADDR=$(node_addr "${TRAIN_NODES[0]}")

RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
mkdir -p "$RUN_DIR"
RUN_DIR=$(cd "$RUN_DIR" && pwd)
SAVE_DIR=$RUN_DIR/checkpoints
log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: training on ${TRAIN_NODES[*]}" \
    "(${NPROC_PER_NODE} ranks each), run dir $RUN_DIR"

# Requeue (preemption, time limit): resume from the newest complete checkpoint.
RESUME_FLAGS=()
if [[ -f $SAVE_DIR/latest_checkpointed_iteration.txt ]]; then
    log "resuming from $SAVE_DIR, iteration $(<"$SAVE_DIR/latest_checkpointed_iteration.txt")"
    RESUME_FLAGS=(--load "$SAVE_DIR")
fi

# One shared key per job run: the env server and rank 0's inference server require it from every
# request, and every party reads it from the environment (never from a command line or a log).
if [[ -z ${MEGATRON_RL_API_KEY:-} ]]; then
    MEGATRON_RL_API_KEY=$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))')
fi
export MEGATRON_RL_API_KEY

SERVER_PID=""
TRAINER_PID=""
# shellcheck disable=SC2317 # run by trap
cleanup() {
    # SIGTERM to the env server's job step shuts it down gracefully (srun itself would kill it).
    [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null || return 0
    set +e # keep the job's exit status
    local step
    step=$(squeue --steps --noheader --jobs="$SLURM_JOB_ID" --format='%i %j' |
        awk '$2 == "env_server" { print $1 }')
    log "stopping the env server (step ${step:-?})"
    if [[ -n $step ]]; then
        scancel --signal=TERM "$step" 2>/dev/null || true # exits non-zero though it signals
    else
        kill -TERM "$SERVER_PID" 2>/dev/null || true
    fi
    (sleep 30 && kill -KILL "$SERVER_PID" 2>/dev/null) &
    wait "$SERVER_PID" || true
    kill $! 2>/dev/null || true
}
trap cleanup EXIT
# shellcheck disable=SC2317 # run by trap
requeue() {
    log "SIGUSR1 (time limit close): requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
}
trap requeue USR1

ENV_FLAGS=()
if ((ENV_SERVER_NODE)); then
    url="http://$(node_addr "$SERVER_NODE"):$ENV_SERVER_PORT"
    log "env server on $SERVER_NODE ($url), log $RUN_DIR/env_server.log"
    # The env server sends the job's key to rank 0's inference server only: whichever training
    # node rank 0 lands on, its URL is that node's host name (as the trainer reports it) and
    # the fixed port.
    mapfile -t TRAIN_HOSTS < <(IFS=, && srun --nodes="$NNODES" --ntasks="$NNODES" \
        --ntasks-per-node=1 --nodelist="${TRAIN_NODES[*]}" hostname | sort -u)
    ALLOWED=()
    for host in "${TRAIN_HOSTS[@]}"; do
        ALLOWED+=(--allowed-inference-url "http://$host:$INFERENCE_SERVER_PORT")
    done
    srun --nodes=1 --ntasks=1 --nodelist="$SERVER_NODE" --job-name=env_server \
        --output="$RUN_DIR/env_server.log" --open-mode=append \
        "$PYTHON" -m megatron.rl.server.env_server --env-config "$ENV_CONFIG" \
        --host 0.0.0.0 --port "$ENV_SERVER_PORT" "${ALLOWED[@]}" &
    SERVER_PID=$!
    "$PYTHON" examples/rl/slurm/remote_env_config.py --url "$url" --server-pid "$SERVER_PID" \
        --output "$RUN_DIR/remote_envs.yaml"
    # Remote environments generate through the inference server of rank 0, wherever it runs.
    ENV_FLAGS=(--env-config "$RUN_DIR/remote_envs.yaml" --rl-inference-server-host 0.0.0.0
        --rl-inference-server-port "$INFERENCE_SERVER_PORT")
elif [[ -n $ENV_CONFIG ]]; then
    ENV_FLAGS=(--env-config "$ENV_CONFIG")
fi

# Later flags win: defaults < model config < env < user flags < run directory.
FLAGS=(--rl-forced-lag 2 --save-interval 100 "${MODEL_ARGS[@]}" "${ENV_FLAGS[@]}")
FLAGS+=("${USER_FLAGS[@]}" --save "$SAVE_DIR" --metrics-file "$RUN_DIR/metrics.jsonl")
FLAGS+=("${RESUME_FLAGS[@]}")
log "pretrain_grpo.py ${FLAGS[*]}"

(
    IFS=,
    exec srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
        --nodelist="${TRAIN_NODES[*]}" --kill-on-bad-exit=1 --label \
        "$PYTHON" -m megatron.trainer.launch --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
        --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ADDR:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
        pretrain_grpo.py "${FLAGS[@]}"
) &
TRAINER_PID=$!
# Wait in the background so that SIGUSR1 is handled while the trainer runs.
status=0
while true; do
    wait "$TRAINER_PID" && status=0 || status=$?
    kill -0 "$TRAINER_PID" 2>/dev/null || break
done
log "trainer exited with status $status"
exit "$status"
