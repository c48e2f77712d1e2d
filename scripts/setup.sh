#!/usr/bin/env bash
# Create .venv and install the project. torch is pinned first (TORCH_SPEC, default the CPU wheel torch==2.13.0)
# so that no dependency can pull a multi-GB CUDA build; GPU hosts set TORCH_SPEC or bring their own torch and run
# scripts/install_gpu_kernels.sh afterwards. Re-running is cheap: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.installed
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
# The project's own modules byte-compiled (only the changed ones, a tenth of a second when none): pip compiles what
# it installs, but not an editable install's sources, and where PYTHONDONTWRITEBYTECODE is set (common in
# containers) Python would compile them again in every process: 0.08 s of data_prep's 0.2 s start-up.
compile_project() {
  .venv/bin/python -m compileall -q -j 0 pipeline data_prep launchers tools bench > /dev/null
}
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
  compile_project
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[dev,remote]"  # remote: s3fs for s3:// shard sets (docs/data.md)
compile_project
echo "$want" > "$stamp"
echo "installed into .venv: $(.venv/bin/python -c 'from importlib.metadata import version as v; print("torch", v("torch"), "deepspeed", v("deepspeed"))')"
