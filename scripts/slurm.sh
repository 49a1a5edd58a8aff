#!/usr/bin/env bash
# PolyBeast across a Slurm allocation: the first ENV_NODES nodes run environment
# servers (python -m polybeast_env), the rest run learner ranks under torchrun,
# which average their gradients on torch.distributed (beast/distributed.py).
#
#   sbatch --nodes=3 scripts/slurm.sh --env ALE/Pong-v5 --xpid pong-3nodes
#
# Every argument goes to polybeast. Settings (environment variables, with defaults):
#   ENV_NODES=1              nodes that only step environments
#   SERVERS_PER_NODE=16      polybeast_env processes per environment node
#   GPUS_PER_NODE=1          learner ranks per learner node (one per GPU)
#   ENV_PORT=4000            servers listen on ENV_PORT..ENV_PORT+SERVERS_PER_NODE-1
#   MASTER_PORT=29500        torchrun's rendezvous, on the first learner node
#   ENV_LISTEN=0.0.0.0       the address the servers listen on (every interface)
#   TLS_DIR=                 a directory every node reads (a shared filesystem): given, the
#                            job makes a CA and certificates in TLS_DIR/<job id> (python -m
#                            beast.tls, kept for a requeue) and the servers talk TLS, admitting
#                            only learners with the job's certificate
#   PYTHON=python
# The servers step the environment of polybeast's --env (CartPole-v1 without one).
# Ports that must be open between the nodes: ENV_PORT.. on the environment nodes
# (learners connect to them), MASTER_PORT on the first learner node, and the
# ephemeral ports gloo/NCCL open between learner nodes. Without TLS_DIR the env
# servers' gRPC is neither authenticated nor encrypted, and torch.distributed's
# traffic never is: keep the allocation on a network you trust.
#
#SBATCH --job-name=polybeast
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=24:00:00
set -euo pipefail

ENV_NODES="${ENV_NODES:-1}"
SERVERS_PER_NODE="${SERVERS_PER_NODE:-16}"
GPUS_PER_NODE="${GPUS_PER_NODE:-1}"
ENV_PORT="${ENV_PORT:-4000}"
MASTER_PORT="${MASTER_PORT:-29500}"
ENV_LISTEN="${ENV_LISTEN:-0.0.0.0}"
PYTHON="${PYTHON:-python}"

# The servers must step what the learners learn: polybeast's --env, found in the arguments.
BEAST_ENV=CartPole-v1
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --env=*) BEAST_ENV="${args[i]#--env=}" ;;
        --env) BEAST_ENV="${args[i + 1]:-}" ;;
    esac
done

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
ENV_HOSTS=("${NODES[@]:0:ENV_NODES}")
LEARNER_HOSTS=("${NODES[@]:ENV_NODES}")
if [ "${#LEARNER_HOSTS[@]}" -lt 1 ]; then
    echo "slurm.sh: ${#NODES[@]} nodes leave none for the learner after ENV_NODES=$ENV_NODES;" \
         "ask sbatch for more --nodes or lower ENV_NODES." >&2
    exit 2
fi

# Every server's address, host by host; each learner rank takes its share
# (rank r of W: addresses r, r+W, r+2W, ...), so the list must hold at least W.
ADDRESSES=()
for host in "${ENV_HOSTS[@]}"; do
    for ((i = 0; i < SERVERS_PER_NODE; i++)); do ADDRESSES+=("$host:$((ENV_PORT + i))"); done
done
SERVER_ADDRESSES=$(IFS=,; echo "${ADDRESSES[*]}")

# Arguments quoted for bash -c; none at all for an empty list (printf would give '').
quote() { if [ $# -gt 0 ]; then printf '%q ' "$@"; fi; }

# TLS: certificates made out to the env nodes' names, which the learners dial.
SERVER_TLS=()
LEARNER_TLS=()
if [ -n "${TLS_DIR:-}" ]; then
    CERTS="$TLS_DIR/${SLURM_JOB_ID:-job}"
    if [ ! -f "$CERTS/server.pem" ]; then
        "$PYTHON" -m beast.tls --out "$CERTS" --server_hosts "$(IFS=,; echo "${ENV_HOSTS[*]}")" \
            >/dev/null
    fi
    SERVER_TLS=(--tls_cert "$CERTS/server.pem" --tls_key "$CERTS/server.key"
                --tls_client_ca "$CERTS/ca.pem")
    LEARNER_TLS=(--tls_ca "$CERTS/ca.pem" --tls_cert "$CERTS/learner.pem"
                 --tls_key "$CERTS/learner.key")
fi
RANKS=$(( ${#LEARNER_HOSTS[@]} * GPUS_PER_NODE ))
if [ "${#ADDRESSES[@]}" -lt "$RANKS" ]; then
    echo "slurm.sh: ${#ADDRESSES[@]} env servers for $RANKS learner ranks; each rank needs" \
         "one at least: raise SERVERS_PER_NODE or ENV_NODES." >&2
    exit 2
fi

# Environment servers: in the background, listening on every interface of their
# node. Each node gets its own --seed, so no two nodes step the same episodes.
ENV_NODELIST=$(IFS=,; echo "${ENV_HOSTS[*]}")
srun --nodes="$ENV_NODES" --ntasks="$ENV_NODES" --ntasks-per-node=1 --nodelist="$ENV_NODELIST" \
    bash -c "exec $PYTHON -m polybeast_env --env '$BEAST_ENV' --num_servers $SERVERS_PER_NODE \
        --address tcp:$ENV_LISTEN:$ENV_PORT --seed \$((1000 * (SLURM_PROCID + 1))) \
        $(quote "${SERVER_TLS[@]}")" &
SERVERS=$!
trap 'kill $SERVERS 2>/dev/null || true' EXIT

# Learner ranks: one torchrun per node; node_rank is the task's place in this step.
# The learners wait up to --connect_timeout_s for the servers to come up.
LEARNER_NODELIST=$(IFS=,; echo "${LEARNER_HOSTS[*]}")
srun --nodes="${#LEARNER_HOSTS[@]}" --ntasks="${#LEARNER_HOSTS[@]}" --ntasks-per-node=1 \
    --nodelist="$LEARNER_NODELIST" \
    bash -c "exec $PYTHON -m torch.distributed.run --nnodes=${#LEARNER_HOSTS[@]} \
        --node_rank=\$SLURM_PROCID --nproc_per_node=$GPUS_PER_NODE \
        --master_addr=${LEARNER_HOSTS[0]} --master_port=$MASTER_PORT \
        -m polybeast --server_addresses '$SERVER_ADDRESSES' \
        $(quote "${LEARNER_TLS[@]}") $(quote "$@")"
