#!/usr/bin/env python
"""Pretraining entry point.

    deepspeed --num_gpus 2 launchers/pretrain.py --ds_config ds_configs/zero2.json \
        [--config launchers/configs/NAME.yaml] [--set key.path=value ...] [--resume auto|never|CHECKPOINT_DIR]

Without --config it trains the small Eco-RNA demo on the sample shards that scripts/quickstart.sh builds.
"""
from __future__ import annotations

import argparse
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
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.data.shards import ShardError
    from pipeline.engine import run

    is_rank0 = os.environ.get("RANK", "0") == "0"
    try:
        cfg = load_config(args.config, args.overrides)
        run(cfg, args.ds_config, args.resume)
    except (ConfigError, ShardError, FileNotFoundError) as e:
        if is_rank0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
