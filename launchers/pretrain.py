#!/usr/bin/env python
"""Pretraining entry point.

    deepspeed --num_gpus 2 launchers/pretrain.py --ds_config ds_configs/zero2.json \
        [--config launchers/configs/NAME.yaml] [--set key.path=value ...] [--resume auto|never|CHECKPOINT_DIR]
        [--init-from CHECKPOINT_OR_EXPORT] [--allow-config-change]

Without --config it trains the small Eco-RNA demo on the sample shards that scripts/quickstart.sh builds.
--resume continues this same run; --init-from starts a new run (own run_dir, step 0, own schedule, new MLflow run
tagged with its parent) from another run's checkpoint or an export, e.g. Stage B from Stage A.

Exit status: 0 when the run finished, reached its budget, or stopped on SIGTERM/SIGUSR1 or train.max_hours after
writing a checkpoint; 2 for a bad input (config, ds_config, data, checkpoint); 3 when training diverged
(train.max_nonfinite_steps); 1 for anything else. Every rank's output also goes to RUN_DIR/train.log.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
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
                   help="auto: continue from RUN_DIR/checkpoints/latest (or the newest complete checkpoint) if any; "
                        "never: start fresh; or a checkpoint tag directory of this run (a rollback)")
    p.add_argument("--init-from", dest="init_from", default=None, metavar="DIR",
                   help="start a new run from another run's weights: a run dir, checkpoint tag dir or export "
                        "(sets train.init_from; train.init_from_optimizer: true also loads the AdamW moments)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even though the seed, batch arithmetic or data spec differ from the checkpoint's")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p.parse_args(argv)


def main(argv=None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    from pipeline import run_log

    run_log.install(rank)  # before DeepSpeed's loggers capture the streams: everything reaches train.log
    args = parse_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.data.shards import ShardError

    try:
        # --init-from is train.init_from (validated with the rest); JSON quoting keeps any path a YAML string.
        extra = [f"train.init_from={json.dumps(args.init_from)}"] if args.init_from is not None else []
        cfg = load_config(args.config, [*args.overrides, *extra])
        from pipeline import engine

        engine.run(cfg, args.ds_config, args.resume, args.allow_config_change)
    except (ConfigError, ShardError, FileNotFoundError) as e:
        run_log.report_fatal(rank, str(e), rank_specific=_distributed())
        return 2
    except Exception as e:  # noqa: BLE001 - every rank's fatal error reaches the console, one line each
        from pipeline.engine import CheckpointWriteError, TrainingStopped

        if not isinstance(e, (CheckpointWriteError, TrainingStopped)):
            traceback.print_exc()  # a bug or a failed peer: the stack matters
        message = str(e) if isinstance(e, (CheckpointWriteError, TrainingStopped)) else f"{type(e).__name__}: {e}"
        run_log.report_fatal(rank, message.strip().splitlines()[0] if message.strip() else type(e).__name__,
                             rank_specific=True)
        return 3 if isinstance(e, TrainingStopped) else 1
    return 0


def _distributed() -> bool:
    """Whether the ranks had started working together (their errors may differ) when the error was raised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


if __name__ == "__main__":
    sys.exit(main())
