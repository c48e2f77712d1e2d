#!/usr/bin/env bash
# Supervised adaptation of the quickstart's Eco-RNA (runs/eco_rna_demo; docs/adaptation.md), on the CPU:
#   1. nRC family classification: fine-tune on the shipped nRC training sample (10% held out for validation), sweep
#      K = 1..8 on the shipped held-out sample;
#   2. bpRNA secondary structure: fine-tune on bpRNA VL0 (the nearest real training split at hand; TR0 reads the same
#      way), sweep on TS0; sequences of at most 126 nt, the demo model's window. Without ../shared/data the shipped
#      bpRNA fixtures (data/samples/tasks) stand in;
#   3. export both and load them with transformers' Auto classes in a process that cannot import this repository,
#      checking their predictions against the sweeps at K = 4.
#   bash scripts/adapt_demo.sh          # SHARED=DIR: the shared data folder (default ../shared/data); PY: the python
#                                       # (default .venv/bin/python when it exists, else python3)
# Each fine-tune runs on 2 ranks (NPROC) under ZeRO-2 and resumes when run again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PY  # scripts/launch.sh launches with the same python
SHARED=${SHARED:-../shared/data}
if [[ ! -f runs/eco_rna_demo/checkpoints/latest ]]; then
  echo "error: runs/eco_rna_demo has no checkpoint: run bash scripts/quickstart.sh first" >&2
  exit 2
fi
export TQDM_DISABLE=${TQDM_DISABLE:-1}
VL0=$SHARED/eval/structure/bpRNA_VL0.csv
TS0=$SHARED/eval/structure/bpRNA_TS0.csv
if [[ ! -f $VL0 || ! -f $TS0 ]]; then
  echo "note: $SHARED has no bpRNA VL0/TS0: using the shipped fixtures (data/samples/tasks), far smaller" >&2
  VL0=data/samples/tasks/bprna_vl0_sample.csv
  TS0=data/samples/tasks/bprna_ts0_sample.csv
fi

echo "== nRC: data, fine-tune, sweep"
"$PY" tools/prepare_task.py --task nrc --input data/samples/rfam_nrc_train_sample.fasta.gz \
  --output data/shards/nrc_demo --val-fraction 0.1 --force
bash scripts/launch.sh launchers/finetune.py --ds_config ds_configs/zero2.json \
  --config launchers/configs/finetune_nrc_demo.yaml --init-from runs/eco_rna_demo
"$PY" launchers/evaluate.py --checkpoint runs/nrc_demo --task nrc \
  --data data/samples/rfam_nrc_heldout_sample.fasta.gz --depths 1-8 --output runs/nrc_demo/eval-nrc-heldout.json

echo "== secondary structure: data, fine-tune, sweep"
"$PY" tools/prepare_task.py --task ssp --input "$VL0" --output data/shards/ssp_demo --val-fraction 0.1 \
  --max-length 126 --force
bash scripts/launch.sh launchers/finetune.py --ds_config ds_configs/zero2.json \
  --config launchers/configs/finetune_ssp_demo.yaml --init-from runs/eco_rna_demo
"$PY" launchers/evaluate.py --checkpoint runs/ssp_demo --task ssp --data "$TS0" --depths 1-8 \
  --output runs/ssp_demo/eval-ssp-ts0.json

echo "== export, and load where the repository cannot be imported"
"$PY" tools/convert_checkpoint.py --checkpoint runs/nrc_demo --output exports/nrc_demo --force
"$PY" tools/convert_checkpoint.py --checkpoint runs/ssp_demo --output exports/ssp_demo --force
"$PY" scripts/adapt_demo_load.py exports/nrc_demo runs/nrc_demo/eval-nrc-heldout.json \
  exports/ssp_demo runs/ssp_demo/eval-ssp-ts0.json "$TS0"
