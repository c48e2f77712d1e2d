#!/usr/bin/env bash
# The one prepared GPU check (DESIGN.md section 2), under 5 minutes on one H200: the gpu-marked tests, then every GPU
# benchmark (bench/*_gpu.py), their figures on stdout. Run from anywhere: bash bench/gpu.sh
#
# MegaBlocks is built first when it does not import and its source archives are in build/gpu_kernels
# (bash scripts/install_gpu_kernels.sh --download build/gpu_kernels fills it on a machine with a package registry;
# carry build/gpu_kernels to a host without one). flash-attn is not built here: it compiles for longer than this
# check may take (bash scripts/install_gpu_kernels.sh builds it); its tests skip without it.
#   PY           the python to use (default .venv/bin/python, else python3)
#   GPU_INSTALL  0: never build MegaBlocks here
# Exit status: 0 when every step passed; the steps after a failure still run.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PY
status=0
fail() { echo "bench/gpu.sh: FAILED: $*"; status=1; }

echo "== environment"
"$PY" - <<'PY' || { echo "bench/gpu.sh: torch sees no CUDA device; nothing to check here"; exit 1; }
import importlib.util
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(1)
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"python {sys.version.split()[0]}")
print("installed:", ", ".join(f"{m} {'yes' if importlib.util.find_spec(m) else 'no'}"
                              for m in ("megablocks", "grouped_gemm", "flash_attn", "deepspeed")))
PY

if [ "${GPU_INSTALL:-1}" != 0 ] && ! "$PY" -c 'import megablocks' >/dev/null 2>&1; then
  if [ -f build/gpu_kernels/megablocks-0.10.0.tar.gz ]; then
    echo "== building MegaBlocks from build/gpu_kernels"
    SECONDS=0
    bash scripts/install_gpu_kernels.sh --from build/gpu_kernels --no-flash-attn || fail "MegaBlocks build"
    echo "(${SECONDS} s)"
  else
    echo "== MegaBlocks is not installed and build/gpu_kernels has no source archives: its tests and path skip"
  fi
fi

echo "== gpu-marked tests"
# Only the files that hold gpu tests: the rest may import packages a bare GPU host lacks (DeepSpeed, MLflow), and a
# file that cannot be collected there is reported as an error without hiding the others.
mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
SECONDS=0
"$PY" -m pytest -q -m gpu -rs --continue-on-collection-errors -p no:cacheprovider "${files[@]}" || fail "gpu tests"
echo "(${SECONDS} s)"

for bench in bench/*_gpu.py; do
  echo "== $bench"
  SECONDS=0
  "$PY" "$bench" || fail "$bench"
  echo "(${SECONDS} s)"
done
[ "$status" = 0 ] && echo "bench/gpu.sh: every step passed"
exit "$status"
