#!/usr/bin/env bash
# Fresh machine -> a real Eco-RNA training: install, shard the shipped Rfam sample, train 100 steps with
# 2 DeepSpeed processes under ZeRO-2 (CPU is fine), validating on the shipped held-out sample. Extra arguments go
# to launchers/pretrain.py, e.g.
#   bash scripts/quickstart.sh --set train.max_steps=200     # resumes from the last checkpoint and goes on
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SHARDS=data/shards/rfam_demo
if [[ ! -f $SHARDS/manifest.json ]]; then
  .venv/bin/python -m data_prep rnacentral --input data/samples/rfam_nrc_train_sample.fasta.gz \
    --output "$SHARDS" --shard-size 300
fi
VAL=data/shards/rfam_demo_val  # the shipped held-out sample (211 sequences, none in training): validation
if [[ ! -f $VAL/manifest.json ]]; then
  .venv/bin/python -m data_prep rnacentral --input data/samples/rfam_nrc_heldout_sample.fasta.gz --output "$VAL"
fi
# validation every 25 steps at K = 1, 2, 4, 8 (val/... in metrics.jsonl and MLflow, RUN_DIR/validation.png)
exec bash scripts/launch.sh launchers/pretrain.py --ds_config ds_configs/zero2.json \
  --set eval.every=25 --set "data.val_shards=[$VAL]" "$@"
