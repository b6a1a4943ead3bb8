#!/usr/bin/env bash
# One machine, one worker per GPU (or NPROC_PER_NODE workers), restarts on failure.
#
#   launch/torchrun/single_node.sh                                  # the default job
#   launch/torchrun/single_node.sh -m elastictrain train --config my.yaml train.max_epochs=20
#   launch/torchrun/single_node.sh my_train.py snapshot.durable.url=s3://bucket/run
#
# The arguments are torchrun's: the training script, or -m and a module, and their arguments.
# Environment (all optional): NPROC_PER_NODE (default gpu: one worker per visible GPU; a number
# on CPU), MAX_RESTARTS (3), SHUTDOWN_TIMEOUT_S (60), TORCHRUN (torchrun), TORCHRUN_ARGS (more
# torchrun flags, split on spaces). See launch/README.md for what each flag does.
set -euo pipefail

if [ "$#" -eq 0 ]; then
    set -- -m elastictrain train
fi

# Port 0: the agent picks a free port for its rendezvous store, so two jobs never clash.
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
exec "${TORCHRUN:-torchrun}" \
    --nproc-per-node="${NPROC_PER_NODE:-gpu}" \
    --rdzv-backend=c10d \
    --rdzv-endpoint=127.0.0.1:0 \
    --max-restarts="${MAX_RESTARTS:-3}" \
    --shutdown-timeout="${SHUTDOWN_TIMEOUT_S:-60}" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    ${TORCHRUN_ARGS:-} \
    "$@"
