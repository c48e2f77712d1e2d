#!/usr/bin/env bash
# Eco-RNA's reason to exist, in a few minutes on 2 CPU cores (docs/depth_task.md, "The two-minute demo"): more core
# iterations K, better predictions. On the synthetic depth task every answer is H = 2 pointers away from its value,
# so it needs h = 3 sequential reads; one shared core block applied K times makes K reads. The script
#   1. writes the task with data_prep synthetic-hops (20,000 training records with 0-2 pointers; 500 held-out
#      records with 2, none of them in training),
#   2. trains launchers/configs/eco_rna_depth_demo.yaml through scripts/launch.sh (DeepSpeed ZeRO-2, one process),
#   3. evaluates the held-out answers at K = 1..8 with launchers/evaluate.py's reconstruction runner,
#   4. which draws accuracy and loss against K (the PNG path is printed), and checks the result: K = 1 within 0.15
#      of chance (1/5) and K = 3 at least 0.9, exit 1 when not.
# DEMO_DIR (default runs/depth_demo) holds the data, the run and the plots; it starts afresh each time. PY: an
# installed interpreter (default: install into .venv with scripts/setup.sh and use .venv/bin/python). Extra
# arguments go to launchers/pretrain.py, e.g. --set seed=7.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PY:-} ]]; then
  bash scripts/setup.sh
  PY=.venv/bin/python
fi
export PY  # scripts/launch.sh starts the training with it
# One thread: the model is tiny (d = 64, 32 records of 17 tokens a step), and on shared cores a second thread that
# waits for a busy core stalls every step (measured: 0.2-1.8 s a step with two threads, about 0.1 s with one)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DEMO=${DEMO_DIR:-runs/depth_demo}
TASK=(--hops 2 --slots 5 --queries 3)
show() { echo "+ $*" >&2; "$@"; }  # every step is printed as a command that can be run alone

rm -rf "$DEMO/run"  # a fresh run: the demo's numbers are those of its own training, never of a resumed one
show "$PY" -m data_prep synthetic-hops "${TASK[@]}" --records 20000 --seed 0 --output "$DEMO/data/train" --overwrite
show "$PY" -m data_prep synthetic-hops "${TASK[@]}" --min-hops 2 --records 500 --seed 1 \
  --exclude "$DEMO/data/train" --output "$DEMO/data/heldout" --overwrite
SECONDS=0
show env NPROC=1 bash scripts/launch.sh launchers/pretrain.py --ds_config ds_configs/zero2.json \
  --config launchers/configs/eco_rna_depth_demo.yaml --resume never --set "run_dir=$DEMO/run" \
  --set "data.train_shards=$DEMO/data/train" --set "data.val_shards=[$DEMO/data/heldout]" "$@"
echo "trained in $SECONDS s; held-out validation during training: $DEMO/run/validation.png" >&2
show env TQDM_DISABLE=1 "$PY" launchers/evaluate.py --checkpoint "$DEMO/run" --task reconstruction \
  --data "$DEMO/data/heldout" --depths 1-8 --output "$DEMO/eval-reconstruction.json" --no-mlflow
# The verdict, from the JSON evaluate.py wrote (chance: the commonest held-out answer's share, about 1/5)
"$PY" - "$DEMO/eval-reconstruction.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
acc, chance = {int(k): v["accuracy"] for k, v in r["per_depth"].items()}, r["chance"]["accuracy"]
ok = acc[1] <= chance + 0.15 and acc[3] >= 0.9
print(f"depth demo: K=1 accuracy {acc[1]:.3f} (chance {chance:.3f}), K=3 accuracy {acc[3]:.3f}, "
      f"K=8 accuracy {acc[8]:.3f}: {'more core iterations, better predictions' if ok else 'NOT the expected gain'}")
sys.exit(0 if ok else 1)
EOF
