#!/usr/bin/env python
"""Export a DeepSpeed ZeRO (stage 1-3) checkpoint to a consolidated fp32 safetensors directory.

    python tools/convert_checkpoint.py --checkpoint runs/eco_rna_demo --output exports/demo

The output holds ``model.safetensors`` (the full fp32 state dict, independent of the world size and ZeRO stage that
wrote it), ``config.yaml`` and ``export.json``; launchers/evaluate.py and pipeline.checkpoint load it directly.
ProtLingo MoE checkpoints of any expert-parallel size (``train.expert_parallel_size``: one DeepSpeed file per expert,
which DeepSpeed's own zero_to_fp32.py cannot read) export to the single-process model's names, every routed expert
under its global id, from the fp32 masters (pipeline.checkpoint.load_state_dict).
DeepSpeed checkpoints are pickles: share exports, which load without executing code.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run dir, its checkpoints/ dir, or a tag dir")
    p.add_argument("--output", required=True, type=Path)
    args = p.parse_args(argv)
    from safetensors.torch import save_file

    from pipeline.checkpoint import EXPORTED_WEIGHTS, load_trained_model
    from pipeline.config import ConfigError

    try:
        if args.output.exists() and any(args.output.iterdir()):
            raise ConfigError(f"{args.output}: exists and is not empty")
        trained = load_trained_model(args.checkpoint)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tmp = args.output.with_name(args.output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in trained.model.state_dict().items()}
    save_file(state, str(tmp / EXPORTED_WEIGHTS))
    shutil.copy(trained.tag_dir / "config.yaml", tmp / "config.yaml")
    meta = {k: trained.client_state.get(k) for k in ("step", "world_size", "mlflow_run_id", "mlflow_tracking_uri")}
    (tmp / "export.json").write_text(json.dumps({"source": str(trained.tag_dir), **meta}, indent=1))
    if args.output.exists():
        args.output.rmdir()
    tmp.rename(args.output)
    n = sum(v.numel() for v in state.values())
    print(f"exported {trained.tag_dir} -> {args.output} ({n:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
