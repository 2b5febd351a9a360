#!/usr/bin/env bash
# Start one `deepserve engine --backend deepinfer` process per DP rank of this node, DeepInfer's
# process model: every rank its own process and GPU (CUDA_VISIBLE_DEVICES=<offset+rank>), all of
# them one lockstep DP group (torch.distributed over MASTER_ADDR:MASTER_PORT), each its own
# worker on port BASE_PORT+rank that the router addresses as (worker, dp_rank).
#
#   deepinfer-ranks.sh ROLE BASE_PORT DP [more `deepserve engine` flags...]
#   e.g. deepinfer-ranks.sh prefill 8300 4 --model /models --ep 4
#
# DEVICE_OFFSET (default 0): the first GPU. A rank that exits breaks the group: the others are
# stopped and the launcher exits with its status, for the supervisor to restart the whole group.
set -euo pipefail
role=$1 base=$2 dp=$3
shift 3
offset=${DEVICE_OFFSET:-0}
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500}
pids=()
for ((rank = 0; rank < dp; rank++)); do
  CUDA_VISIBLE_DEVICES=$((offset + rank)) deepserve engine --backend deepinfer --role "$role" \
    --dp "$dp" --dp-rank "$rank" --host 0.0.0.0 --port $((base + rank)) \
    --worker-id "${role}-$(hostname)-r${rank}" "$@" &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM INT
status=0
wait -n "${pids[@]}" || status=$?
kill -TERM "${pids[@]}" 2>/dev/null || true
wait || true
exit "$status"
