#!/bin/sh
# One host of a dflash-trainer group: run it on every host with the same NNODES and MASTER_ADDR and
# this host's NODE_RANK (0 on the host that serves the job API). Extra arguments go to `serve`.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0.example.com sh docker/multihost.sh --config /etc/dflash-trainer/dflash.toml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=host0.example.com sh docker/multihost.sh --config /etc/dflash-trainer/dflash.toml
#
# In the image: docker run --gpus all --network host -e NNODES -e NODE_RANK -e MASTER_ADDR -e DFLASH_AUTH_TOKEN \
#   -v /srv/dflash:/var/lib/dflash-trainer --entrypoint sh IMAGE /opt/dflash-trainer/docker/multihost.sh --config ...
# (the hosts reach each other on MASTER_PORT and on the ports NCCL or gloo pick: host networking is simplest).
set -eu
: "${NNODES:?set NNODES, the number of hosts}"
: "${NODE_RANK:?set NODE_RANK, this host's rank (0 serves the job API)}"
: "${MASTER_ADDR:?set MASTER_ADDR, the address of the host with NODE_RANK=0}"
MASTER_PORT="${MASTER_PORT:-29400}"
# A lost rank ends the other ranks' daemons; rank 0 keeps serving (its /healthz says failed, its
# /livez answers 503) until it is restarted. Restart every host's script, rank 0's included (e.g. a
# watchdog that restarts rank 0 when /livez fails, and systemd Restart=always for the others): the
# group meets again and a job the loss failed resumes from its last checkpoint.
exec torchrun --nnodes "$NNODES" --nproc-per-node 1 --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts 0 \
    -m service.cli serve --host "${DFLASH_HOST:-0.0.0.0}" "$@"
