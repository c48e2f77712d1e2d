#!/usr/bin/env bash
# On a machine with a package registry (this one), before bash bench/gpu.sh runs on a GPU host that has none:
#   build/gpu_wheels/  every runtime dependency of pyproject.toml, with its own requirements, that the CUDA image
#                      lacks (scripts/gpu_image_packages.txt lists what it holds), as wheels for CPython 3.12 on x86-64
#                      Linux: pure-python ones, binary cp312 manylinux ones (isal, pydantic-core, ...), and DeepSpeed
#                      built here from its source archive (PyPI has no DeepSpeed wheel; with DS_BUILD_OPS=0 the wheel
#                      is pure python and picks CUDA at run time). Versions are those installed in PY (the ones the
#                      test suite passed on). The list is computed, never written down: a new dependency in
#                      pyproject.toml is carried without editing this script (the first GPU run lacked isal because
#                      the list was hard-coded).
#   build/gpu_data/    real data from ../shared/data (docs: /work/shared/data/SOURCES.md), one folder a family:
#                      rna/      RNAcentral FASTA (3.6 MB; Eco-RNA; else the shipped Rfam sample)
#                      protein/  UniRef90 members of 2,500 UniRef50 clusters + their mapping (2.5 MB; ProtLingo;
#                                else the shipped 400-cluster sample), and shards/: their cluster shards, built
#                                here (data_prep's cluster join needs DuckDB and pyarrow, 75 MB of wheels not carried)
#                      text/     four public-domain/CC English texts (2.5 MB; RecursiveGPT; else the repo's docs/*.md)
# bench/gpu.sh installs the wheels offline (pip install --no-index --no-deps --target) when build/gpu_wheels exists.
# Both folders travel as carried paths, 64 MiB in all with anything else carried: this script fails above 48 MiB.
#
#   bash scripts/prepare_gpu_check.sh [--list] [--wheels-only]
#     --list          print the computed list (name==version, one a line, with why each is carried) and exit
#     --wheels-only   write the wheels, not build/gpu_data
# Environment:
#   PY          the python whose installed packages (versions, requirements) are taken (default .venv/bin/python,
#               else python3)
#   GPU_PYTHON  the GPU host's python version the wheels are for (default 3.12, the first GPU run's 3.12.3)
#   GPU_WHEELS  output folder of the wheels (default build/gpu_wheels)
#   GPU_DATA    output folder of the data (default build/gpu_data)
#   SHARED_DATA the shared data folder (default ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "prepare_gpu_check.sh: $*" >&2; exit 1; }
LIST=0 DATA_TOO=1
for a in "$@"; do
  case "$a" in
    --list) LIST=1 ;;
    --wheels-only) DATA_TOO=0 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) die "unknown argument '$a' (see --help)" ;;
  esac
done
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
TARGET=${GPU_PYTHON:-3.12}
[[ $TARGET =~ ^3\.[0-9]+$ ]] || die "GPU_PYTHON must read like 3.12, got '$TARGET'"
WHEELS=${GPU_WHEELS:-build/gpu_wheels} DATA=${GPU_DATA:-build/gpu_data} SHARED=${SHARED_DATA:-../shared/data}

# The carried set: walk pyproject.toml's [project].dependencies and, for each package carried, its installed
# requirements (importlib.metadata), with markers evaluated for the GPU host (Linux x86-64, CPython TARGET). The walk
# stops at a package the image holds (its own requirements are the image's), and at an exemption below.
compute() {
  "$PY" - "$TARGET" scripts/gpu_image_packages.txt pyproject.toml <<'PY'
import importlib.metadata as md
import re
import sys

try:
    import tomllib
except ImportError:  # python < 3.11
    import tomli as tomllib
from packaging.requirements import Requirement

target, image_file, pyproject = sys.argv[1:4]
# Not carried though a runtime dependency: the check runs with tracking.enabled=false, so nothing it runs imports
# mlflow (deepspeed probes for it and goes on without it; tests/bench/test_gpu_env.py runs the check without it),
# and mlflow with its own requirements (pandas, pyarrow, sqlalchemy, ...) is about 60 MB of wheels.
EXEMPT = {"mlflow": "tracking is off in the check",
          # data_prep --clusters' join only (75 MB of wheels): ProtLingo's cluster shards are built here, below
          "duckdb": "the cluster shards are built here", "pyarrow": "the cluster shards are built here"}
# Carried though the image holds it: pydantic 2.14 needs typing-extensions >= 4.16, newer than an image built with
# an older torch may hold; the --target install puts ours first on the path.
FORCE = {"typing-extensions": "pydantic needs a newer one than the image may hold"}


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


image = set()
for line in open(image_file):
    name = line.split("#", 1)[0].strip()
    if name:
        image.add(canon(name))
env = {"python_version": target, "python_full_version": target + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython"}


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


roots = [Requirement(r) for r in tomllib.load(open(pyproject, "rb"))["project"]["dependencies"]]
carried = {}  # name -> why
todo = [(r, set(), "pyproject.toml") for r in roots]
while todo:
    req, extras, parent = todo.pop(0)
    name = canon(req.name)
    if not applies(req, extras) or name in EXEMPT or (name in image and name not in FORCE) or name in carried:
        continue
    carried[name] = FORCE.get(name, f"required by {parent}")
    try:
        requires = md.requires(name) or []
    except md.PackageNotFoundError:
        sys.exit(f"prepare_gpu_check.sh: {name} (required by {parent}) is not installed in {sys.executable}; "
                 "set PY to the project's python")
    todo += [(Requirement(r), set(req.extras), name) for r in requires]
for name, why in sorted(carried.items()):
    print(f"{name}=={md.version(name)}  # {why}")
PY
}
LISTED=$(compute) || exit 1
if [ "$LIST" = 1 ]; then echo "$LISTED"; exit 0; fi
pins=() ds=""
while read -r pin _; do
  # deepspeed: PyPI has its source archive only, built below
  case "$pin" in deepspeed==*) ds=$pin ;; *) pins+=("$pin") ;; esac
done <<<"$LISTED"

rm -rf "$WHEELS" && mkdir -p "$WHEELS"
abi=cp${TARGET/./}
echo "== wheels for CPython $TARGET x86-64 Linux: ${pins[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" --implementation cp --abi "$abi" \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any \
  -d "$WHEELS" "${pins[@]}" || die "pip download failed"
if [ -n "$ds" ]; then
  echo "== $ds: source archive, built into a pure-python wheel (no ops compiled)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$tmp" "$ds" \
    || die "pip download of $ds failed"
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$tmp"/deepspeed-*.tar.gz \
    || die "building the $ds wheel failed"
fi
n=$(ls "$WHEELS"/*.whl | wc -l)
[ "$n" = "$(wc -l <<<"$LISTED")" ] || die "$n wheels in $WHEELS for $(wc -l <<<"$LISTED") packages"
ls "$WHEELS"

if [ "$DATA_TOO" = 1 ]; then
  rm -rf "$DATA" && mkdir -p "$DATA"/rna "$DATA"/protein "$DATA"/text
  copy() {  # copy SRC DEST_DIR, or say which fallback the check will use
    if [ -f "$SHARED/$1" ]; then cp "$SHARED/$1" "$2/"; else echo "note: $SHARED/$1 not found; $3"; fi
  }
  copy rna/rnacentral_ncrna6_testset.fasta "$DATA/rna" "Eco-RNA will train on the shipped Rfam sample"
  copy protein/uniref90_202104_members_of_ur50_first2500.fasta "$DATA/protein" "ProtLingo: shipped sample"
  copy protein/uniref50_to_uniref90_mapping_first2500.tsv "$DATA/protein" "ProtLingo: shipped sample"
  # ProtLingo's cluster shards, built here: data_prep's cluster join (DuckDB, pyarrow) is not carried
  members=$(ls "$DATA"/protein/*.fasta 2>/dev/null | head -n 1 || true)
  mapping=$(ls "$DATA"/protein/*.tsv 2>/dev/null | head -n 1 || true)
  if [ -z "$members" ] || [ -z "$mapping" ]; then
    members=data/samples/uniref90_clusters_sample.fasta.gz mapping=data/samples/uniref50_to_uniref90_sample.tsv
  fi
  "$PY" -m data_prep uniref --input "$members" --clusters "$mapping" --output "$DATA/protein/shards" \
    --shard-size 100 --progress off || die "data_prep uniref --clusters failed on $members"
  for t in gutenberg_pg11_alice_in_wonderland.txt tinyshakespeare.txt switchboard_swda_val_set.txt \
           wikitext2_raw_valid.txt; do
    copy "text/$t" "$DATA/text" "RecursiveGPT: fewer texts (the repo's docs/*.md when none)"
  done
  ls -lR "$DATA"
fi
carried=("$WHEELS")
[ "$DATA_TOO" = 1 ] && carried+=("$DATA")
du -sh "${carried[@]}"
kib=$(du -sk "${carried[@]}" | awk '{s += $1} END {print s}')
[ "$kib" -le $((48 * 1024)) ] || die "$kib KiB to carry: over 48 MiB of the 64 MiB the transfer takes"
echo "carry $WHEELS and $DATA to the GPU host, then run: bash bench/gpu.sh (docs/gpu_check.md)"
