#!/usr/bin/env bash
# The one prepared GPU check: one lease of one H200 (or H100), at most GPU_DEADLINE (580 s) of command time
# (docs/gpu_check.md). Run from anywhere:
#   bash bench/gpu.sh                    on a CUDA host: every stage below
#   bash bench/gpu.sh --quick NAME...    on a CUDA host: only these trainings (a family or an A/B variant of the RUNS
#                                        table below) with their reports, in under 3 minutes for one
#   bash bench/gpu.sh --dry-run [--quick NAME...]   on any machine: the same stages on the CPU with tiny models, a few
#                                        steps each (checks this script, its commands and their arguments, and the
#                                        packing of its results; the figures mean nothing)
# No step needs the repository's .venv: PY (below) runs everything, the launcher included (scripts/launch.sh).
#
# It cannot waste a lease:
# - It stops at once, with one line and exit 1, when torch sees no CUDA device, when GPU_WHEELS holds no wheels or
#   wheels that do not fit PY or do not install, or when deepspeed, webdataset or isal does not import afterwards
#   (bash scripts/prepare_gpu_check.sh builds the wheels on a machine with a package registry). The dry run goes on
#   without wheels, saying so; it needs the imports too.
# - The cheapest first-contact checks run first: the gpu-marked tests, each under its own pytest timeout.
# - Every stage runs under `timeout` with its own budget, cut to what is left of GPU_DEADLINE; a stage that would not
#   fit is not started and the summary says so, with the command that runs it alone. A stage that fails or times out
#   is reported and the later stages still run.
# - After each stage its results are packed into OUT (GPU_ARTIFACTS, default $OUT), which never holds more than 8
#   files, each under 16 MiB, at any moment (the device returns no more): summary.txt, results.tar.gz (the stage
#   table, the plan, every report, each run's metrics.jsonl, the utilization samples and each log's tail) and the
#   profiled steps' traces, gzipped and cut to fit (trace_NAME.json.gz), besides the caller's own tee'd log. A
#   SIGTERM/SIGINT/HUP stops the running stage and packs what exists; after a SIGKILL, what the last stage packed is
#   there. The summary table (bench/gpu_report.py summary) is printed last and is OUT/summary.txt.
#
# Stages, in this order, each with what it is expected to take on one H200 and its timeout (the expectations come from
# the 2026-12-04 runs; docs/gpu_check.md has the table): about 570 s in all, under GPU_DEADLINE's 580.
#   environment  CUDA, the carried wheels installed offline into GPU_SITE, the imports (5 s; not a timed stage)
#   data         background, on the CPU: each family's data_prep (RNAcentral or the shipped Rfam sample; UniRef90
#                members of UniRef50 clusters; English text with a 32,768-piece sentencepiece model) and ProtLingo's
#                start, a random ESM2-150M upcycled to protlingo_150m.yaml (hidden behind the GPU stages; 300 each)
#   plan         bench/gpu_report.py plan: each training of RUNS checked against the config code (2 s; 120)
#   tests        the gpu-marked tests, each under pytest-timeout GPU_TEST_TIMEOUT (45 s; 150)
#   eco_rna      bench/eco_rna_gpu.py: attention-path parity; the training's packed path (torch's varlen kernel
#                under attn_backend auto) against padded, Eco-RNA 80M fwd+bwd MFU at L 512 (25 s; 120)
#   rna protlingo gpt
#                the families: GPU_TRAIN_SECONDS of training each (train.max_hours, the trainer's own start-up
#                included) through the real launcher (scripts/launch.sh: deepspeed runner, ZeRO-2, bf16, one GPU),
#                one step profiled (GPU_PROFILE_STEP; ProtLingo's at most 5), nvidia-smi sampled every 200 ms, then
#                bench/gpu_report.py family; about 28 s of launch and final checkpoint around it (53 s each;
#                timeout seconds + 90)
#   the A/B variants of RUNS, after the families: GPU_AB_SECONDS each, one switch changed against its base, profiled
#                at GPU_AB_PROFILE_STEP; a compiled one gets GPU_COMPILE_SECONDS more for its first step (46 s,
#                compiled 71 s; timeout seconds + 90)
#   moe          bench/moe_gpu.py: the MoE backends' parity and speed (10 s; 60)
#   eval         background, on the CPU, from the Eco-RNA checkpoint: the reconstruction depth study
#                (bench/depth_study.py --checkpoint: K = 1-8 at each GPU_EVAL_SEEDS seed; 150 s; 300)
#   Only with GPU_WITH=depth (minutes, beyond the lease): the synthetic depth task (bench/depth_task.py).
# Environment:
#   PY                   the python to use (default .venv/bin/python when it exists, else python3)
#   GPU_WORK             scratch folder (default /tmp/bench_gpu; emptied first)
#   GPU_WHEELS           the carried wheels (default build/gpu_wheels; none: use what PY has, on a host that has it)
#   GPU_DATA             the carried data (default build/gpu_data; missing files fall back on data/samples, docs/*.md)
#   GPU_SITE             where the carried wheels are installed (default GPU_WORK/site)
#   GPU_DEADLINE         seconds the whole check may take (default 580; --quick 170; the dry run 3600)
#   GPU_TRAIN_SECONDS    each family's training (train.max_hours; default 25)
#   GPU_AB_SECONDS       each A/B variant's (default 18); GPU_COMPILE_SECONDS more for a compiled one (25)
#   GPU_PROFILE_STEP     the step torch.profiler records in a family's training (default 15; ProtLingo at most 5)
#   GPU_AB_PROFILE_STEP  the same in an A/B variant (default 6)
#   GPU_TEST_TIMEOUT     seconds each gpu-marked test may take (default 60)
#   GPU_SKIP             stages to leave out: tests eco_rna moe eval, a training's name, or ab (every A/B variant)
#   GPU_WITH             extra stages: depth
#   GPU_DEPTH_HOPS       pointers of the depth task's held-out answers (default 4)
#   GPU_INSTALL          0: never build MegaBlocks here
#   GPU_EVAL_SEEDS       evaluation seeds of the depth study (default 0-2)
#   GPU_ARTIFACTS        the folder results are packed into (default $OUT if set; none: no packing)
# Exit status: 0 when every stage that ran passed; 1 otherwise; 128 + n after signal n.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0 QUICK=() IN_QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; IN_QUICK=0 ;;
    --quick) IN_QUICK=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    -*) echo "bench/gpu.sh: unknown argument '$1' (see --help)"; exit 2 ;;
    *) if [ "$IN_QUICK" = 1 ]; then QUICK+=("$1"); else echo "bench/gpu.sh: unknown argument '$1' (see --help)"; exit 2; fi ;;
  esac
  shift
done
if [ "$IN_QUICK" = 1 ] && [ "${#QUICK[@]}" = 0 ]; then
  echo "bench/gpu.sh: --quick needs the name of a training (one of the RUNS table in bench/gpu.sh)"; exit 2
fi

# ---- the trainings: families, then the A/B variants ------------------------------------------------------------------
# One row a training. A family row (base -) is a family's own run, its figures held against its target; a variant row
# is its base's run with its own overrides added, one switch changed, trained in the same lease and reported beside
# its base. Variants run in this order after the families, so GPU_DEADLINE cuts the last first. `bench/gpu_report.py
# plan` checks each row against the config code before anything trains: a key this tree does not have yet skips the
# row with the config's own error, an optional override (?key=value) is dropped where refused, and a row whose config
# equals its base's is skipped. Overrides are space-separated --set items. To add a variant, add a row.
# name            | base         | overrides                                  | what it attributes
RUNS='
rna               | -            |                                            | Eco-RNA 80M, eco_rna_80m.yaml (auto microbatch)
protlingo         | -            |                                            | ProtLingo 150M, protlingo_150m.yaml (auto)
gpt               | -            |                                            | RecursiveGPT 124M, recursive_gpt_100m.yaml
rna_padded        | rna          | model.unpad=false                          | packed layout off: padded rows
rna_compiled      | rna          | train.compile=blocks                       | compiled blocks on
rna_mb16k         | rna          | train.max_tokens_per_microbatch=16384      | auto microbatch off: the config 16,384 tokens
rna_norm_plain    | rna          | train.fused_norm=false                     | fused RMSNorm off: the plain formula
rna_graphs        | rna_compiled | train.cuda_graphs=true                     | CUDA graphs on, over compiled blocks
rna_buckets_off   | rna          | objective.token_buckets=0                  | token buckets off
'
declare -A BASE_OF WHAT_OF
ORDER=()
trim() { local v=$1; v=${v#"${v%%[![:space:]]*}"}; printf '%s' "${v%"${v##*[![:space:]]}"}"; }
while IFS='|' read -r name base sets what; do
  name=$(trim "$name")
  [ -z "$name" ] && continue
  BASE_OF[$name]=$(trim "$base") WHAT_OF[$name]=$(trim "$what")
  read -r -a "OWN_$name" <<<"$sets"  # one --set item a word (read: no glob expansion of a ?key=value)
  ORDER+=("$name")
done <<<"$RUNS"
family_of() { local n=$1; while [ "${BASE_OF[$n]}" != - ]; do n=${BASE_OF[$n]}; done; echo "$n"; }
for q in "${QUICK[@]}"; do
  [ -n "${BASE_OF[$q]:-}" ] || { echo "bench/gpu.sh: --quick $q: no such training (one of: ${ORDER[*]})"; exit 2; }
done
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null || { echo "bench/gpu.sh: no python '$PY' (set PY)"; exit 1; }
# The repository root on the path: the GPU host runs the project from its tree, not pip-installed as in .venv, and a
# `python tools/X.py` puts only tools/ on sys.path (tools/make_random_esm2.py imports pipeline).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PY PYTHONUNBUFFERED=1 TQDM_DISABLE=1
WORK=${GPU_WORK:-/tmp/bench_gpu}
SITE=${GPU_SITE:-$WORK/site}
WHEELS=${GPU_WHEELS:-build/gpu_wheels}
DATA=${GPU_DATA:-build/gpu_data}
TRAIN_S=${GPU_TRAIN_SECONDS:-25} AB_S=${GPU_AB_SECONDS:-18} COMPILE_S=${GPU_COMPILE_SECONDS:-25}
PROF=${GPU_PROFILE_STEP:-15} AB_PROF=${GPU_AB_PROFILE_STEP:-6} TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-60}
ARTIFACTS=${GPU_ARTIFACTS:-${OUT:-}}
[ "$ARTIFACTS" = none ] && ARTIFACTS=""
SKIP=" ${GPU_SKIP:-} " WITH=" ${GPU_WITH:-} "
if [ "$DRY" = 1 ]; then DEADLINE=${GPU_DEADLINE:-3600}
elif [ "${#QUICK[@]}" -gt 0 ]; then DEADLINE=${GPU_DEADLINE:-170}
else DEADLINE=${GPU_DEADLINE:-580}; fi
RESERVE=12  # seconds kept for the last pack and the summary (a few are enough; the rest is margin)
# Stage timeouts (s). The dry run's are wide: the CPU is slow, and its point is the script, not the time.
if [ "$DRY" = 1 ]; then B_PLAN=300 B_TESTS=300 B_ECO=300 B_MOE=300 B_TRAIN_EXTRA=300 B_BG=900 PROF=2 AB_PROF=2
else B_PLAN=120 B_TESTS=150 B_ECO=120 B_MOE=60 B_TRAIN_EXTRA=90 B_BG=300; fi

# ---- environment: silent until it passes, so that a host that cannot run the check gets one line --------------------
die() { echo "bench/gpu.sh: $*"; exit 1; }
if [ "$DRY" = 0 ]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
    || die "torch sees no CUDA device; nothing to check here (--dry-run checks the script)"
fi
rm -rf "$WORK" && mkdir -p "$WORK/logs" "$WORK/ret" || die "cannot create $WORK"
WHEEL_NOTE=""
if [ "$WHEELS" = none ]; then
  WHEEL_NOTE="GPU_WHEELS=none: the packages PY already has"
elif ! compgen -G "$WHEELS/*.whl" >/dev/null; then
  # Without the carried wheels every training fails later, without DeepSpeed: on a CUDA host that is the lease gone.
  [ "$DRY" = 1 ] || die "no wheels in $WHEELS: run bash scripts/prepare_gpu_check.sh on a machine with a package" \
    "registry and carry $WHEELS (GPU_WHEELS=none uses what $PY has)"
  WHEEL_NOTE="dry run: no wheels in $WHEELS; going on with what $PY has"
else
  # Installed in the dry run too (the first GPU run's missing isal hid behind a dry run that skipped this), when
  # every wheel fits this python; the cp312 wheels of the GPU host do not fit another one (this machine's venv).
  fit=$("$PY" - "$WHEELS"/*.whl <<'PY' 2>&1
import sys
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

here = set(sys_tags())
bad = [p for p in sys.argv[1:] if not parse_wheel_filename(Path(p).name)[3] & here]
if bad:
    print(f"{len(bad)} of the wheels in {Path(bad[0]).parent} do not fit this python, e.g. {Path(bad[0]).name}")
sys.exit(1 if bad else 0)
PY
  )
  if [ $? = 0 ]; then
    # --no-deps: the folder holds every missing package and the image holds the rest (torch, numpy, ...), which an
    # offline resolver could not fetch again; --target keeps the image's own site-packages untouched.
    err=$(timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl 2>&1) \
      || die "installing $WHEELS failed: $(tail -n 1 <<<"$err")"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    WHEEL_NOTE="installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
  elif [ "$DRY" = 1 ]; then
    WHEEL_NOTE="dry run: $WHEELS left uninstalled: $(tail -n 1 <<<"$fit")"
  else
    die "$(tail -n 1 <<<"$fit") (bash scripts/prepare_gpu_check.sh with GPU_PYTHON = this host's python)"
  fi
fi
for m in deepspeed webdataset isal; do
  err=$(timeout 120 "$PY" -c "import $m" 2>&1) \
    || die "$m does not import with $PY: $(grep -v '^\s*$' <<<"$err" | tail -n 1) (carry it in $WHEELS)"
done

START=$SECONDS
status=0 FAILED=() NOT_RUN=() CUR="" STAGE_PID="" HELPER_PID="" BG_PIDS=() CUT_PIDS=() FINISHED=0
fail() { echo "bench/gpu.sh: FAILED: $*"; status=1; FAILED+=("$1"); }
skipped() { case "$SKIP" in *" $1 "*) return 0 ;; esac; return 1; }
# record NAME STATUS SECONDS TIMEOUT NOTE: one line of the stage table (stages.tsv, read by the summary)
record() {
  local note=${5:--}
  note=${note//$'\t'/ } note=${note//$'\n'/ }
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$note" >>"$WORK/stages.tsv"
}
pack() {
  [ -n "$ARTIFACTS" ] || return 0
  timeout 60 "$PY" bench/gpu_report.py pack --work "$WORK" --out "$ARTIFACTS" || echo "bench/gpu.sh: packing into $ARTIFACTS failed"
}
is_child() {  # PID: whether PID is a live child of this shell (a finished job's PID may belong to another process now)
  local st state ppid
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }  # after the command name, which may hold spaces
  read -r state ppid _ <<<"$st"
  [ "$ppid" = "$$" ] && [ "$state" != Z ]  # a zombie has ended: only its exit status is left to collect
}
kill_tree() {  # PID: a job of this shell, started under `timeout` (a process group of its own, all of it ended) or not
  local pid=$1 _
  is_child "$pid" || return 0
  if kill -TERM -- "-$pid" 2>/dev/null; then
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 -- "-$pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null
  else
    kill -TERM "$pid" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do is_child "$pid" || return 0; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null
  fi
  return 0
}
finish() {  # on every exit: stop what still runs, pack, print the summary last
  [ "$FINISHED" = 1 ] && return
  FINISHED=1
  trap '' TERM INT HUP
  [ -n "$STAGE_PID" ] && kill_tree "$STAGE_PID"
  [ -n "$HELPER_PID" ] && kill_tree "$HELPER_PID"
  for pid in "${BG_PIDS[@]}"; do kill_tree "$pid" & done
  wait 2>/dev/null
  pack
  echo
  "$PY" bench/gpu_report.py summary --work "$WORK" 2>/dev/null || cat "$WORK/stages.tsv" 2>/dev/null
  echo "bench/gpu.sh: $(( SECONDS - START )) s in all${ARTIFACTS:+; results packed into $ARTIFACTS}"
  [ "${#NOT_RUN[@]}" -gt 0 ] && echo "bench/gpu.sh: not run within GPU_DEADLINE: ${NOT_RUN[*]}"
  if [ "$status" = 0 ]; then echo "bench/gpu.sh: every stage that ran passed"
  else echo "bench/gpu.sh: FAILED: ${FAILED[*]}"; fi
}
on_signal() {  # SIG N
  echo "bench/gpu.sh: SIG$1 during ${CUR:-set-up}: stopping it and packing what exists"
  [ -n "$CUR" ] && record "$CUR" killed "$(( SECONDS - ${T0:-$SECONDS} ))" "${T:-}" "SIG$1 after $(( SECONDS - START )) s"
  status=1 FAILED+=("SIG$1")
  exit $(( 128 + $2 ))
}
trap finish EXIT
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT
trap 'on_signal HUP 1' HUP

# stage NAME BUDGET MIN: start a stage when MIN seconds are left of the deadline (less what packing keeps); T is its
# timeout (BUDGET, or what is left). Returns 1 (after recording why) when it does not start.
stage() {
  local name=$1 budget=$2 min=$3 left
  left=$(( DEADLINE - (SECONDS - START) - RESERVE ))
  if [ "$left" -lt "$min" ]; then
    echo "== $name: not run (GPU_DEADLINE $DEADLINE s: $left s left, it needs $min)"
    record "$name" "not run" 0 - "deadline: $left s left of $DEADLINE, needs $min; alone: bash bench/gpu.sh --quick $name"
    NOT_RUN+=("$name")
    return 1
  fi
  T=$(( budget < left ? budget : left )) T0=$SECONDS CUR=$name
  echo "== $name (timeout $T s)"
}
# run_in LOG CMD...: the stage's command under `timeout T` in the background (a trapped signal interrupts `wait`, not a
# foreground command), output to LOG; RC its exit status (124: timed out).
run_in() {
  local log=$1; shift
  timeout -k 10 "$T" "$@" >"$log" 2>&1 &
  STAGE_PID=$!
  wait "$STAGE_PID"
  RC=$?
  STAGE_PID=""
}
# bgwait CMD...: CMD in the background, waited for: a signal interrupts the wait at once (the trap kills HELPER_PID)
bgwait() {
  "$@" &
  HELPER_PID=$!
  wait "$HELPER_PID"
  local rc=$?
  HELPER_PID=""
  return "$rc"
}
# done_stage NAME NOTE: record the stage by RC, print its time, pack
done_stage() {
  local name=$1 note=${2:-} st=ok
  if [ "$RC" = 124 ] || [ "$RC" = 137 ]; then st=timeout; fail "$name (timed out after $T s)"
  elif [ "$RC" != 0 ]; then st=failed; fail "$name (exit $RC)"; fi
  record "$name" "$st" "$(( SECONDS - T0 ))" "$T" "$note"
  echo "($(( SECONDS - T0 )) s)"
  CUR=""
  pack
}

{
  echo "$("$PY" - "$DRY" <<'PY'
import importlib
import importlib.util
import sys

import torch

dev = (f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if torch.cuda.is_available() else "no CUDA")
print(f"{dev}, torch {torch.__version__}, python {sys.version.split()[0]} ({sys.executable}), "
      f"{torch.get_num_threads()} threads" + (" (dry run)" if sys.argv[1] == "1" else ""))
found = []
for m in ("deepspeed", "webdataset", "isal", "pydantic", "mlflow", "flash_attn", "megablocks", "grouped_gemm"):
    if importlib.util.find_spec(m) is None:
        found.append(f"{m} no")
        continue
    try:
        found.append(f"{m} {getattr(importlib.import_module(m), '__version__', 'yes')}")
    except Exception as e:  # noqa: BLE001 - present but broken (a CUDA op that does not load): say so
        found.append(f"{m} broken ({type(e).__name__})")
print("installed:", ", ".join(found))
PY
)"
  echo "$WHEEL_NOTE"
} >"$WORK/env.txt" 2>"$WORK/logs/env.log"
echo "== environment"
cat "$WORK/env.txt"
MODE="full check"
[ "${#QUICK[@]}" -gt 0 ] && MODE="quick: ${QUICK[*]}"
[ "$DRY" = 1 ] && MODE="dry run ($MODE; figures meaningless)"
echo "$(head -n 1 "$WORK/env.txt" | cut -d, -f1-2); $MODE; GPU_DEADLINE $DEADLINE s" >"$WORK/summary_head.txt"
pack

if [ "$DRY" = 0 ] && [ "${GPU_INSTALL:-1}" != 0 ] && [ "${#QUICK[@]}" = 0 ] && ! "$PY" -c 'import megablocks' >/dev/null 2>&1; then
  if [ -f build/gpu_kernels/megablocks-0.10.0.tar.gz ]; then
    # minutes: beyond the lease's budget, so only when its sources were carried on purpose
    if stage megablocks 600 120; then
      run_in "$WORK/logs/megablocks.log" bash scripts/install_gpu_kernels.sh --from build/gpu_kernels --no-flash-attn
      done_stage megablocks "$(tail -n 1 "$WORK/logs/megablocks.log")"
    fi
  else
    echo "note: MegaBlocks is not installed and build/gpu_kernels has no source archives: its paths skip"
  fi
fi

want() {  # NAME: whether this training runs in this invocation
  if [ "${#QUICK[@]}" -gt 0 ]; then case " ${QUICK[*]} " in *" $1 "*) return 0 ;; esac; return 1; fi
  skipped "$1" && return 1
  [ "${BASE_OF[$1]}" != - ] && skipped ab && return 1
  return 0
}
for n in "${ORDER[@]}"; do want "$n" && echo "$n"; done >"$WORK/wanted.txt"  # the summary lists these
# need_family FAMILY: whether its data step runs: always in the full check (the CPU does it beside the GPU stages, and a
# skipped family's data step is still checked), only for the trainings asked for with --quick
need_family() {
  [ "${#QUICK[@]}" = 0 ] && return 0
  local n; for n in "${ORDER[@]}"; do want "$n" && [ "$(family_of "$n")" = "$1" ] && return 0; done; return 1
}

# ---- data, in the background on the CPU while the GPU stages run -------------------------------------------------
first() { for f in "$@"; do [ -f "$f" ] && { echo "$f"; return; }; done; }
RNA_FASTA=$(first "$DATA"/rna/*.fasta "$DATA"/*.fasta data/samples/rfam_nrc_train_sample.fasta.gz)
PROT_FASTA=$(first "$DATA"/protein/*.fasta) PROT_TSV=$(first "$DATA"/protein/*.tsv)
if [ -z "$PROT_FASTA" ] || [ -z "$PROT_TSV" ]; then
  PROT_FASTA=data/samples/uniref90_clusters_sample.fasta.gz PROT_TSV=data/samples/uniref50_to_uniref90_sample.tsv
fi
mapfile -t TEXTS < <(ls "$DATA"/text/*.txt 2>/dev/null)
VOCAB=32768  # recursive_gpt_100m.yaml's
if [ "${#TEXTS[@]}" = 0 ]; then
  # none carried: the repo's own English text, which fills no more than ~11k pieces (the model shrinks with it)
  mapfile -t TEXTS < <(ls docs/*.md)
  VOCAB=8192
  need_family gpt && echo "note: no text in $DATA/text; RecursiveGPT trains on docs/*.md with an 8,192-piece" \
    "vocabulary (86.3M parameters, not 124M)"
fi
PROT_CONFIG=launchers/configs/protlingo_150m.yaml ESM_SIZE=150M
[ "$DRY" = 1 ] && PROT_CONFIG=launchers/configs/protlingo_demo.yaml ESM_SIZE=8M  # its tiny MoE + memory shape
declare -A PREP_PID PREP_DONE
prep() {  # NAME COMMAND...: in the background under its own timeout, output to WORK/prep_NAME.log
  local name=$1; shift
  timeout -k 10 "$B_BG" "$@" >"$WORK/prep_$name.log" 2>&1 &
  PREP_PID[$name]=$!
  BG_PIDS+=($!)
}
prepped() {  # NAME: wait for its data step (each family's own, so Eco-RNA need not wait for the ESM2 start)
  [ -n "${PREP_DONE[$1]:-}" ] && return "${PREP_DONE[$1]}"
  if wait "${PREP_PID[$1]}"; then
    echo "data $1: $(grep -E '^data_prep' "$WORK/prep_$1.log" | tail -n 1)"
    PREP_DONE[$1]=0
  else
    tail -n 20 "$WORK/prep_$1.log"
    fail "data_$1"
    record "data_$1" failed - "$B_BG" "$(tail -n 1 "$WORK/prep_$1.log")"
    PREP_DONE[$1]=1
  fi
  return "${PREP_DONE[$1]}"
}
need_family rna && prep rna "$PY" -m data_prep rnacentral --input "$RNA_FASTA" --output "$WORK/shards_rna" \
  --shard-size 500 --progress off
# ProtLingo's cluster shards: built by scripts/prepare_gpu_check.sh where data_prep's cluster join (DuckDB, pyarrow:
# 75 MB of wheels, not carried) is installed, copied here; else built here from the FASTA and the mapping
need_family protlingo && prep protlingo bash -c '{ if [ -f "$6/manifest.json" ]; then cp -r "$6" "$3/shards_protlingo" \
    && echo "data_prep ran where its cluster join is installed: the carried $6"; else "$PY" -m data_prep uniref --input "$1" \
    --clusters "$2" --output "$3/shards_protlingo" --shard-size 100 --progress off; fi; } \
  && "$PY" tools/make_random_esm2.py --size "$4" --out "$3/esm2_random" \
  && "$PY" tools/upcycle_esm2.py --esm "$3/esm2_random" --config "$5" --out "$3/protlingo_init" --perturb 0.01' \
  _ "$PROT_FASTA" "$PROT_TSV" "$WORK" "$ESM_SIZE" "$PROT_CONFIG" "$DATA/protein/shards"
need_family gpt && prep gpt bash -c '"$PY" -m data_prep train-spm --input "${@:3}" --output "$1/spm" --vocab-size "$2" \
  && "$PY" -m data_prep babylm --spm "$1/spm.model" --input "${@:3}" --output "$1/shards_gpt" --shard-size 4000 \
    --progress off' _ "$WORK" "$VOCAB" "${TEXTS[@]}"
echo "== data (background): $RNA_FASTA; $PROT_FASTA + $PROT_TSV, ESM2-$ESM_SIZE random start; ${#TEXTS[@]} texts"

# ---- the plan: every row's overrides checked against this tree's config code ---------------------------------------
COMMON=(tracking.enabled=false train.peak_flops_per_device=989e12 checkpoint.every_steps=1000000
        train.max_steps=1000000 optim.warmup_steps=100 train.log_every=10)
declare -A CONFIG_OF
CONFIG_OF[rna]=launchers/configs/eco_rna_80m.yaml CONFIG_OF[protlingo]=$PROT_CONFIG
CONFIG_OF[gpt]=launchers/configs/recursive_gpt_100m.yaml
FIX_rna=(data.train_shards="$WORK/shards_rna")
FIX_protlingo=(data.train_shards="$WORK/shards_protlingo" train.init_from="$WORK/protlingo_init")
# max_epochs: the carried text is ~0.6M tokens, so the config's 10 BabyLM epochs would end the run early
FIX_gpt=(data.train_shards="$WORK/shards_gpt" train.max_epochs=1000000 model.vocab_size="$VOCAB")
if [ "$DRY" = 1 ]; then  # tiny shapes of each family, a few steps on the CPU
  FIX_rna+=(model.d_model=64 model.n_heads=4 model.n_kv_heads=2 model.d_ff=128 model.n_prelude=1 model.n_core=1
            model.n_coda=1 data.context_length=64 train.micro_batch_size=4 train.max_tokens_per_microbatch=256)
  FIX_gpt+=(model.d_model=64 model.embed_dim=32 model.n_heads=2 model.recurrence=2 model.mlp_ratio=4.0
            data.context_length=64 train.micro_batch_size=8 train.global_batch_size=8)
  FIX_protlingo+=(data.context_length=64 train.micro_batch_size=4)
fi
: >"$WORK/runs.tsv"
for name in "${ORDER[@]}"; do
  fam=$(family_of "$name")
  declare -n own="OWN_$name" fix="FIX_$fam"
  sets=("${own[@]}")
  [ "${BASE_OF[$name]}" = - ] && sets=("${COMMON[@]}" "${fix[@]}" "${own[@]}")
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "${BASE_OF[$name]}" "${CONFIG_OF[$fam]}" "${WHAT_OF[$name]}" \
    "$(IFS=$'\x1f'; echo "${sets[*]}")" >>"$WORK/runs.tsv"
  unset -n own fix
done
# not held to the deadline: two seconds, and without it nothing trains
T=$B_PLAN T0=$SECONDS CUR=plan
echo "== plan (timeout $T s)"
run_in "$WORK/logs/plan.log" "$PY" bench/gpu_report.py plan --runs "$WORK/runs.tsv" --out "$WORK/plan.tsv"
cat "$WORK/logs/plan.log"
done_stage plan "$(awk -F'\t' '$3 == "run"' "$WORK/plan.tsv" 2>/dev/null | wc -l) of ${#ORDER[@]} trainings can run here"

# ---- the gpu-marked tests first: the cheapest first contact; one hung test costs GPU_TEST_TIMEOUT, not the lease ----
if [ "${#QUICK[@]}" = 0 ] && ! skipped tests && stage tests "$B_TESTS" 30; then
  # Only the files that hold gpu tests: a file that cannot be collected is reported without hiding the others.
  # --timeout-method thread: a test hung inside a CUDA call (torch's grouped GEMM backward with an empty expert,
  # pytorch#152668) never returns to Python for a signal; the thread dumps every stack and ends pytest.
  mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
  run_in "$WORK/logs/tests.log" "$PY" -m pytest -v -m gpu -rs --timeout "$TEST_TIMEOUT" --timeout-method thread \
    --continue-on-collection-errors -p no:cacheprovider "${files[@]}"
  grep -E ' (PASSED|FAILED|ERROR)|^(SKIPPED|FAILED|ERROR) |Timeout' "$WORK/logs/tests.log" | tail -n 40
  done_stage tests "$(grep -E '^=+ .*(passed|failed|error|skipped).* in ' "$WORK/logs/tests.log" | tail -n 1 | tr -d '=' | xargs)"
fi

# ---- bench/eco_rna_gpu.py: parity, and the training's packed path against padded -----------------------------------
if [ "${#QUICK[@]}" = 0 ] && ! skipped eco_rna && stage eco_rna "$B_ECO" 45; then
  if [ "$DRY" = 1 ]; then run_in "$WORK/logs/eco_rna.log" "$PY" bench/eco_rna_gpu.py --dry-run --repeats 1
  else run_in "$WORK/logs/eco_rna.log" "$PY" bench/eco_rna_gpu.py --lengths 512 --repeats 3; fi
  cat "$WORK/logs/eco_rna.log"
  done_stage eco_rna "$(grep -E '^RESULT P5' "$WORK/logs/eco_rna.log" | awk '{printf "%s%s %s", sep, $2, $3; sep = "; "}')"
fi

# ---- the trainings ----------------------------------------------------------------------------------------------------
plan_field() {  # NAME: "status<TAB>note<TAB>config<TAB>sets" of NAME in plan.tsv
  awk -F'\t' -v n="$1" '$1 == n {print $3 "\t" $4 "\t" $5 "\t" $7}' "$WORK/plan.tsv" 2>/dev/null
}
EVAL="" RNA_DONE=0
train() {  # NAME: one training of the plan through the real launcher, then its report, then pack
  local name=$1 fam seconds prof budget pstatus pnote config setline sets=() args=() sampler launched compiled=0
  fam=$(family_of "$name")
  IFS=$'\t' read -r pstatus pnote config setline <<<"$(plan_field "$name")"
  if [ "${pstatus:-}" != run ]; then
    echo "== $name: not run (${pnote:-no plan})"
    record "$name" skipped 0 - "${pnote:-the plan did not run}"
    return 1
  fi
  prepped "$fam" || { record "$name" "not run" 0 - "no data for $fam"; return 1; }
  IFS=$'\x1f' read -r -a sets <<<"$setline"
  case " ${sets[*]} " in *" train.compile=blocks "*) compiled=1 ;; esac
  if [ "${BASE_OF[$name]}" = - ]; then seconds=$TRAIN_S prof=$PROF; else seconds=$AB_S prof=$AB_PROF; fi
  # ProtLingo's steps (4 microbatches) took 1.8 s: its run reached step 12 in 45 s on the second run
  [ "$fam" = protlingo ] && prof=$(( prof < 5 ? prof : 5 ))
  [ "$compiled" = 1 ] && seconds=$(( seconds + COMPILE_S ))
  stage "$name" $(( seconds + B_TRAIN_EXTRA )) $(( seconds + 35 )) || return 1
  # train.max_hours ends the run cleanly (it checkpoints and exits) before the stage's timeout would kill it
  [ $(( T - 45 )) -lt "$seconds" ] && seconds=$(( T - 45 ))
  sets+=(run_dir="$WORK/run_$name" "train.profile={start: $prof, steps: 1}")
  if [ "$DRY" = 1 ]; then sets+=(train.max_steps=4 train.log_every=1 data.num_workers=0)
  else sets+=(train.max_hours="$("$PY" -c "print($seconds / 3600)")" data.num_workers=4); fi
  for s in "${sets[@]}"; do args+=(--set "$s"); done
  local against=""
  [ "${BASE_OF[$name]}" != - ] && against="; against ${BASE_OF[$name]}: $pnote"
  echo "   ${WHAT_OF[$name]} ($config), ${seconds} s of training, step $prof profiled$against"
  if [ "$DRY" = 1 ]; then "$PY" bench/gpu_report.py sample-util --out "$WORK/util_$name.csv" --fake &
  else "$PY" bench/gpu_report.py sample-util --out "$WORK/util_$name.csv" & fi
  sampler=$!
  BG_PIDS+=("$sampler")
  launched=$(date +%s.%N)
  # TORCH_LOGS: a compiled run logs its recompiles and graph breaks, so that a slow first step says why.
  local envs=(NPROC=1)
  [ "$compiled" = 1 ] && envs+=(TORCH_LOGS=recompiles,graph_breaks)
  # --log_level info: the launcher's spawn command (which python ran the ranks) stays in the log, CPU dry run included.
  run_in "$WORK/logs/$name.log" env "${envs[@]}" bash scripts/launch.sh --log_level info launchers/pretrain.py --ds_config ds_configs/zero2.json \
    --config "$config" --resume never "${args[@]}"
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  grep -E '^(resolved:|step |====|loss:)' "$WORK/logs/$name.log" | tail -n 5
  local note=""
  if [ -s "$WORK/run_$name/metrics.jsonl" ]; then
    # a run the timeout cut still has its steps: reported all the same, marked by the stage's status
    if bgwait timeout 120 "$PY" bench/gpu_report.py family --name "$name" --run "$WORK/run_$name" \
        --util "$WORK/util_$name.csv" --log "$WORK/logs/$name.log" --launched "$launched" \
        --json "$WORK/report_$name.json" >"$WORK/logs/report_$name.log" 2>&1; then
      cat "$WORK/logs/report_$name.log"
      note=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["digest"])' "$WORK/report_$name.json")
      trace=$(ls "$WORK/run_$name"/profile/trace_steps_*.json 2>/dev/null | head -n 1)
      if [ -n "$trace" ]; then
        # gzipped to the return limit: here when small (a stream gzip of a one-step trace takes a second or two, and
        # this stage's pack returns it), in the background when large (parsed and cut, off the GPU's critical path;
        # a later pack returns it)
        echo "$name" >>"$WORK/ret/order.txt"
        local cut=("$PY" bench/gpu_report.py cut-trace "$trace" "$WORK/ret/trace_$name.json.gz")
        if [ "$(stat -c %s "$trace")" -le $(( 64 * 1024 * 1024 )) ]; then
          bgwait timeout -k 10 60 "${cut[@]}" >"$WORK/ret/trace_$name.cut.txt" 2>&1
        else
          timeout -k 10 "$B_BG" "${cut[@]}" >"$WORK/ret/trace_$name.cut.txt" 2>&1 &
          BG_PIDS+=($!) CUT_PIDS+=($!)
        fi
      fi
    else
      cat "$WORK/logs/report_$name.log"
      fail "report_$name"
    fi
  fi
  [ "$RC" != 0 ] && { tail -n 30 "$WORK/logs/$name.log"; note="${note:+$note; }$(grep -v '^\s*$' "$WORK/logs/$name.log" | tail -n 1 | cut -c1-160)"; }
  done_stage "$name" "$note"
  [ "$RC" = 0 ]
}

for name in "${ORDER[@]}"; do
  want "$name" || continue
  if train "$name" && [ "$name" = rna ]; then RNA_DONE=1; fi
  if [ "$name" = rna ] && [ "$RNA_DONE" = 1 ] && [ "${#QUICK[@]}" = 0 ] && ! skipped eval; then
    # the reconstruction depth study of the Eco-RNA checkpoint, on the CPU beside the other trainings
    "$PY" - "$WORK/heldout.fasta" <<'PY'
import gzip
import sys

lines = gzip.open("data/samples/rfam_nrc_heldout_sample.fasta.gz", "rt").read().split(">")[1:65]
open(sys.argv[1], "w").write("".join(">" + r for r in lines))
PY
    depths=1-8
    [ "$DRY" = 1 ] && depths=1-4
    # Half the cores: the trainings beside it need the others to feed the GPU. Exit 1 (no depth effect beyond
    # the seeds' spread) is a result, not a failure of this step.
    OMP_NUM_THREADS=$(( ($(nproc) + 1) / 2 )) timeout -k 10 "$B_BG" "$PY" bench/depth_study.py \
      --checkpoint "$WORK/run_rna" --trust-checkpoint --heldout "$WORK/heldout.fasta" --depths "$depths" \
      --seeds "${GPU_EVAL_SEEDS:-0-2}" --out "$WORK/depth_study" >"$WORK/eval.log" 2>&1 &
    EVAL=$!
    BG_PIDS+=("$EVAL")
    T_EVAL=$SECONDS
    echo "== eval: the reconstruction depth study of $WORK/run_rna (CPU, background)"
  fi
done

if [ "${#QUICK[@]}" = 0 ] && [ "$DRY" = 0 ] && ! skipped moe && stage moe "$B_MOE" 15; then
  run_in "$WORK/logs/moe.log" "$PY" bench/moe_gpu.py
  cat "$WORK/logs/moe.log"
  done_stage moe "$(grep -iE 'ratio|grouped' "$WORK/logs/moe.log" | tail -n 1 | cut -c1-120)"
fi

case "$WITH" in *" depth "*)
  if stage depth_task 3600 60; then
    dargs=(--hops "${GPU_DEPTH_HOPS:-4}" --seeds 0 --out "$WORK/depth_task")
    [ "$DRY" = 1 ] && dargs+=(--steps 2 --stage2-steps 1 --records 300)
    run_in "$WORK/logs/depth_task.log" "$PY" bench/depth_task.py "${dargs[@]}"
    grep -E '^( *(model|recurrent|control)|held-out|depth task)' "$WORK/logs/depth_task.log" | tail -n 6
    [ "$RC" = 1 ] && RC=0  # exit 1: the acceptance figures not reached, a result and not a failure of this stage
    done_stage depth_task "$(grep -E '^depth task' "$WORK/logs/depth_task.log" | tail -n 1)"
  fi ;;
esac

# wait_bounded PID: wait for a background job of this shell while the deadline allows, else end it (RC 124)
wait_bounded() {
  while is_child "$1" && [ $(( DEADLINE - (SECONDS - START) - RESERVE )) -gt 0 ]; do sleep 1; done
  if is_child "$1"; then kill_tree "$1"; wait "$1" 2>/dev/null; RC=124; else wait "$1"; RC=$?; fi
}
if [ -n "$EVAL" ]; then
  echo "== eval: result"
  T=$B_BG T0=$T_EVAL CUR=eval
  wait_bounded "$EVAL"
  [ "$RC" = 1 ] && RC=0  # exit 1 (no depth effect beyond the seeds' spread) is a result
  if [ "$RC" = 0 ]; then grep -v -E 'Warning|warn\(|^ *return' "$WORK/eval.log" | tail -n 14
  else tail -n 30 "$WORK/eval.log"; fi
  done_stage eval "$(grep -E '^K=1 -> K=4' "$WORK/eval.log" | cut -c1-120)"
fi

# the data steps no training used (a skipped family): checked all the same in the full check, while time is left (they
# started first and take well under a minute)
if [ "${#QUICK[@]}" = 0 ] && [ $(( DEADLINE - (SECONDS - START) - RESERVE )) -gt 0 ]; then
  for fam in rna protlingo gpt; do
    if [ -n "${PREP_PID[$fam]:-}" ] && [ -z "${PREP_DONE[$fam]:-}" ]; then prepped "$fam"; fi
  done
fi
# the traces still being cut: waited for (each under its own timeout) so that the last pack returns them
for pid in "${CUT_PIDS[@]}"; do wait_bounded "$pid"; done
exit "$status"
