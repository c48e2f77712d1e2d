#!/usr/bin/env bash
# `deepspeed --num_gpus ${NPROC:-2} ARGS...` on a free port: DeepSpeed's default (29500) fails with EADDRINUSE when
# another job on this host holds it. MASTER_PORT, when set, is used as given.
# PY: the python to launch with (default .venv/bin/python when it exists, else python3). The runner is started as
# `$PY -m deepspeed.launcher.runner` rather than through the `deepspeed` console script, which exists only where
# DeepSpeed was pip-installed with its scripts: a CUDA image given DeepSpeed by `pip install --target` (bench/gpu.sh)
# has the package on PYTHONPATH and no such script. The runner starts its workers with its own sys.executable.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PORT=${MASTER_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
exec "$PY" -m deepspeed.launcher.runner --master_port "$PORT" --num_gpus "${NPROC:-2}" "$@"
