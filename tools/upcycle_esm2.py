#!/usr/bin/env python
r"""Turn a Hugging Face ESM2 directory into a ProtLingo export that training starts from (--init-from).

    python tools/upcycle_esm2.py --esm facebook_esm2_t30_150M_UR50D --out exports/protlingo_150m_init \
        --config launchers/configs/protlingo_150m.yaml
    python tools/upcycle_esm2.py --esm DIR --out DIR --moe-layers 3-29 --num-experts 4 --memory-layers 0,14,21

The backbone shape comes from the directory's config.json; the MoE and memory choices from ``--config`` (its
``model`` section, so the export matches the training config) and/or the flags, which override it. Each selected
FFN becomes a shared expert (the first ``moe_shared_hidden`` hidden units, with the output bias) plus E routed copies
of the remaining units, so the upcycled model computes the dense ESM2 exactly; memory tables and the memory's
convolution start at zero (delta = 0); routers and memory projections are freshly initialized (``--seed``).
``--perturb STD`` adds noise of STD x std(W) to routed experts 1..E-1 (off by default: an exact copy).

Layer specs are zero-based: ``3-29`` (inclusive), ``0,14,21``, ``all`` or ``none``. The output directory holds
``model.safetensors``, ``config.yaml`` (a full run config) and ``export.json`` (source and choices).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_layers(spec: str, n_layers: int, flag: str) -> list[int]:
    """'3-29' / '0,14,21' / 'all' / 'none' -> sorted zero-based block indices (ValueError naming the flag)."""
    spec = spec.strip()
    if spec == "none":
        return []
    if spec == "all":
        return list(range(n_layers))
    out = set()
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: expected e.g. 3-29, 0,14,21, all or none") from None
        if not 0 <= a <= b < n_layers:
            raise ValueError(f"{flag} {spec!r}: layers must lie in 0..{n_layers - 1}")
        out.update(range(a, b + 1))
    return sorted(out)


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--esm", required=True, type=Path, help="ESM2 weights: a Hugging Face directory (config.json + "
                   "weights) or a fair-esm file (esm2_t30_150M_UR50D.pt, read without executing code)")
    p.add_argument("--out", required=True, type=Path, help="the export directory to write (the ProtLingo init)")
    p.add_argument("--config", help="run config whose model section gives the MoE and memory choices")
    p.add_argument("--moe-layers", help="blocks whose FFN becomes a MoE, e.g. 3-29")
    p.add_argument("--num-experts", type=int, help="routed experts E")
    p.add_argument("--shared-hidden", type=int, help="hidden units of the shared expert (default d_ff / 2)")
    p.add_argument("--memory-layers", help="blocks the latent N-gram memory is inserted before, e.g. 0,14,21")
    p.add_argument("--perturb", type=float, default=0.0, help="relative noise on routed experts 1..E-1")
    p.add_argument("--seed", type=int, default=0, help="seed of the fresh router and memory weights")
    p.add_argument("--force", action="store_true", help="replace an existing export at --out (it holds export.json; "
                   "anything else is never replaced): the new one is completed beside it first, then swapped in")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    import dataclasses

    import torch
    from safetensors.torch import save_file

    from pipeline.checkpoint import EXPORTED_WEIGHTS, load_esm2
    from pipeline.config import ConfigError, build_config, dump_yaml, load_config
    from pipeline.eval.cli import progress
    from pipeline.outputs import check_output_dir, kept_note, publish_dir, staging_dir, written_by
    from pipeline.models.protlingo import (NOT_BACKBONE, ProtLingo, ProtLingoConfig, backbone_mismatch, config_from_hf,
                                           hf_to_protlingo, upcycle_state_dict)

    bar = None
    try:
        check_output_dir(args.out, force=args.force, owned=written_by("upcycle_esm2.py"), what="an export",
                         tool="upcycle_esm2.py")
        # Three steps, after the refusal of an output that is not ours (one line, no bar): reading ESM2 and writing
        # model.safetensors take the time (seconds to minutes at 650M and up).
        bar = progress(total=3, desc="upcycle", unit="step")
        bar.set_postfix_str(f"reading {args.esm.name}")
        hf_cfg, hf_state = load_esm2(args.esm)
        base = config_from_hf(hf_cfg)
        run = load_config(args.config) if args.config else build_config({"family": "protlingo"})
        if run.family != "protlingo":
            raise ConfigError(f"{args.config}: family is {run.family}, not protlingo")
        fields = dataclasses.asdict(run.model)
        if args.config:  # the config's backbone must be this checkpoint's
            why = backbone_mismatch(run.model, hf_cfg)
            if why:
                raise ConfigError(f"{args.config}: {why.replace('the checkpoint', str(args.esm))}")
        fields.update({f.name: getattr(base, f.name) for f in dataclasses.fields(ProtLingoConfig)
                       if f.name not in NOT_BACKBONE})
        if args.moe_layers is not None:
            fields["moe_layers"] = parse_layers(args.moe_layers, base.n_layers, "--moe-layers")
        if args.memory_layers is not None:
            fields["memory_layers"] = parse_layers(args.memory_layers, base.n_layers, "--memory-layers")
        if args.num_experts is not None:
            fields["num_experts"] = args.num_experts
        if args.shared_hidden is not None:
            fields["moe_shared_hidden"] = args.shared_hidden
        cfg = ProtLingoConfig(**fields)
        dense = hf_to_protlingo(hf_state, base.n_layers)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if bar is not None:
            bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    bar.update()
    bar.set_postfix_str(f"upcycling {len(cfg.moe_layers)} FFNs into {cfg.num_experts} experts")
    torch.manual_seed(args.seed)
    model = ProtLingo(cfg)
    gen = torch.Generator().manual_seed(args.seed + 1)
    state = upcycle_state_dict(dense, cfg, model.state_dict(), perturb=args.perturb, generator=gen)
    model.load_state_dict(state, strict=True)

    run = dataclasses.replace(run, model=cfg)
    bar.update()
    bar.set_postfix_str(f"writing {EXPORTED_WEIGHTS}")
    tmp = staging_dir(args.out)
    try:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / EXPORTED_WEIGHTS))
        (tmp / "config.yaml").write_text(dump_yaml(run))
        meta = {"source": str(args.esm.resolve()), "upcycled": {
            "moe_layers": cfg.moe_layers, "num_experts": cfg.num_experts, "shared_hidden": cfg.shared_hidden,
            "memory_layers": cfg.memory_layers, "perturb": args.perturb, "seed": args.seed}}
        (tmp / "export.json").write_text(json.dumps(meta, indent=1))
        kept = publish_dir(tmp, args.out, "upcycle_esm2.py")
        bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed upcycle leaves nothing behind
        raise
    finally:
        bar.close()
    if kept:
        print(kept_note(kept, "upcycle_esm2.py"), file=sys.stderr)
    print(f"upcycled {args.esm} -> {args.out}: {len(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts, "
          f"memory before {cfg.memory_layers or 'no'} blocks; {cfg.num_params():,} parameters "
          f"({cfg.num_active_params():,} active)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
