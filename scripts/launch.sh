#!/usr/bin/env bash
# `deepspeed --num_gpus ${NPROC:-2} ARGS...` on a free port: DeepSpeed's default (29500) fails with EADDRINUSE when
# another job on this host holds it. MASTER_PORT, when set, is used as given.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${MASTER_PORT:-$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
exec .venv/bin/deepspeed --master_port "$PORT" --num_gpus "${NPROC:-2}" "$@"
