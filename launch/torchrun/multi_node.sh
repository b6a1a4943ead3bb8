#!/usr/bin/env bash
# Many machines, one job: run this same command on every node.
#
#   NNODES=4   RDZV_ENDPOINT=node0:29400 RDZV_ID=exp1-try1 launch/torchrun/multi_node.sh  # static: exactly 4 nodes
#   NNODES=2:8 RDZV_ENDPOINT=node0:29400 RDZV_ID=exp1-try1 launch/torchrun/multi_node.sh  # elastic: 2 to 8 nodes
#
# The arguments are torchrun's: the training script, or -m and a module, and their arguments
# (default: -m elastictrain train). Environment:
#   RDZV_ENDPOINT   host:port of the c10d rendezvous store, reachable from every node; the node
#                   whose address matches host runs the store (required)
#   RDZV_ID         one id shared by every node of this job, new for every job (required)
#   RDZV_BACKEND    elastictrain-c10d (default: torch's c10d, and a lost node may come back),
#                   c10d, or elastictrain-etcd-v2 with RDZV_ENDPOINT=<etcd host>:2379
#   NNODES          N (static) or MIN:MAX (elastic); default 1:4
#   NPROC_PER_NODE  workers per node (default gpu: one per visible GPU; a number on CPU)
#   MAX_RESTARTS    restarts of the whole worker group before the job fails (default 3)
#   SHUTDOWN_TIMEOUT_S  seconds between the forwarded signal and SIGKILL (default 60)
#   TORCHRUN, TORCHRUN_ARGS  the torchrun command and more torchrun flags (split on spaces),
#                   e.g. TORCHRUN_ARGS="--local-addr=10.0.0.5 --rdzv-conf=is_host=1"
# See launch/README.md for what each flag does.
set -euo pipefail

: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the rendezvous store (a node every node can reach)}"
: "${RDZV_ID:?set RDZV_ID to an id shared by every node of this job and new for every job}"
if [ "$#" -eq 0 ]; then
    set -- -m elastictrain train
fi

# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
exec "${TORCHRUN:-torchrun}" \
    --nnodes="${NNODES:-1:4}" \
    --nproc-per-node="${NPROC_PER_NODE:-gpu}" \
    --rdzv-backend="${RDZV_BACKEND:-elastictrain-c10d}" \
    --rdzv-endpoint="$RDZV_ENDPOINT" \
    --rdzv-id="$RDZV_ID" \
    --max-restarts="${MAX_RESTARTS:-3}" \
    --shutdown-timeout="${SHUTDOWN_TIMEOUT_S:-60}" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    ${TORCHRUN_ARGS:-} \
    "$@"
