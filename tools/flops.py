#!/usr/bin/env python
"""Print forward GFLOPs per recurrent depth from the config (paper 000, Eq. A.8-A.9), before building the model.

    python tools/flops.py --config launchers/configs/eco_rna_80m.yaml --length 512 --depths 1,4,8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--length", type=int, required=True, help="sequence length L in tokens")
    p.add_argument("--depths", default="1,4,8", help="comma-separated core applications K")
    args = p.parse_args(argv)
    from pipeline.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        depths = [int(k) for k in args.depths.split(",")]
        if args.length < 1 or any(k < 1 for k in depths):
            raise ConfigError("--length and --depths must be positive integers")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for k in depths:
        print(f"K={k}: {cfg.model.forward_flops(depth=k, length=args.length) / 1e9:.3f} GFLOPs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
