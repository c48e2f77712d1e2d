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
# Where torch sees no CUDA device DeepSpeed falls back to its CPU accelerator by detection, and says so in the runner,
# the launcher and every rank ("Setting accelerator to CPU ..."); its launcher also logs "Setting
# CUDA_VISIBLE_DEVICES=0,1", meaningless on CPU. DS_ACCELERATOR=cpu names what detection would find (the ranks
# inherit it); --log_level warning keeps the launcher's warnings and errors (a rank's non-zero exit) and drops its
# INFO lines (spawn commands, world layout). A CUDA host keeps both unset. A DS_ACCELERATOR set by the caller is
# kept, and a --log_level among the arguments comes later and wins.
if [ -z "${DS_ACCELERATOR:-}" ]; then
  ACCEL=$("$PY" -c 'import torch; print("" if torch.cuda.is_available() else "cpu")' 2>/dev/null || true)
  if [ -n "$ACCEL" ]; then export DS_ACCELERATOR=$ACCEL; fi
fi
LOG_LEVEL=()
if [ "${DS_ACCELERATOR:-}" = cpu ]; then LOG_LEVEL=(--log_level warning); fi
exec "$PY" -m deepspeed.launcher.runner --master_port "$PORT" --num_gpus "${NPROC:-2}" "${LOG_LEVEL[@]}" "$@"
