#!/usr/bin/env bash
# The one prepared GPU check, about 6-7 minutes on one H200, under 8 with start-up (docs/gpu_check.md). Run from
# anywhere:
#   bash bench/gpu.sh              on a CUDA host
#   bash bench/gpu.sh --dry-run    on any machine: every step on the CPU with tiny models, a few training steps (checks
#                                  this script, its commands and their arguments; the figures mean nothing)
# No step needs the repository's .venv: PY (below) runs everything, the launcher included (scripts/launch.sh).
# Steps, each timed; a failed step is reported and the later steps still run:
#   1. environment; the wheels of GPU_WHEELS installed offline into GPU_SITE when they are for this python (a GPU
#      image without DeepSpeed, WebDataset, isal ... and without a package registry: bash scripts/prepare_gpu_check.sh
#      makes them on a machine with one); MegaBlocks built when build/gpu_kernels holds its sources.
#   2. on the CPU, in the background: each family's data through data_prep (RNAcentral or the shipped Rfam sample;
#      UniRef90 members of UniRef50 clusters; English text with a 32,768-piece sentencepiece model) and ProtLingo's
#      start: a random ESM2-150M of the real shape (tools/make_random_esm2.py; no weights can be downloaded) upcycled
#      to protlingo_150m.yaml's MoE and memory (tools/upcycle_esm2.py).
#   3. bench/eco_rna_gpu.py: flash / unpadded / SDPA parity on the Eco-RNA wavefront, Eco-RNA 80M fwd+bwd MFU (P5).
#   4. bench/moe_gpu.py: the MoE backends' parity and speed.
#   5. per family, GPU_TRAIN_SECONDS of training through the real launcher (scripts/launch.sh: deepspeed runner,
#      ZeRO-2, bf16, one GPU) with step GPU_PROFILE_STEP recorded by torch.profiler and nvidia-smi sampling GPU
#      utilization every 200 ms; then bench/gpu_report.py prints median tokens/s and MFU after warm-up, step-time
#      p50/p90/max, peak GPU memory, utilization and the profiled step's kernel classes and idle time:
#        rna        Eco-RNA 80M       launchers/configs/eco_rna_80m.yaml
#        protlingo  ProtLingo 150M    launchers/configs/protlingo_150m.yaml (MoE in 27 blocks, memory in 3)
#        gpt        RecursiveGPT 124M launchers/configs/recursive_gpt_100m.yaml (124.03M parameters, R = 24)
#   6. the reconstruction depth study of the Eco-RNA checkpoint (bench/depth_study.py --checkpoint: K = 1-8 at each
#      GPU_EVAL_SEEDS seed; on the CPU, in the background during the other trainings).
#   7. the gpu-marked tests.
#   8. only with GPU_WITH=depth (minutes; left out of the 8-minute check): the synthetic depth task
#      (bench/depth_task.py, one seed, H = GPU_DEPTH_HOPS).
#   Only with GPU_WITH=compiled: after the Eco-RNA training of step 5, a second one with compiled blocks
#      (train.compile=blocks) and twice the tokens per microbatch (the memory the fused RMSNorm freed), key rna_compiled.
# Environment:
#   PY                 the python to use (default .venv/bin/python when it exists, else python3)
#   GPU_WORK           scratch folder (default /tmp/bench_gpu; emptied first)
#   GPU_WHEELS         the carried wheels (default build/gpu_wheels)
#   GPU_DATA           the carried data (default build/gpu_data; missing files fall back on data/samples, docs/*.md)
#   GPU_SITE           where the carried wheels are installed (default GPU_WORK/site)
#   GPU_TRAIN_SECONDS  each family's training budget after start-up (train.max_hours; default 60)
#   GPU_PROFILE_STEP   the step torch.profiler records (default 15; after the warm-up, before the budget runs out)
#   GPU_SKIP           steps to leave out: eco_rna moe rna protlingo gpt eval tests (a family's data step still runs)
#   GPU_WITH           extra steps: depth compiled
#   GPU_DEPTH_HOPS     pointers of the depth task's held-out answers (default 4)
#   GPU_INSTALL        0: never build MegaBlocks here
#   GPU_EVAL_SEEDS     evaluation seeds of step 6 (default 0-2)
#   GPU_ARTIFACTS      folder to copy metrics, reports, traces and logs into (default $OUT if set)
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  -h|--help) sed -n '2,44p' "$0"; exit 0 ;;
  *) echo "bench/gpu.sh: unknown argument '$1' (see --help)"; exit 2 ;;
esac
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
TRAIN_S=${GPU_TRAIN_SECONDS:-60}
PROF=${GPU_PROFILE_STEP:-15}
ARTIFACTS=${GPU_ARTIFACTS:-${OUT:-}}
SKIP=" ${GPU_SKIP:-} " WITH=" ${GPU_WITH:-} "
[ "$DRY" = 1 ] && PROF=2
status=0
fail() { echo "bench/gpu.sh: FAILED: $*"; status=1; }
skip() { case "$SKIP" in *" $1 "*) echo "== $1: skipped (GPU_SKIP)"; return 0 ;; esac; return 1; }
took() { echo "($(( SECONDS - $1 )) s)"; }
START=$SECONDS
rm -rf "$WORK" && mkdir -p "$WORK" || { echo "bench/gpu.sh: cannot create $WORK"; exit 1; }

echo "== environment"
if [ "$DRY" = 0 ]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "bench/gpu.sh: torch sees no CUDA device; nothing to check here (--dry-run checks the script)"; exit 1; }
fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  # Installed in the dry run too (the first GPU run's missing isal hid behind a dry run that skipped this), when
  # every wheel fits this python; the cp312 wheels of the GPU host do not fit another one (this machine's venv).
  if "$PY" - "$WHEELS"/*.whl <<'PY'
import sys
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

here = set(sys_tags())
bad = [p for p in sys.argv[1:] if not parse_wheel_filename(Path(p).name)[3] & here]
if bad:
    print(f"{len(bad)} of the wheels are not for this python, e.g. {Path(bad[0]).name}")
sys.exit(1 if bad else 0)
PY
  then
    t=$SECONDS
    # --no-deps: the folder holds every missing package and the image holds the rest (torch, numpy, ...), which an
    # offline resolver could not fetch again; --target keeps the image's own site-packages untouched.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl && echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE" \
      || fail "installing $WHEELS"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    took $t
  elif [ "$DRY" = 1 ]; then
    echo "dry run: $WHEELS left uninstalled (see above)"
  else
    fail "$WHEELS does not fit $PY (bash scripts/prepare_gpu_check.sh with GPU_PYTHON = this host's python)"
  fi
fi
"$PY" - "$DRY" <<'PY'
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

if [ "$DRY" = 0 ] && [ "${GPU_INSTALL:-1}" != 0 ] && ! "$PY" -c 'import megablocks' >/dev/null 2>&1; then
  if [ -f build/gpu_kernels/megablocks-0.10.0.tar.gz ]; then
    echo "== building MegaBlocks from build/gpu_kernels (minutes: beyond this check's 8-minute budget)"
    t=$SECONDS
    bash scripts/install_gpu_kernels.sh --from build/gpu_kernels --no-flash-attn || fail "MegaBlocks build"
    took $t
  else
    echo "== MegaBlocks is not installed and build/gpu_kernels has no source archives: its paths skip"
  fi
fi

# Step 2: each family's data (and ProtLingo's start), built on the CPU while steps 3-4 use the GPU.
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
  echo "note: no text in $DATA/text; RecursiveGPT trains on docs/*.md with an 8,192-piece vocabulary" \
    "(86.3M parameters, not 124M)"
fi
PROT_CONFIG=launchers/configs/protlingo_150m.yaml ESM_SIZE=150M
[ "$DRY" = 1 ] && PROT_CONFIG=launchers/configs/protlingo_demo.yaml ESM_SIZE=8M  # its tiny MoE + memory shape
declare -A PREP_PID
prep() {  # NAME COMMAND...: run in the background, output to WORK/prep_NAME.log
  local name=$1; shift
  ( "$@" ) >"$WORK/prep_$name.log" 2>&1 &
  PREP_PID[$name]=$!
}
prepped() {  # NAME: wait for its data step (each family's own, so Eco-RNA need not wait for the ESM2 start)
  if wait "${PREP_PID[$1]}"; then
    echo "data $1: $(grep -E '^data_prep' "$WORK/prep_$1.log" | tail -n 1)"
  else
    tail -n 20 "$WORK/prep_$1.log"
    fail "data for $1"
    return 1
  fi
}
prep rna "$PY" -m data_prep rnacentral --input "$RNA_FASTA" --output "$WORK/shards_rna" --shard-size 500 \
  --progress off
prep protlingo bash -c '"$PY" -m data_prep uniref --input "$1" --clusters "$2" --output "$3/shards_protlingo" \
    --shard-size 100 --progress off \
  && "$PY" tools/make_random_esm2.py --size "$4" --out "$3/esm2_random" \
  && "$PY" tools/upcycle_esm2.py --esm "$3/esm2_random" --config "$5" --out "$3/protlingo_init" --perturb 0.01' \
  _ "$PROT_FASTA" "$PROT_TSV" "$WORK" "$ESM_SIZE" "$PROT_CONFIG"
prep gpt bash -c '"$PY" -m data_prep train-spm --input "${@:3}" --output "$1/spm" --vocab-size "$2" \
  && "$PY" -m data_prep babylm --spm "$1/spm.model" --input "${@:3}" --output "$1/shards_gpt" --shard-size 4000 \
    --progress off' _ "$WORK" "$VOCAB" "${TEXTS[@]}"
echo "== data (background): $RNA_FASTA; $PROT_FASTA + $PROT_TSV, ESM2-$ESM_SIZE random start; ${#TEXTS[@]} texts"

if ! skip eco_rna; then
  echo "== bench/eco_rna_gpu.py"
  t=$SECONDS
  if [ "$DRY" = 1 ]; then "$PY" bench/eco_rna_gpu.py --dry-run --repeats 1 || fail "bench/eco_rna_gpu.py"
  else "$PY" bench/eco_rna_gpu.py || fail "bench/eco_rna_gpu.py"; fi
  took $t
fi

if [ "$DRY" = 0 ] && ! skip moe; then
  echo "== bench/moe_gpu.py"
  t=$SECONDS
  "$PY" bench/moe_gpu.py || fail "bench/moe_gpu.py"
  took $t
fi

# Step 5. train_family KEY NAME CONFIG SET...: GPU_TRAIN_SECONDS through scripts/launch.sh on one GPU, then the report.
REPORTS=()
train_family() {
  local key=$1 name=$2 config=$3 t=$SECONDS run=$WORK/run_$1 sampler rc
  shift 3
  echo "== training: $name ($config), ${TRAIN_S} s, real launcher, profile of step $PROF"
  local sets=(run_dir="$run" tracking.enabled=false train.peak_flops_per_device=989e12 checkpoint.every_steps=1000000
              train.max_steps=1000000 optim.warmup_steps=100 train.log_every=10 "train.profile={start: $PROF, steps: 1}"
              "$@")
  if [ "$DRY" = 1 ]; then
    sets+=(train.max_steps=4 train.log_every=1 data.num_workers=0)
  else
    sets+=(train.max_hours="$("$PY" -c "print($TRAIN_S / 3600)")" data.num_workers=4)
  fi
  local args=()
  for s in "${sets[@]}"; do args+=(--set "$s"); done
  if [ "$DRY" = 1 ]; then "$PY" bench/gpu_report.py sample-util --out "$WORK/util_$key.csv" --fake &
  else "$PY" bench/gpu_report.py sample-util --out "$WORK/util_$key.csv" & fi
  sampler=$!
  # --log_level info: the launcher's spawn command (which python ran the ranks) stays in the log, CPU dry run included
  NPROC=1 bash scripts/launch.sh --log_level info launchers/pretrain.py --ds_config ds_configs/zero2.json \
    --config "$config" --resume never "${args[@]}" >"$WORK/train_$key.log" 2>&1
  rc=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  if [ "$rc" = 0 ]; then
    grep -E '^(step |====|loss:)' "$WORK/train_$key.log" | tail -n 4
    "$PY" bench/gpu_report.py family --name "$name" --run "$run" --util "$WORK/util_$key.csv" \
      --json "$WORK/report_$key.json" && REPORTS+=("$WORK/report_$key.json") || fail "report of $name"
  else
    tail -n 30 "$WORK/train_$key.log"
    fail "training $name"
  fi
  took "$t"
  return "$rc"
}

TINY_RNA=() TINY_PROT=() TINY_GPT=()
if [ "$DRY" = 1 ]; then
  TINY_RNA=(model.d_model=64 model.n_heads=4 model.n_kv_heads=2 model.d_ff=128 model.n_prelude=1 model.n_core=1
            model.n_coda=1 data.context_length=64 train.micro_batch_size=4 train.max_tokens_per_microbatch=256)
  TINY_GPT=(model.d_model=64 model.embed_dim=32 model.n_heads=2 model.recurrence=2 model.mlp_ratio=4.0
            data.context_length=64 train.micro_batch_size=8 train.global_batch_size=8)
  TINY_PROT=(data.context_length=64 train.micro_batch_size=4)
fi
RNA_RUN=$WORK/run_rna TRAINED=0
if prepped rna && ! skip rna; then
  train_family rna "Eco-RNA 80M" launchers/configs/eco_rna_80m.yaml data.train_shards="$WORK/shards_rna" \
    "${TINY_RNA[@]}" && TRAINED=1
fi

case "$WITH" in *" compiled "*)
  if [ -d "$WORK/shards_rna" ]; then
    train_family rna_compiled "Eco-RNA 80M compiled" launchers/configs/eco_rna_80m.yaml data.train_shards="$WORK/shards_rna" \
      train.compile=blocks train.micro_batch_size=64 train.max_tokens_per_microbatch=32768 "${TINY_RNA[@]}"
  fi ;;
esac

EVAL=""
if [ "$TRAINED" = 1 ] && ! skip eval; then
  echo "== reconstruction depth study (CPU, background) of $RNA_RUN"
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
  (OMP_NUM_THREADS=$(( ($(nproc) + 1) / 2 )) "$PY" bench/depth_study.py --checkpoint "$RNA_RUN" --trust-checkpoint \
    --heldout "$WORK/heldout.fasta" --depths "$depths" --seeds "${GPU_EVAL_SEEDS:-0-2}" --out "$WORK/depth_study" \
    >"$WORK/eval.log" 2>&1; [ $? -le 1 ]) &
  EVAL=$!
  t_eval=$SECONDS
fi

if prepped protlingo && ! skip protlingo; then
  # the run's own config (grad_accum_steps 4: a step is 4 microbatches of 16,384 tokens) from the random ESM2 start
  # profiled at step 5 at most: its 1.8 s steps (4 microbatches) reached only step 12 in 45 s on the second run
  train_family protlingo "ProtLingo 150M" "$PROT_CONFIG" data.train_shards="$WORK/shards_protlingo" \
    train.init_from="$WORK/protlingo_init" "train.profile={start: $(( PROF < 5 ? PROF : 5 )), steps: 1}" "${TINY_PROT[@]}"
fi
if prepped gpt && ! skip gpt; then
  # max_epochs: the carried text is ~0.6M tokens, so the config's 10 BabyLM epochs would end the run early
  train_family gpt "RecursiveGPT 124M" launchers/configs/recursive_gpt_100m.yaml data.train_shards="$WORK/shards_gpt" \
    train.max_epochs=1000000 model.vocab_size="$VOCAB" "${TINY_GPT[@]}"
fi

if [ "$DRY" = 0 ] && ! skip tests; then
  echo "== gpu-marked tests"
  # Only the files that hold gpu tests: a file that cannot be collected is reported without hiding the others.
  mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
  t=$SECONDS
  "$PY" -m pytest -q -m gpu -rs --continue-on-collection-errors -p no:cacheprovider "${files[@]}" || fail "gpu tests"
  took $t
fi

case "$WITH" in *" depth "*)
  echo "== synthetic depth task, H = ${GPU_DEPTH_HOPS:-4} (bench/depth_task.py)"
  t=$SECONDS
  dargs=(--hops "${GPU_DEPTH_HOPS:-4}" --seeds 0 --out "$WORK/depth_task")
  [ "$DRY" = 1 ] && dargs+=(--steps 2 --stage2-steps 1 --records 300)
  # Exit 1 (the acceptance figures not reached) is a result, not a failure of this step.
  "$PY" bench/depth_task.py "${dargs[@]}" >"$WORK/depth_task.log" 2>&1
  rc=$?
  grep -E '^( *(model|recurrent|control)|held-out|depth task)' "$WORK/depth_task.log" | tail -n 6
  [ "$rc" -le 1 ] || { tail -n 20 "$WORK/depth_task.log"; fail "depth task"; }
  took $t ;;
esac

if [ -n "$EVAL" ]; then
  echo "== reconstruction depth study: result"
  if wait "$EVAL"; then grep -v -E 'Warning|warn\(|^ *return' "$WORK/eval.log" | tail -n 14
  else tail -n 30 "$WORK/eval.log"; fail "reconstruction depth study"; fi
  echo "($(( SECONDS - t_eval )) s, from its start)"
fi

if [ "${#REPORTS[@]}" -gt 0 ]; then
  echo "== per family"
  "$PY" - "${REPORTS[@]}" <<'PY'
import json
import sys

print(f"{'family':18} {'tokens/s':>9} {'MFU':>6} {'util':>5} {'p50 ms':>7} {'p90 ms':>7} {'max/med':>7} {'peak GiB':>8}"
      f" {'idle':>5}")
for path in sys.argv[1:]:
    r = json.load(open(path))
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    util = f"{r['util']['mean']:.0f}%" if r["util"] else "n/a"
    mem = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "n/a"
    idle = f"{r['profile']['idle_ms'] / r['profile']['wall_ms']:.0%}" if r["profile"] else "n/a"
    s = r["step_ms"]
    print(f"{r['family']:18} {r['tokens_per_s']:9.0f} {mfu:>6} {util:>5} {s['p50']:7.0f} {s['p90']:7.0f} "
          f"{s['max_over_median']:7.2f} {mem:>8} {idle:>5}")
PY
fi

if [ -n "$ARTIFACTS" ] && mkdir -p "$ARTIFACTS" 2>/dev/null; then
  for key in rna rna_compiled protlingo gpt; do
    [ -f "$WORK/run_$key/metrics.jsonl" ] && cp "$WORK/run_$key/metrics.jsonl" "$ARTIFACTS/metrics_$key.jsonl"
    for tr in "$WORK/run_$key"/profile/trace_steps_*.json; do
      [ -f "$tr" ] && gzip -c "$tr" >"$ARTIFACTS/trace_${key}_$(basename "$tr").gz"
    done
  done
  for f in "$WORK"/report_*.json "$WORK"/util_*.csv "$WORK"/train_*.log "$WORK"/prep_*.log \
           "$WORK/depth_study/depth_study.json" "$WORK/eval.log" "$WORK/depth_task/depth_task.json" \
           "$WORK/depth_task.log"; do
    [ -f "$f" ] && cp "$f" "$ARTIFACTS/"
  done
  echo "copied metrics, reports, utilization samples, gzipped traces and the logs to $ARTIFACTS"
fi
echo "bench/gpu.sh: $(( SECONDS - START )) s in all"
[ "$status" = 0 ] && echo "bench/gpu.sh: every step passed"
exit "$status"
