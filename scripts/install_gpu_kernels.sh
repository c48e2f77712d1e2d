#!/usr/bin/env bash
# GPU hosts only: build MegaBlocks (megablocks 0.10.0 + grouped_gemm 0.3.0 + stanford-stk 0.7.1) and flash-attn 2.8.3
# from source against the CUDA torch already installed. All four are source-only on PyPI and cannot be pip extras:
# megablocks' metadata pins torch 2.7.0, so every one is installed with --no-deps --no-build-isolation against the
# host's torch (docs/architecture.md, "GPU kernels"). Without them, pure-PyTorch paths run instead (SDPA attention; the
# reference MoE), which have the same parameter layout.
#
#   bash scripts/install_gpu_kernels.sh                    from PyPI, or offline from build/gpu_kernels when it holds
#                                                          the four source archives
#   bash scripts/install_gpu_kernels.sh --from DIR         offline, from the source archives in DIR
#   bash scripts/install_gpu_kernels.sh --no-flash-attn    MegaBlocks only (flash-attn compiles for tens of minutes)
#   bash scripts/install_gpu_kernels.sh --download DIR     on any machine with a package registry (no CUDA needed):
#                                                          fetch the four source archives into DIR for a host without
#
# Environment:
#   PY                    the python whose torch is used (default .venv/bin/python, else python3)
#   TORCH_CUDA_ARCH_LIST  default 9.0 (Hopper: H100/H200); flash-attn's FLASH_ATTN_CUDA_ARCHS follows it (9.0 -> 90)
#   MAX_JOBS              parallel compile jobs (default: number of cores)
#   GROUPED_GEMM_CUTLASS  1 builds grouped_gemm's CUTLASS kernels instead of its default cuBLAS loop
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "install_gpu_kernels.sh: $*" >&2; exit 1; }

STK="stanford-stk==0.7.1" GG="grouped_gemm==0.3.0" MB="megablocks==0.10.0" FA="flash-attn==2.8.3"
FROM="" DOWNLOAD="" FLASH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --from) [ $# -ge 2 ] || die "--from needs a directory"; FROM=$2; shift 2 ;;
    --download) [ $# -ge 2 ] || die "--download needs a directory"; DOWNLOAD=$2; shift 2 ;;
    --no-flash-attn) FLASH=0; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null || die "no python at '$PY' (set PY)"

# ---- --download: the source archives, for a host without a package registry ------------------------------------------
if [ -n "$DOWNLOAD" ]; then
  mkdir -p "$DOWNLOAD"
  # pip download still prepares each archive's metadata. stk and megablocks need nothing for it, flash-attn skips
  # its CUDA build on FLASH_ATTENTION_SKIP_CUDA_BUILD, and --no-build-isolation uses this python's torch.
  TORCH_CUDA_ARCH_LIST=9.0 FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE "$PY" -m pip download --no-deps --no-binary :all: \
    --no-build-isolation -d "$DOWNLOAD" "$STK" "$MB" "$FA" || die "pip download of $STK $MB $FA failed"
  # grouped_gemm's setup.py declares a CUDAExtension even for its metadata, which a CPU-only torch cannot do. pip
  # has downloaded and unpacked the archive by then: keep that unpacked copy (--no-clean) and pack it again.
  if ! TORCH_CUDA_ARCH_LIST=9.0 "$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation \
      -d "$DOWNLOAD" "$GG" >/dev/null 2>&1; then
    tmp=$(mktemp -d)
    TMPDIR=$tmp TORCH_CUDA_ARCH_LIST=9.0 "$PY" -m pip download --no-clean --no-deps --no-binary :all: \
      --no-build-isolation -d "$DOWNLOAD" "$GG" >/dev/null 2>&1 || true
    src=$(grep -lx "Version: 0.3.0" "$tmp"/pip-download-*/grouped-gemm_*/PKG-INFO 2>/dev/null | head -n1 || true)
    [ -n "$src" ] || { rm -rf "$tmp"; die "could not fetch $GG (pip download kept no unpacked copy)"; }
    src=$(dirname "$src")
    rm -rf "$src"/grouped_gemm.egg-info  # written by the failed metadata step
    mv "$src" "$tmp/grouped_gemm-0.3.0"
    tar -czf "$DOWNLOAD/grouped_gemm-0.3.0.tar.gz" -C "$tmp" grouped_gemm-0.3.0
    rm -rf "$tmp"
  fi
  echo "install_gpu_kernels.sh: source archives in $DOWNLOAD:"
  (cd "$DOWNLOAD" && sha256sum stanford_stk-0.7.1.tar.gz grouped_gemm-0.3.0.tar.gz megablocks-0.10.0.tar.gz \
    flash_attn-2.8.3.tar.gz) || die "an archive is missing from $DOWNLOAD"
  exit 0
fi

# ---- install ---------------------------------------------------------------------------------------------------------
"$PY" - <<'PY' || die "$PY has no CUDA build of torch; this script is for GPU hosts (the pipeline runs without it)"
import sys
import torch
sys.exit(0 if torch.version.cuda else 1)
PY
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# flash-attn reads its own list, "80;90;100;120" by default: keep the archs asked for (9.0 -> 90, 8.0+PTX -> 80)
archs=$(echo "$TORCH_CUDA_ARCH_LIST" | sed 's/+PTX//g; s/\.//g; s/[ ,]\{1,\}/;/g')
export FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS:-$archs}
# flash-attn otherwise tries to download a prebuilt wheel it guesses from torch's CUDA major (a CUDA 12 one for
# CUDA 13): build against this torch instead
export FLASH_ATTENTION_FORCE_BUILD=${FLASH_ATTENTION_FORCE_BUILD:-TRUE}
if ! command -v nvcc >/dev/null && [ -z "${CUDA_HOME:-}" ]; then
  [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
fi
"$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; import sys; sys.exit(0 if CUDA_HOME else 1)' \
  || die "no CUDA toolkit (nvcc) found for building; put nvcc on PATH or set CUDA_HOME"

if [ -z "$FROM" ] && [ -f build/gpu_kernels/megablocks-0.10.0.tar.gz ]; then FROM=build/gpu_kernels; fi
if [ -n "$FROM" ]; then
  [ -d "$FROM" ] || die "--from $FROM: no such directory"
  SRC=(--no-index --find-links "$FROM")
  echo "install_gpu_kernels.sh: offline, from $FROM"
else
  SRC=()
  echo "install_gpu_kernels.sh: from the package index"
fi
PIP=("$PY" -m pip install --no-deps --no-build-isolation ${SRC[@]+"${SRC[@]}"})
step() {  # step WHAT PIP-ARGS...: one package, one clear failure line
  local what=$1; shift
  echo "install_gpu_kernels.sh: building $what (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
  "${PIP[@]}" "$@" || die "building $what failed (compiler output above); the pipeline still runs on its torch paths"
}
step "$STK" "$STK"
step "$GG" "$GG"
step "$MB" "$MB"
if [ "$FLASH" = 1 ]; then
  "$PY" -c 'import einops' 2>/dev/null || "$PY" -m pip install ${SRC[@]+"${SRC[@]}"} einops \
    || die "flash-attn needs einops, which is not installed and could not be"
  step "$FA (FLASH_ATTN_CUDA_ARCHS=$FLASH_ATTN_CUDA_ARCHS)" "$FA"
fi

"$PY" - "$FLASH" <<'PY' || die "installed, but the check above failed"
import sys
from importlib.metadata import version

import torch

print(f"install_gpu_kernels.sh: torch {torch.__version__}, CUDA {torch.version.cuda}")
import megablocks  # noqa: F401  (loads its compiled megablocks_ops)
from megablocks import grouped_gemm_util

assert grouped_gemm_util.grouped_gemm_is_available(), "megablocks imports, grouped_gemm does not"
names = ["stanford-stk", "grouped_gemm", "megablocks"] + (["flash-attn"] if sys.argv[1] == "1" else [])
if sys.argv[1] == "1":
    from flash_attn import flash_attn_varlen_func  # noqa: F401
for name in names:
    print(f"install_gpu_kernels.sh: installed {name} {version(name)}")
if torch.cuda.is_available():  # one grouped GEMM: the kernel moe_backend=megablocks runs
    a = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 32, 64, device="cuda", dtype=torch.bfloat16)
    out = grouped_gemm_util.ops.gmm(a, b, torch.tensor([4, 2]), trans_b=True)
    ref = torch.cat([a[:4] @ b[0].t(), a[4:] @ b[1].t()])
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, f"grouped_gemm on {torch.cuda.get_device_name()}: relative error {err}"
    print(f"install_gpu_kernels.sh: grouped GEMM runs on {torch.cuda.get_device_name()} (relative error {err:.1e})")
else:
    print("install_gpu_kernels.sh: no CUDA device visible: built, not run")
PY
