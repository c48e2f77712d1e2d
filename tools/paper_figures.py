#!/usr/bin/env python
r"""Paper 000's Figure 1, Figure 3 and Table 1 from what the project computes, one command each (pipeline/eval/paper.py).

    python tools/paper_figures.py figure1 --rnagym RUN/checkpoints/TAG/eval-rnagym.json \
        [--control CONTROL/checkpoints/TAG/eval-rnagym.json] [--others models.csv] [--length 512] --out fig1.png
    python tools/paper_figures.py figure3 --rnagym RUN/checkpoints/TAG/eval-rnagym.json [--control ...] \
        [--assays A,B,...] --out fig3.png
    python tools/paper_figures.py table1 --run runs/eco_rna_stage_a --data heldout.fasta [--depths 1,4,8] --out DIR

figure1: forward FLOPs of one --length-token sequence (the checkpoint's config: forward_flops, Eq. A.9) against the
type-balanced RNAGym |Spearman| of a ``launchers/evaluate.py --task rnagym`` sweep (one point per K), the
fixed-depth control's sweep (one point), other models from --others (a CSV of ``model,gflops,spearman``: numbers the
user has, not computed here), the Pareto frontier marked and printed. The checkpoint's config is the one the JSON
names (--config when it moved). figure3: |Spearman|, AUC and |MCC| per assay and K (control beside), the aggregate
last; --assays picks rows (default: the first assay of each RNA type). table1: every complete checkpoint of --run
(milestones included) evaluated on --data at --depths (the masks and initial states of ``launchers/evaluate.py
--task reconstruction --seed``, the same numbers), printed as a table with the K = 1 -> 4 reduction and written to
--out as table1.md, table1.json and table1.png.

Bad input (a JSON that is no RNAGym sweep, a CSV without its columns, a run without checkpoints) is one error line,
exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.eval.cli import TRUST_FLAG, TRUST_HELP  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("figure1", "figure3"):
        s = sub.add_parser(name, help=f"paper 000's {name}")
        s.add_argument("--rnagym", required=True, type=Path, help="eval-rnagym.json of the recurrent checkpoint")
        s.add_argument("--control", type=Path, default=None, help="eval-rnagym.json of the fixed-depth control")
        s.add_argument("--out", required=True, type=Path, help="the figure (PNG)")
        if name == "figure1":
            s.add_argument("--others", type=Path, default=None, help="CSV of other models: model,gflops,spearman")
            s.add_argument("--length", type=int, default=512, help="sequence length of the FLOP count (512)")
            s.add_argument("--config", type=Path, default=None, help="the recurrent checkpoint's config.yaml, "
                           "when the JSON's checkpoint moved")
            s.add_argument("--control-config", type=Path, default=None, help="the control's config.yaml")
            s.add_argument("--label", default="Eco-RNA", help="the recurrent model's name in the legend")
        else:
            s.add_argument("--assays", default=None, help="comma-separated DMS_IDs (default: one per RNA type)")
    t = sub.add_parser("table1", help="paper 000's Table 1")
    t.add_argument("--run", required=True, type=Path, help="a run directory (its checkpoints/)")
    t.add_argument("--data", required=True, type=Path, help="held-out FASTA(.gz) or shard directory")
    t.add_argument("--depths", default="1,4,8", help="K of the columns (default 1,4,8)")
    t.add_argument("--seed", type=int, default=0, help="masks and initial-state table (evaluate.py --seed)")
    t.add_argument("--out", required=True, type=Path, help="directory for table1.md, table1.json, table1.png")
    t.add_argument(TRUST_FLAG, action="store_true", help=TRUST_HELP)
    return p


def figure1(args) -> None:
    from pipeline.eval import paper

    ours = paper.read_result(args.rnagym)
    cfg = paper.model_config(ours, args.rnagym, args.config)
    points = paper.flops_points(ours, cfg, args.length)
    control = None
    if args.control is not None:
        ctrl = paper.read_result(args.control)
        ccfg = paper.model_config(ctrl, args.control, args.control_config)
        (c,) = paper.flops_points({"per_depth": dict(list(ctrl["per_depth"].items())[:1])}, ccfg, args.length)
        control = {**c, "label": args.label}
    others = paper.read_others(args.others) if args.others is not None else []
    out = paper.figure1(points, args.label, control, others, args.out,
                        f"RNAGym |Spearman| against forward FLOPs at {args.length} nt: {args.rnagym}")
    print(f"{'model':<32} {'GFLOPs':>10} {'|Spearman|':>11}  frontier")
    for p in out["points"]:
        print(f"{p['name']:<32} {p['gflops']:>10.3f} {p['spearman']:>11.4f}  {'*' if p['name'] in out['frontier'] else ''}")
    print(f"wrote {args.out}")


def figure3(args) -> None:
    from pipeline.eval import paper

    ours = paper.read_result(args.rnagym)
    control = paper.read_result(args.control) if args.control is not None else None
    assays = args.assays.split(",") if args.assays else paper.default_assays(ours)
    table = paper.figure3(ours, control, assays, args.out, f"per-assay metrics against K: {args.rnagym}")
    for metric in paper.METRIC_NAMES:
        rows = [r for r in table if r[2] == metric]
        cols = list(dict.fromkeys(r[1] for r in rows))
        print(f"{paper.METRIC_NAMES[metric]:<28}" + "".join(f"{c:>9}" for c in cols))
        for name in dict.fromkeys(r[0] for r in rows):
            vals = [r[3] for r in rows if r[0] == name]
            print(f"  {name:<26}" + "".join(f"{'n/a' if math.isnan(v) else f'{v:.4f}':>9}" for v in vals))
    print(f"wrote {args.out}")


def _sequences(path: Path, molecule: str) -> list:
    from pipeline.data.shard_reader import shard_sequences

    if path.is_dir():
        return shard_sequences(path)
    from data_prep.fasta import iter_fasta
    from pipeline.data.tokenizer import NucleotideTokenizer

    tok = NucleotideTokenizer(molecule)
    return [tok.encode(r.seq) for r in iter_fasta(path, tok.invalid_positions) if len(r.seq)]


def table1(args) -> None:
    from pipeline.checkpoint import load_trained_model
    from pipeline.checkpoint.layout import checkpoint_tags, is_complete
    from pipeline.eval import paper
    from pipeline.eval.cli import parse_depths, progress, require_trust
    from pipeline.eval.reconstruction import heldout_samples, reconstruction_sweep
    from pipeline.families import get_family
    from pipeline.outputs import write_atomic

    depths = parse_depths(args.depths)
    ckpts = args.run / "checkpoints"
    tags = [t for t in checkpoint_tags(ckpts) if is_complete(ckpts / t)]
    if not tags:
        raise ValueError(f"{args.run}: no complete checkpoint under {ckpts}")
    if not args.data.exists():
        raise FileNotFoundError(f"{args.data}: no such file or directory")
    sweeps, seqs = [], None
    for tag in progress(tags, desc="checkpoints", unit="ckpt"):
        require_trust(ckpts / tag, args.trust_checkpoint)
        trained = load_trained_model(ckpts / tag, trusted=args.trust_checkpoint)
        cfg = trained.cfg
        if seqs is None:
            seqs = _sequences(args.data, cfg.data.molecule)
            if not seqs:
                raise ValueError(f"{args.data}: no sequence to evaluate")
        samples = heldout_samples(seqs, get_family(cfg.family).make_transform(cfg), args.seed)
        per_k = reconstruction_sweep(trained.model, cfg, samples, depths, seed=args.seed)
        sweeps.append((int(trained.client_state.get("step", tag[4:])), per_k))
    rows = paper.table1_rows(sweeps, depths)
    head = ["step", *(f"K={k}" for k in depths), "K=1 -> 4"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([f"{r[0]:,}", *(f"{v:.4f}" for v in r[1:])]) + " |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "table1.md", "\n".join(lines) + "\n")
    write_atomic(args.out / "table1.json", json.dumps({
        "run": str(args.run), "data": str(args.data), "seed": args.seed, "depths": depths, "sequences": len(seqs),
        "columns": head, "rows": rows,
        "per_checkpoint": {str(s): {str(k): v for k, v in per_k.items()} for s, per_k in sweeps}}, indent=1))
    paper.table1_plot(sweeps, depths, args.out / "table1.png",
                      f"held-out reconstruction across checkpoints: {args.run} on {args.data.name}, seed {args.seed}")
    print("\n".join(lines))
    print(f"wrote {args.out / 'table1.md'}, table1.json, table1.png")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"figure1": figure1, "figure3": figure3, "table1": table1}[args.what](args)
    except (ValueError, FileNotFoundError) as e:  # ConfigError and ShardError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
