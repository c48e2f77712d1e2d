#!/usr/bin/env python
r"""Acceptance 3 of issue 13: adaptive depth against a fixed depth on held-out masked reconstruction.

    python bench/adaptive_depth.py --export exports/eco_rna_demo \
        --data data/samples/rfam_nrc_heldout_sample.fasta.gz --fixed 8 --max-depth 8 --tol 1e-4 [--tol 1e-5 ...]

The held-out masked reconstruction of pipeline/eval/reconstruction.py (the crops, masks and initial-state table of
``launchers/evaluate.py --task reconstruction`` with --seed): first with every sequence at depth --fixed, then with
every sequence iterated until its relative displacement (Eq. 9, the training penalty's r) is below each --tol, at
most --max-depth iterations (EcoRNA.adaptive). Printed per setting: the loss, its change against the fixed depth,
the mean, min and max depth, and the core row-applications (sum of the depths). Exit 1 when no --tol keeps the
loss within --within (default 1%) of the fixed depth's with fewer core applications.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="an Eco-RNA export (tools/convert_checkpoint.py)")
    p.add_argument("--data", required=True, help="held-out FASTA(.gz) or shard dir")
    p.add_argument("--fixed", type=int, default=8, help="the fixed depth compared against (default 8)")
    p.add_argument("--max-depth", type=int, default=8)
    p.add_argument("--tol", type=float, action="append", help="displacement tolerance(s) (default 1e-4)")
    p.add_argument("--within", type=float, default=0.01, help="relative loss tolerance of the check (default 0.01)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    try:
        from launchers.evaluate import read_sequences
        from pipeline.eval.reconstruction import heldout_samples, reconstruction_adaptive, reconstruction_sweep
        from pipeline.families import get_family
        from pipeline.pretrained import load_pretrained

        if args.fixed < 1 or args.max_depth < 1:
            raise ValueError("--fixed and --max-depth must be >= 1")
        tols = args.tol or [1e-4]
        if any(not t >= 0 for t in tols):
            raise ValueError(f"--tol must be >= 0, got {tols}")
        data = Path(args.data)
        if not data.exists():
            raise FileNotFoundError(f"{data}: no such file or directory")
        from pipeline.config import build_config, load_yaml

        model, _ = load_pretrained(args.export)  # refuses a directory that is not an export
        cfg = build_config(load_yaml(Path(args.export) / "config.yaml"))  # data.* (crop, masking) for the samples
        if cfg.family != "eco_rna":
            raise ValueError(f"{args.export}: adaptive depth needs an eco_rna export, this is {cfg.family}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seqs = read_sequences(data, cfg.data.molecule)
    samples = heldout_samples(seqs, get_family(cfg.family).make_transform(cfg), args.seed)
    sweep_depths = sorted({*range(1, args.max_depth + 1), args.fixed})  # one trajectory read out at every K
    sweep = reconstruction_sweep(model, cfg, samples, sweep_depths, args.batch_size, args.seed)
    fixed = sweep[args.fixed]
    n = len(samples)
    print(f"{n} held-out sequences from {data}, {fixed['tokens']} supervised tokens, seed {args.seed}")
    print("fixed-depth loss by K: " + ", ".join(f"{k}: {v['loss']:.4f}" for k, v in sweep.items()))
    print(f"{'setting':>16} | {'loss':>8} | {'vs fixed':>8} | {'accuracy':>8} | {'mean K':>6} | {'K range':>7} | "
          f"{'core row-apps':>13}")
    print(f"{'fixed K=' + str(args.fixed):>16} | {fixed['loss']:8.4f} | {'':>8} | {fixed['accuracy']:8.4f} | "
          f"{args.fixed:6.2f} | {args.fixed:>3}-{args.fixed:<3} | {args.fixed * n:13d}")
    ok = False
    for tol in tols:
        a = reconstruction_adaptive(model, cfg, samples, tol, args.max_depth, args.batch_size, args.seed)
        rel = a["loss"] / fixed["loss"] - 1
        ok |= abs(rel) <= args.within and a["row_iterations"] < args.fixed * n
        print(f"{'tol=' + format(tol, 'g'):>16} | {a['loss']:8.4f} | {rel:+8.3%} | {a['accuracy']:8.4f} | "
              f"{a['row_iterations'] / n:6.2f} | {min(a['depths']):>3}-{max(a['depths']):<3} | "
              f"{a['row_iterations']:13d}")
    print(f"within {args.within:.0%} of fixed K={args.fixed} with fewer core applications: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
