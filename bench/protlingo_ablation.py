#!/usr/bin/env python
"""ProtLingo's ablation at tiny scale (paper 002: full / no MoE / no memory / neither): held-out perplexity of the
four variants trained alike from one random ESM2-8M, with the spread over training seeds.

    python bench/protlingo_ablation.py --out DIR [--quick] [--steps 120] [--seeds 0,1,2] [--variants full,dense]
                                         [--source FASTA]

1. Data: the shared UniRef50 training sample (../shared/data/protein/uniref50_202104_esm2_train_5000.fasta, 5,000
   proteins) split by data_prep --val-fraction 0.1 into train/ and val/ shards (a record's split is a hash of its
   id); without ../shared, the shipped UniRef90 member sample (771 proteins), with a note. ``--source``: another
   FASTA (e.g. that sample, whose held-out tenth scores in under half the time: the suite's smoke run).
2. Backbone: tools/make_random_esm2.py --size 8M --seed 0, once: every variant starts from the same ESM2.
3. Per variant (launchers/configs/protlingo_ablation_{full,no_moe,no_memory,dense}.yaml) and seed: upcycled with
   tools/upcycle_esm2.py --config (routers and memory drawn by the seed), trained --steps steps by
   launchers/pretrain.py (one process, the same data order for a given seed) and scored by launchers/evaluate.py
   --task mlm on val/ (the same masks for every model).
4. Printed: one line per variant, PPL mean +- sd over seeds and its difference to the full model; the last line
   ``ablation: full P, no_moe Q, no_memory R, dense S``. DIR/protlingo_ablation.json holds every run.

This is the machinery of the paper's table at a scale a CPU trains in minutes, from random weights, not the paper's
150M result. ``--quick``: 20 steps, seed 0 (a smoke run, about 3 minutes). ``--variants``: a subset of the four
(with ``full``, which the others are compared to). Exit 0 when every run finished.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "data" / "protein" / "uniref50_202104_esm2_train_5000.fasta"
SAMPLE = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"
VARIANTS = ("full", "no_moe", "no_memory", "dense")
PY = sys.executable


def run(args: list, what: str) -> subprocess.CompletedProcess:
    r = subprocess.run([PY, *map(str, args)], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}, with full")
    p.add_argument("--source", type=Path, default=None, metavar="FASTA",
                   help=f"FASTA to split (default: {SHARED.name} from ../shared, else {SAMPLE.name})")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"error: --seeds {args.seeds!r}: expected e.g. 0,1,2", file=sys.stderr)
        return 2
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown or "full" not in variants:
        print(f"error: --variants {args.variants!r}: expected some of {','.join(VARIANTS)}, full among them",
              file=sys.stderr)
        return 2
    if args.source is not None and not args.source.is_file():
        print(f"error: --source {args.source}: no such file", file=sys.stderr)
        return 2
    if args.quick:
        args.steps, seeds = 20, [0]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = args.source.resolve() if args.source else SHARED if SHARED.is_file() else SAMPLE
    if source is SAMPLE:
        print(f"note: {SHARED} not found; training on the shipped sample {SAMPLE.name} (771 proteins)")
    shards = out / "shards"
    if not (shards / "val" / "manifest.json").is_file():
        run(["-m", "data_prep", "uniref", "--input", source, "--output", shards, "--val-fraction", 0.1,
             "--max-length", 2000, "--overwrite"], "data_prep")
    esm = out / "esm2_random_8M"
    if not (esm / "config.json").is_file():
        run(["tools/make_random_esm2.py", "--size", "8M", "--seed", 0, "--out", esm, "--force"], "make_random_esm2")
    try:
        results = train_and_score(out, shards, esm, args.steps, seeds, variants)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return report(results, args.steps, seeds, source, out)


def train_and_score(out: Path, shards: Path, esm: Path, steps: int, seeds: list, variants: tuple = VARIANTS) -> dict:
    """variant -> [{seed, loss, perplexity, ...}] of every (variant, seed) run."""
    results = {v: [] for v in variants}
    for variant in variants:
        config = REPO / "launchers" / "configs" / f"protlingo_ablation_{variant}.yaml"
        for seed in seeds:
            name = f"{variant}_seed{seed}"
            init, run_dir = out / "init" / name, out / "runs" / name
            run(["tools/upcycle_esm2.py", "--esm", esm, "--config", config, "--seed", seed, "--out", init, "--force"],
                f"upcycle {name}")
            run(["launchers/pretrain.py", "--ds_config", "ds_configs/zero2.json", "--config", config, "--resume", "never",
                 "--set", f"data.train_shards={shards / 'train'}", "--set", f"run_dir={run_dir}",
                 "--set", f"train.max_steps={steps}", "--set", f"checkpoint.every_steps={steps}",
                 "--set", f"seed={seed}", "--set", "tracking.enabled=false", "--init-from", init], f"train {name}")
            score = out / "eval" / f"{name}.json"
            score.parent.mkdir(exist_ok=True)
            run(["launchers/evaluate.py", "--checkpoint", run_dir, "--task", "mlm", "--data", shards / "val",
                 "--output", score, "--no-mlflow", "--trust-checkpoint"], f"evaluate {name}")  # its own run: trusted
            res = json.loads(score.read_text())
            results[variant].append({"seed": seed, "loss": res["loss"], "perplexity": res["perplexity"],
                                     "masked": res["tokens"], "sequences": res["sequences"]})
            print(f"{name}: held-out perplexity {res['perplexity']:.4f} ({res['tokens']:,} masked residues)",
                  flush=True)
    return results


def report(results: dict, steps: int, seeds: list, source: Path, out: Path) -> int:
    summary = {}
    for variant, rs in results.items():
        ppl = [r["perplexity"] for r in rs]
        summary[variant] = {"mean": statistics.fmean(ppl), "sd": statistics.stdev(ppl) if len(ppl) > 1 else 0.0}
    full = summary["full"]["mean"]
    print(f"{'variant':10s} | {'PPL':>18s} | {'vs full':>8s}   ({steps} steps, seeds {','.join(map(str, seeds))}, "
          f"{source.name})")
    for variant, s in summary.items():
        print(f"{variant:10s} | {s['mean']:9.4f} +- {s['sd']:6.4f} | {s['mean'] - full:+8.4f}")
    doc = {"source": str(source), "steps": steps, "seeds": seeds, "runs": results, "summary": summary}
    (out / "protlingo_ablation.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("ablation: " + ", ".join(f"{v} {summary[v]['mean']:.4f}" for v in summary))
    return 0 if all(math.isfinite(s["mean"]) for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
