#!/usr/bin/env python
r"""Choose the recurrent depth for a task on a validation set and write it into an export.

    python tools/choose_depth.py --export exports/eco_rna_demo --task reconstruction \
        --data data/samples/rfam_nrc_heldout_sample.fasta.gz [--depths 1-8] [--tolerance 0]
    python tools/choose_depth.py --export exports/eco_rna_demo --task rnagym \
        --data ../shared/data/eval/rnagym/Tome_2014_GFP_aptamer.csv

The sweep is launchers/evaluate.py's (same functions, same crops, masks, initial-state table and scoring; --seed as
there): one trajectory per batch read out at every depth of --depths (default 1-8, capped like evaluate.py's). The
metric per task: reconstruction the masked-token loss (lower is better), rnagym the type-balanced |Spearman|, blimp
the macro accuracy, lambada pass@5 (higher is better). The choice is the smallest depth whose metric is within
--tolerance (absolute, in the metric's units; default 0: only exact ties) of the best: extra iterations cost time
linear in K, so a depth that does not measurably help is not taken.

Written: ``export.json["task_depths"][TASK] = K`` (export.json created if the export has none; its other keys are
kept) and, when the export has a Hugging Face ``config.json``, ``config.json["task_depths"][TASK] = K`` too; each file
is replaced atomically. pipeline.inference reads the depth as its default for the task. Bad input (not an export, a
task without a depth axis, a --depths that does not parse or is above the cap, missing data) is one ``error:`` line
on stderr, exit 2, and nothing written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.eval.cli import check_depths, parse_depths  # noqa: E402
from pipeline.outputs import write_atomic  # noqa: E402

# task -> (table column of the metric, True when higher is better); the column is launchers/evaluate.py's. The text
# benchmarks of pipeline/eval/benchmarks.py have their headline metric (accuracy, Spearman's rho, pass@5) in column 1.
METRIC = {"reconstruction": (1, False), "rnagym": (1, True), "blimp": (1, True), "comps": (1, True),
          "ewok": (1, True), "entity_tracking": (1, True), "wug_adj": (1, True), "wug_past": (1, True),
          "lambada": (1, True)}


def choose(table: list, column: int, higher: bool, tolerance: float) -> int:
    """The smallest K (rows (K, metric, ...)) whose metric is within ``tolerance`` of the best."""
    values = {row[0]: float(row[column]) for row in table}
    finite = {k: v for k, v in values.items() if v == v}  # NaN (an undefined metric) never wins
    if not finite:
        raise ValueError("the metric is undefined (NaN) at every depth: nothing to choose from")
    best = max(finite.values()) if higher else min(finite.values())
    return min(k for k, v in finite.items() if (best - v if higher else v - best) <= tolerance)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="an export directory (tools/convert_checkpoint.py)")
    p.add_argument("--task", required=True, help=f"one of {', '.join(METRIC)}")
    p.add_argument("--data", required=True, help="validation data, as launchers/evaluate.py --data")
    p.add_argument("--depths", default="1-8", help="depths to sweep, e.g. 1-8 or 1,2,4,8 (default 1-8)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="take the smallest depth within this (absolute) of the best metric (default 0)")
    p.add_argument("--seed", type=int, default=0, help="masks and initial-state table (evaluate.py --seed)")
    p.add_argument("--reference-sheet", type=Path, default=None, help="rnagym: reference_sheet.csv")
    p.add_argument("--spm", type=Path, default=None, help="text tasks: sentencepiece model (default: the export's)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    export = Path(args.export)
    try:  # every check before anything is computed or written
        if args.task not in METRIC:
            raise ValueError(f"--task {args.task!r}: must be one of {', '.join(METRIC)} (the tasks with a depth "
                             "axis; proteingym has one depth)")
        depths = parse_depths(args.depths)
        if not args.tolerance >= 0:
            raise ValueError(f"--tolerance: must be >= 0, got {args.tolerance}")
        if not ((export / "model.safetensors").is_file() and (export / "config.yaml").is_file()):
            raise ValueError(f"{export}: not an export (needs model.safetensors and config.yaml; "
                             "write one with tools/convert_checkpoint.py)")
        meta_path, hf_path = export / "export.json", export / "config.json"
        meta = read_json(meta_path) if meta_path.is_file() else {}
        hf = read_json(hf_path) if hf_path.is_file() else None
        for path, d in ((meta_path, meta), (hf_path, hf or {})):
            if not isinstance(d.get("task_depths", {}), dict):
                raise ValueError(f"{path}: task_depths is {type(d['task_depths']).__name__}, not an object")
        data = Path(args.data)
        if not data.exists():
            raise FileNotFoundError(f"{data}: no such file or directory")
        from pipeline.checkpoint import load_trained_model
        from pipeline.config import build_config, load_yaml

        cfg = build_config(load_yaml(export / "config.yaml"))
        from pipeline.families import FAMILIES, get_family

        if not get_family(cfg.family).depth.selectable:
            chosen = ", ".join(name for name, spec in FAMILIES.items() if spec.depth.selectable)
            raise ValueError(f"{export}: {cfg.family} has one depth; choose_depth is for {chosen}")
        check_depths(depths, cfg, export / "config.yaml", text=args.depths)
        trained = load_trained_model(export)
        from launchers import evaluate

        if args.task == "reconstruction":
            result = evaluate.run_reconstruction(trained, data, depths, args.seed)
        elif args.task == "rnagym":
            result = evaluate.run_rnagym(trained, data, depths, args.seed, args.reference_sheet)
        else:  # a text benchmark of the table, its default options (BLiMP: whole sentences)
            from pipeline.eval.benchmark import depth_runs
            from pipeline.eval.benchmarks import TABLE

            result = TABLE[args.task].run(trained, data, depth_runs(trained, depths), args)
        column, higher = METRIC[args.task]
        k = choose(result["table"], column, higher, args.tolerance)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or args.data}: {e.strerror or e}", file=sys.stderr)
        return 2
    cols = result["columns"]
    print(" | ".join(f"{c:>10}" for c in cols) + " | chosen")
    for row in result["table"]:
        cells = [f"{row[0]:>10d}"] + [f"{v:>10.4f}" for v in row[1:]]
        print(" | ".join(cells) + (" | <-" if row[0] == k else " |"))
    rule = "best" if args.tolerance == 0 else f"smallest within {args.tolerance:g} of the best"
    print(f"{args.task}: K = {k} ({cols[column].strip('|')} {'higher' if higher else 'lower'} is better; {rule})")
    meta.setdefault("task_depths", {})[args.task] = k
    write_atomic(meta_path, json.dumps(meta, indent=1) + "\n")
    written = [meta_path.name]
    if hf is not None:
        hf.setdefault("task_depths", {})[args.task] = k
        write_atomic(hf_path, json.dumps(hf, indent=2) + "\n")
        written.append(hf_path.name)
    print(f"wrote task_depths[{args.task!r}] = {k} into {export}/{{{', '.join(written)}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
