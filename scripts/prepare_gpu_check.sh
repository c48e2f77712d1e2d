#!/usr/bin/env bash
# On a machine with a package registry (this one), before bash bench/gpu.sh runs on a GPU host that has none:
#   build/gpu_wheels/  the Python packages the pipeline needs that a bare CUDA image lacks (DeepSpeed, WebDataset and
#                      their dependencies), as wheels for CPython 3.12 on x86-64 Linux: pure-python ones, pydantic-core
#                      as a cp312 manylinux wheel, and DeepSpeed built here from its source archive (PyPI has no
#                      DeepSpeed wheel; with DS_BUILD_OPS=0 the wheel is pure python and picks CUDA at run time).
#                      Versions are those of the python that runs this script (the ones the test suite passed on).
#   build/gpu_data/    the RNAcentral FASTA of ../shared/data/rna (3.6 MB), for the check's training on real shards;
#                      without it the check trains on the shipped Rfam sample.
# bench/gpu.sh installs the wheels offline (pip install --no-index --no-deps --target) when build/gpu_wheels exists.
# MLflow is not among them: tracking is off in the check (metrics.jsonl keeps every step).
#
#   bash scripts/prepare_gpu_check.sh        PY: the python whose package versions to take (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "prepare_gpu_check.sh: $*" >&2; exit 1; }
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS=build/gpu_wheels DATA=build/gpu_data
# deepspeed's and webdataset's requirements that the CUDA image (KINDS.md's package list) does not hold, plus
# typing-extensions: pydantic needs a recent one and a --target install puts ours first on the path.
PKGS=(hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions webdataset braceexpand)
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null \
  || die "$1 is not installed in $PY (set PY to the project's python)"; }

rm -rf "$WHEELS" && mkdir -p "$WHEELS" "$DATA"
pins=()
for p in "${PKGS[@]}"; do pins+=("$p==$(version "$p")"); done
echo "== wheels for CPython 3.12 x86-64: ${pins[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$WHEELS" "${pins[@]}" || die "pip download failed"

ds="deepspeed==$(version deepspeed)"
echo "== $ds: source archive, built into a pure-python wheel (no ops compiled)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$tmp" "$ds" \
  || die "pip download of $ds failed"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$tmp"/deepspeed-*.tar.gz \
  || die "building the $ds wheel failed"

src=../shared/data/rna/rnacentral_ncrna6_testset.fasta
if [ -f "$src" ]; then
  cp "$src" "$DATA/"
else
  echo "note: $src not found; the check will train on data/samples/rfam_nrc_train_sample.fasta.gz"
fi
ls -l "$WHEELS" "$DATA"
du -sh "$WHEELS" "$DATA"
echo "carry build/gpu_wheels and build/gpu_data to the GPU host, then run: bash bench/gpu.sh"
