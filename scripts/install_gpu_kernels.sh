#!/usr/bin/env bash
# GPU hosts only: build flash-attn and MegaBlocks from source against the CUDA torch already installed.
# Both are source-only on PyPI and cannot be pip extras: megablocks' metadata pins torch 2.7.0, so it must be
# installed with --no-deps --no-build-isolation (DESIGN.md section 8). Without them the pipeline uses its
# pure-PyTorch paths (SDPA attention; the reference MoE), which have the same parameter layout.
#   TORCH_CUDA_ARCH_LIST  default 9.0 (Hopper: H100/H200)
#   MAX_JOBS              parallel compile jobs (default: number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "install_gpu_kernels.sh: torch sees no CUDA device; this script is for GPU hosts")'
"$PY" -m pip install --no-build-isolation "flash-attn==2.8.3"
"$PY" -m pip install --no-deps --no-build-isolation "stanford-stk==0.7.1" "grouped_gemm==0.3.0" "megablocks==0.10.0"
"$PY" - <<'PY'
import torch
from flash_attn import flash_attn_varlen_func  # noqa: F401
import megablocks  # noqa: F401  (fails without its compiled CUDA ops)
print("flash-attn and megablocks import; torch", torch.__version__, "CUDA", torch.version.cuda)
PY
