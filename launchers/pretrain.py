#!/usr/bin/env python
"""Pretraining entry point.

    deepspeed --num_gpus 2 launchers/pretrain.py --ds_config ds_configs/zero2.json \
        [--config launchers/configs/NAME.yaml] [--set key.path=value ...] [--resume auto|never|CHECKPOINT_DIR]
        [--init-from CHECKPOINT_OR_EXPORT]

Without --config it trains the small Eco-RNA demo on the sample shards that scripts/quickstart.sh builds.
--resume continues this same run; --init-from starts a new run (own run_dir, step 0, own schedule, new MLflow run
tagged with its parent) from another run's checkpoint or an export, e.g. Stage B from Stage A.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_CONFIG = REPO / "launchers" / "configs" / "eco_rna_demo.yaml"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds_config", required=True, help="DeepSpeed JSON config (ds_configs/zero{1,2,3}.json)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="run config YAML (default: the Eco-RNA demo)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=200 (repeatable)")
    p.add_argument("--resume", default="auto",
                   help="auto: continue from RUN_DIR/checkpoints/latest if any; never: start fresh; or a "
                        "checkpoint tag directory")
    p.add_argument("--init-from", dest="init_from", default=None, metavar="DIR",
                   help="start a new run from another run's weights: a run dir, checkpoint tag dir or export "
                        "(sets train.init_from; train.init_from_optimizer: true also loads the AdamW moments)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.data.shards import ShardError
    from pipeline.engine import run

    is_rank0 = os.environ.get("RANK", "0") == "0"
    try:
        # --init-from is train.init_from (validated with the rest); JSON quoting keeps any path a YAML string.
        extra = [f"train.init_from={json.dumps(args.init_from)}"] if args.init_from is not None else []
        cfg = load_config(args.config, [*args.overrides, *extra])
        run(cfg, args.ds_config, args.resume)
    except (ConfigError, ShardError, FileNotFoundError) as e:
        if is_rank0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
