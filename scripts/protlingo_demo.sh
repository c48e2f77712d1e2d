#!/usr/bin/env bash
# ProtLingo CPU demo: install, shard the shipped UniRef cluster sample (400 UniRef50 clusters, 771 UniRef90 members),
# write a random ESM2-8M-shaped backbone (no ESM2 weights can be downloaded here; with real weights, pass
# ESM=path/to/esm2_t6_8M_UR50D), upcycle it (MoE + memory, launchers/configs/protlingo_demo.yaml), train 120 steps
# with 2 DeepSpeed processes under ZeRO-2 with cluster sampling, validating every 40 steps on the shipped
# held-out clusters, then score ProteinGym's BLAT_ECOLX assay when
# ../shared/data is there. Extra arguments go to launchers/pretrain.py, e.g. --set train.max_steps=200.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
SHARDS=data/shards/uniref_demo
ESM=${ESM:-exports/esm2_random_8M}
INIT=exports/protlingo_demo_init  # the config's train.init_from
if [[ ! -f $SHARDS/manifest.json ]]; then
  $PY -m data_prep uniref --input data/samples/uniref90_clusters_sample.fasta.gz \
    --clusters data/samples/uniref50_to_uniref90_sample.tsv --output "$SHARDS" --shard-size 25
fi
VAL=data/shards/uniref_demo_val  # the shipped held-out clusters (none in training): the config's validation set
if [[ ! -f $VAL/manifest.json ]]; then
  $PY -m data_prep uniref --input data/samples/uniref90_heldout_sample.fasta.gz --output "$VAL"
fi
[[ -f $ESM/config.json ]] || $PY tools/make_random_esm2.py --size 8M --out "$ESM"
if [[ ! -f $INIT/model.safetensors ]]; then
  # --perturb: routed experts 1..E-1 start slightly apart from the exact copy, so routing has something to choose
  $PY tools/upcycle_esm2.py --esm "$ESM" --config launchers/configs/protlingo_demo.yaml --out "$INIT" --perturb 0.01
fi
# validation every 40 steps (40, 80, 120): held-out loss, perplexity and routing statistics, RUN_DIR/validation.png
bash scripts/launch.sh launchers/pretrain.py --ds_config ds_configs/zero2.json \
  --config launchers/configs/protlingo_demo.yaml --set eval.every=40 --set "data.val_shards=[$VAL]" "$@"
ASSAY=../shared/data/eval/proteingym/BLAT_ECOLX_Jacquier_2013.csv
if [[ -f $ASSAY ]]; then
  $PY launchers/evaluate.py --checkpoint runs/protlingo_demo --task proteingym --data "$ASSAY"
fi
