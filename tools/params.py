#!/usr/bin/env python
"""Print a model's parameter count from its config, before (and without) building it.

    python tools/params.py --config launchers/configs/eco_rna_80m.yaml [--set model.d_model=512] [--build]
    python tools/params.py --config standard_h384

--config is a file or the name of one in launchers/configs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a config file, or a name in launchers/configs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.d_model=512 (repeatable)")
    p.add_argument("--build", action="store_true", help="also build the model and count its parameters")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.config_files import resolve_config

    try:
        cfg = load_config(resolve_config(args.config), args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = cfg.model.num_params()
    active = getattr(cfg.model, "num_active_params", cfg.model.num_params)()
    buffers = getattr(cfg.model, "num_buffer_values", lambda: 0)()
    print(f"{cfg.family}: parameters: total {total:,} ({total / 1e6:.2f}M), active {active:,} ({active / 1e6:.2f}M)")
    print(f"buffers: {buffers:,} values (saved state, not parameters)")
    if args.build:
        from pipeline.families import get_family

        model = get_family(cfg.family).build_model(cfg.model)
        built = sum(q.numel() for q in model.parameters())
        names = {n for n, _ in model.named_parameters()}
        built_buffers = sum(v.numel() for k, v in model.state_dict().items() if k not in names)
        same = built == total and built_buffers == buffers
        print(f"built model: {built:,} parameters, {built_buffers:,} buffer values "
              f"({'matches' if same else 'DIFFERS FROM'} the config counts)")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
