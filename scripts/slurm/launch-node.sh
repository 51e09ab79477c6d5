#!/usr/bin/env bash
# One node's `accelerate launch`, with the rendezvous read from SLURM. Run it once per node, inside a job
# step with one task per node (SLURM_NODEID only exists there), e.g. from an sbatch script:
#
#   srun --ntasks-per-node=1 scripts/slurm/launch-node.sh \
#       --config_file configs/accelerate/deepspeed_zero2.yaml -m pods train --config gsm8k-8gpu-pods ...
#
# It runs `accelerate launch` with these options first, then its own arguments as given:
#   --num_machines       $SLURM_NNODES
#   --machine_rank       $SLURM_NODEID
#   --num_processes      nodes x GPUs per node (accelerate counts processes over all machines)
#   --main_process_ip    the first host of $SLURM_JOB_NODELIST (`scontrol show hostnames`)
#   --main_process_port  20000 + the job id modulo 10000 (two jobs sharing a node do not collide)
# Environment overrides: GPUS_PER_NODE (default $SLURM_GPUS_ON_NODE), MAIN_PROCESS_IP (e.g. the address
# of a faster interface), MAIN_PROCESS_PORT. With --print as the first argument it prints the command
# (shell-quoted) instead of running it.
set -euo pipefail

fail() {
    echo "launch-node.sh: $*" >&2
    exit 2
}

rendezvous_options() {
    [ -n "${SLURM_NODEID:-}" ] || fail "SLURM_NODEID is not set: run this under srun inside a SLURM job, one task per node"
    local nodes=${SLURM_NNODES:?}
    local tasks=${SLURM_NTASKS:-$nodes}
    [ "$tasks" = "$nodes" ] ||
        fail "$tasks tasks on $nodes nodes: run one task per node (srun --ntasks-per-node=1); accelerate starts each node's processes"
    local gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
    [[ $gpus =~ ^[1-9][0-9]*$ ]] ||
        fail "GPUs per node unknown ('$gpus'): ask for them with --gpus-per-node=N, or set GPUS_PER_NODE"
    local host=${MAIN_PROCESS_IP:-}
    if [ -z "$host" ]; then
        host=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n 1)
        [ -n "$host" ] || fail "no host in SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST'"
    fi
    local port=${MAIN_PROCESS_PORT:-$((20000 + ${SLURM_JOB_ID:?} % 10000))}
    printf '%s\n' --num_machines "$nodes" --machine_rank "$SLURM_NODEID" --num_processes "$((nodes * gpus))" \
        --main_process_ip "$host" --main_process_port "$port"
}

print=0
if [ "${1:-}" = --print ]; then
    print=1
    shift
fi
options=$(rendezvous_options)
mapfile -t options <<<"$options"
command=(accelerate launch "${options[@]}" "$@")
if [ $print = 1 ]; then
    printf '%q ' "${command[@]}"
    echo
else
    exec "${command[@]}"
fi
