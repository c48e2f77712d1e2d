#!/usr/bin/env python
r"""Evaluate a trained checkpoint across recurrent depths.

    python launchers/evaluate.py --checkpoint runs/eco_rna_demo --task reconstruction \
        --data data/samples/rfam_nrc_heldout_sample.fasta.gz --depths 1-8
    python launchers/evaluate.py --checkpoint runs/eco_rna_demo --task rnagym \
        --data ../shared/data/eval/rnagym/Tome_2014_GFP_aptamer.csv --depths 1-8
    python launchers/evaluate.py --checkpoint runs/recursive_gpt_demo --task blimp \
        --data ../shared/data/eval/blimp --depths 2,4,8      # causal LMs; depths may exceed the trained R
    python launchers/evaluate.py --checkpoint runs/recursive_gpt_demo --task lambada --data lambada_test.jsonl
    python launchers/evaluate.py --checkpoint runs/protlingo --task proteingym \
        --data ../shared/data/eval/proteingym/BLAT_ECOLX_Jacquier_2013.csv \
        --reference ../shared/data/eval/proteingym/DMS_substitutions.csv   # or --data a folder of assays
    python launchers/evaluate.py --checkpoint exports/protlingo --task mlm --data uniref50_heldout.fasta
    python launchers/evaluate.py --checkpoint exports/protlingo --task flip --data ../shared/data/eval/flip/gb1
    python launchers/evaluate.py --checkpoint esm2_t30_150M_UR50D --task contacts \
        --contact-train data/samples/structures/train --data data/samples/structures/test   # an ESM2 as it is

Without --depths a RecursiveGPT is evaluated at its trained recurrence R (the paper's BLiMP and LAMBADA numbers are at
R = 16 or 24) and the Eco-RNA tasks at 1-8.

--depths takes depths and ranges (1-8, 1,2,4,8, 1-4,8; pipeline/eval/cli.py parses them for tools/flops.py too) up
to a cap: 4 x the deepest depth the model was trained at (Eco-RNA: objective.k_cap, or train_depth for a fixed law;
RecursiveGPT: objective.train_depth or R; a standard decoder: its layer count), and never below 8. A sweep costs time
linear in K, and far beyond the trained depths it measures a trajectory the model never approached.

The text tasks (blimp, lambada) tokenize with --spm, else the export's own tokenizer.model (tools/convert_checkpoint.py
copies it), else the sentencepiece model beside the checkpoint's training shards (DATA/tokenizer.model); a standard
decoder runs at its one depth (its layer count). BLiMP's one_prefix and two_prefix methods apply to some paradigms
only: the others are skipped, and the count, the paradigms and the reason are printed and kept in the JSON.

DeepSpeed checkpoints are pickles, read with torch.load(weights_only=True) and DeepSpeed's few classes allowed: one
whose files would call anything else is refused unless --trust-checkpoint. Exports need nothing.

proteingym (pipeline/eval/proteingym.py): zero-shot masked marginals of a masked LM over the ESM-2 alphabet
(vocab_size 33), any family whose forward(input_ids, attention_mask) returns .logits; it has one depth, so --depths
is refused. --data is one assay CSV or a folder of them; a folder needs --reference DMS_substitutions.csv and
scores every CSV it lists (others are named and skipped); one assay without --reference takes its wild type from
its mutated sequences. Windows of --window tokens (1024, ProteinGym's) for longer proteins; --batch-size masked
copies per forward pass; on a GPU when one is visible. Reports per-assay Spearman / AUC / MCC and their mean over
assays; per-mutant scores go to OUTPUT_STEM-scores/DMS_ID.csv; MLflow gets the metrics at the checkpoint's step.

validation (pipeline/validation.py): the metrics the training logs as val/... every eval.every steps, computed
the same way on --data (shard directories, comma-separated): the checkpoint's eval.max_samples, eval.batch_size and
eval.depths (--depths overrides), seeded by --seed (training uses eval.seed, 0 by default).

mlm (pipeline/eval/mlm.py): held-out masked-LM loss, perplexity and accuracy of a protein masked LM (paper 002's
ablation metric) on a FASTA or shard directory, each sequence masked once by the training transform (seeded).

nrc, ssp, reactivity (pipeline/eval/task_sweeps.py): a checkpoint adapted to that task (launchers/finetune.py) swept
over K with its weights, head, inputs and initial-state table fixed: accuracy and per-class accuracy, strict
full-matrix micro-F1 with precision and recall (and a per-sequence view, OUT_STEM-structure-cases.png), or AUC,
macro-F1 and MAE averaged over DMS and 2A3; docs/adaptation.md.

The protein benchmarks of pipeline/eval/benchmarks.py (flip, contacts, expert_specialization, expert_intervention,
memory_motifs) declare their readers, options, metrics and plots in their own modules; proteingym also reports the
leaderboard's average (with --reference) and Spearman per billion active parameters. --checkpoint may also
be a foreign ESM2 checkpoint, a Hugging Face directory or a fair-esm .pt, read as it is (no conversion step) for
every protein task (docs/evaluation.md).

Prints a table, writes JSON (default: CHECKPOINT_TAG_DIR/eval-TASK.json) and, for a task with a depth axis, the plot
OUT_STEM-vs-depth.png beside it (pipeline/eval/plots.py; with or without MLflow), and, when the checkpoint's MLflow run can
be reached (its run directory's store, or MLFLOW_TRACKING_URI), logs one nested run per evaluation under it (tags
eval.task, eval.data, eval.checkpoint, eval.step): the metrics with step = K, the JSON and a metric-vs-depth plot, so
evaluations of different data sets on one training run never overwrite each other. Progress bars (with time
estimates) go to stderr; TQDM_DISABLE=1 turns them off.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.eval.cli import TRUST_FLAG, TRUST_HELP, check_depths, locate_checkpoint, parse_depths  # noqa: E402
from pipeline.eval.cli import require_trust  # noqa: E402
from pipeline.outputs import write_atomic  # noqa: E402
from pipeline.tracking.eval_runs import log_metric_batches, mlflow_target, start_eval_run  # noqa: E402
from pipeline.eval.task_sweeps import SWEEPS  # noqa: E402 - adapted models: nrc, ssp, reactivity (docs/adaptation.md)

# The text benchmarks (BLiMP and its supplement, COMPS, EWoK, Entity Tracking, the wug tasks, LAMBADA, and babylm: every
# BabyLM folder at once) come from pipeline/eval/benchmarks.py's table: their runs, options and metrics are declared
# there, and this launcher only dispatches to them.
OWN_TASKS = ("reconstruction", "rnagym", "proteingym", "mlm", "validation")


def text_tasks() -> dict:
    from pipeline.eval.benchmarks import TABLE

    return TABLE


TASKS = OWN_TASKS + tuple(SWEEPS) + tuple(text_tasks())


def default_depths(cfg) -> list[int]:
    """The depths evaluated when --depths is not given: the family's ``Depth.sweep`` (the trained R of a
    RecursiveGPT, the layer count of a standard decoder, its only depth; 1-8 for the other families)."""
    from pipeline.families import get_family

    return get_family(cfg.family).depth.sweep(cfg)


def read_sequences(path: Path, molecule: str) -> list[np.ndarray]:
    """A FASTA (.gz) file or a shard directory -> uint8 token arrays."""
    from pipeline.data.shard_reader import shard_sequences

    if path.is_dir():
        return shard_sequences(path)  # every member of every cluster of a clusters layout
    from data_prep.fasta import iter_fasta
    from pipeline.data.tokenizer import NucleotideTokenizer

    tok = NucleotideTokenizer(molecule)
    return [tok.encode(r.seq) for r in iter_fasta(path, tok.invalid_positions) if len(r.seq)]


def note_cropped(seqs: list, cfg, data: Path) -> dict:
    """The masked-LM evaluations read one seeded window of data.context_length - 2 residues (the training's crop;
    <cls>/<eos> take two positions) of a longer sequence: counted in the result and said on stderr, never silent."""
    window = cfg.data.context_length - 2
    longer = [len(s) for s in seqs if len(s) > window]
    if longer:
        print(f"warning: {data}: {len(longer):,} of {len(seqs):,} sequences are longer than the model's window of "
              f"{window:,} residues (data.context_length {cfg.data.context_length}); each is evaluated on one seeded "
              f"random window of {window:,}, not whole (the longest has {max(longer):,})", file=sys.stderr)
    return {"cropped": len(longer), "window": window}


def run_reconstruction(trained, data: Path, depths, seed: int) -> dict:
    from pipeline.eval.reconstruction import heldout_samples, reconstruction_sweep
    from pipeline.families import get_family

    cfg = trained.cfg
    seqs = read_sequences(data, cfg.data.molecule)
    if not seqs:  # an empty or header-only file would otherwise divide by zero tokens
        raise ValueError(f"{data}: no sequence to evaluate (an empty file, or headers without sequence lines)")
    cropped = note_cropped(seqs, cfg, data)
    samples = heldout_samples(seqs, get_family(cfg.family).make_transform(cfg), seed)
    per_k = reconstruction_sweep(trained.model, cfg, samples, depths, seed=seed, desc=f"reconstruction K={depths[0]}"
                                 + (f"-{depths[-1]}" if len(depths) > 1 else ""))
    from pipeline.data.tokenizer import IGNORE_INDEX
    from pipeline.eval.plots import chance_levels

    chance = chance_levels(t for s in samples for t in np.asarray(s["labels"]).ravel().tolist() if t != IGNORE_INDEX)
    return {"sequences": len(seqs), **cropped, "per_depth": {str(k): v for k, v in per_k.items()}, "chance": chance,
            "table": [(k, v["loss"], v["accuracy"]) for k, v in per_k.items()], "columns": ("K", "loss", "accuracy")}


def run_mlm(trained, data: Path, seed: int, batch_size: int) -> dict:
    """Held-out masked-LM loss and perplexity of a protein masked LM on ``data`` (FASTA or a shard directory)."""
    from pipeline.eval.mlm import mlm_eval
    from pipeline.eval.reconstruction import heldout_samples
    from pipeline.families import get_family

    model = proteingym_model(trained)  # the same check: a masked LM over the ESM-2 alphabet
    cfg = trained.cfg
    family = get_family(cfg.family)
    seqs = read_proteins(data)
    if not seqs:
        raise ValueError(f"{data}: no sequence to evaluate (an empty file, or headers without sequence lines)")
    cropped = note_cropped(seqs, cfg, data)
    res = mlm_eval(model, cfg, heldout_samples(seqs, family.make_transform(cfg), seed), family.pad_id, batch_size)
    return {"sequences": len(seqs), **cropped, **res, "table": [(res["tokens"], res["loss"], res["perplexity"], res["accuracy"])],
            "columns": ("masked", "loss", "perplexity", "accuracy")}


def run_validation(trained, dirs: list[Path], depths, seed: int) -> dict:
    """The training's validation (pipeline/validation.py) of a checkpoint, in one process."""
    import dataclasses

    import torch

    from pipeline import validation
    from pipeline.families import get_family

    cfg = trained.cfg
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, seed=seed, depths=depths or cfg.eval.depths))
    family = get_family(cfg.family)
    if family.validate is None:
        raise ValueError(f"--task validation: the {cfg.family} family has no validation")
    for d in dirs:
        if not d.is_dir():
            raise ValueError(f"{d}: --task validation reads shard directories (data_prep's output)")
    batches = validation.heldout_batches(cfg, family, [str(d) for d in dirs])
    metrics = validation.evaluate(trained.model, cfg, family, batches, torch.device("cpu"))
    metrics.pop("val/seconds")
    return {"metrics": metrics, "table": [(sum(len(b.sample_ids) for b in batches), *metrics.values())],
            "columns": ("sequences", *metrics)}


def read_proteins(path: Path) -> list:
    """Protein token arrays (ESM-2 ids) of a FASTA file or a shard directory (every cluster member)."""
    from pipeline.data.protein_tokenizer import ProteinTokenizer
    from pipeline.data.shard_reader import shard_sequences

    if path.is_dir():
        return shard_sequences(path)
    from data_prep.fasta import iter_fasta

    tok = ProteinTokenizer()
    return [tok.encode(r.seq.upper()) for r in iter_fasta(path, lambda seq: tok.invalid_positions(seq.upper()))
            if len(r.seq)]


def run_rnagym(trained, data: Path, depths, seed: int, sheet_path: Path | None) -> dict:
    import torch

    from pipeline.eval.reconstruction import state_table
    from pipeline.eval.rnagym import describe_types, load_assays, load_reference_sheet, score_assays
    from pipeline.models.eco_rna import initial_state

    paths = sorted(data.glob("*.csv")) if data.is_dir() else [data]
    paths = [p for p in paths if p.name != "reference_sheet.csv"]
    sheet_path = sheet_path or (data if data.is_dir() else data.parent) / "reference_sheet.csv"
    if not sheet_path.is_file():
        raise FileNotFoundError(f"{sheet_path}: RNAGym reference sheet not found (pass --reference-sheet)")
    sheet = load_reference_sheet(sheet_path)
    cfg, model = trained.cfg, trained.model
    table = state_table(cfg.model, cfg.data.context_length, seed)
    assays = load_assays(paths, sheet)  # parsed once: nothing in an assay depends on K
    trajectories = {}  # framed window bytes -> {K: log-probs [n, V]}: one trajectory per window serves every K

    @torch.no_grad()
    def at_all_depths(ids: np.ndarray) -> dict:  # framed wild-type ids [n] -> {K: log-probs [n, V]}
        if ids.tobytes() not in trajectories:
            tokens = torch.from_numpy(ids).long()[None]
            mask = torch.ones_like(tokens, dtype=torch.bool)
            logits = model.logits_at_depths(tokens, mask, depths, initial_state(cfg.model, mask, table=table))
            trajectories[ids.tobytes()] = {k: torch.log_softmax(v[0].float(), -1).numpy() for k, v in logits.items()}
        return trajectories[ids.tobytes()]

    per_depth = {}
    for k in depths:
        res = score_assays(assays, sheet, lambda ids, k=k: at_all_depths(ids)[k], cfg.data.context_length,
                           desc=f"rnagym K={k}")
        per_depth[str(k)] = {"aggregate": res["aggregate"], "per_type": res["per_type"],
                             "per_assay": res["per_assay"], "n_variants": res["n_variants"]}
    agg = lambda k, m: per_depth[str(k)]["aggregate"][m]  # noqa: E731
    return {"assays": list(assays), "notes": {i: list(a.notes) for i, a in assays.items()},
            "per_depth": per_depth, "types_line": describe_types(per_depth[str(depths[0])]["aggregate"]),  # K-free
            "table": [(k, agg(k, "spearman"), agg(k, "auc"), agg(k, "mcc")) for k in depths],
            "columns": ("K", "|spearman|", "AUC", "|MCC|")}


def active_params(cfg) -> int:
    """The parameters one token uses (the model config's num_active_params, else all: tools/params.py's rule)."""
    return getattr(cfg.model, "num_active_params", cfg.model.num_params)()


def proteingym_model(trained):
    """The checkpoint's model, refused unless its vocabulary is ESM-2's 33 tokens (a nucleotide or text model would
    fail inside its embedding on protein ids, or score the wrong tokens), on the GPU when one is visible."""
    import torch

    vocab = getattr(trained.cfg.model, "vocab_size", None)
    if vocab is not None and vocab != 33:
        raise ValueError(f"--task proteingym needs a masked LM over the 33-token ESM-2 alphabet; "
                         f"{trained.cfg.family} has model.vocab_size {vocab}")
    return trained.model.cuda() if torch.cuda.is_available() else trained.model


def load_proteingym_assays(data: Path, reference: Path | None):
    """(assays, skipped CSV names): one assay file, or every CSV of a folder that ``reference`` lists."""
    from pipeline.eval.proteingym import load_assay, load_reference, reference_entry

    if reference is not None and not reference.is_file():
        raise FileNotFoundError(f"{reference}: ProteinGym reference file not found")
    ref = load_reference(reference) if reference is not None else None
    if not data.is_dir():
        return [load_assay(data, reference_entry(ref, data, reference) if ref else None)], []
    if ref is None:
        raise ValueError(f"{data}: a folder of assays needs --reference DMS_substitutions.csv (it lists the assays "
                         "and their wild types)")
    paths = [f for f in sorted(data.glob("*.csv")) if f.resolve() != reference.resolve()]
    listed = [f for f in paths if f.name in ref]
    if not listed:
        raise ValueError(f"{data}: none of its {len(paths)} CSV files is a DMS_filename of {reference}")
    return [load_assay(f, ref[f.name]) for f in listed], [f.name for f in paths if f.name not in ref]


def run_proteingym(model, data: Path, reference: Path | None, window: int, batch_size: int,
                   active_params: int | None = None) -> dict:
    """Score the assays of ``data`` with ``model`` (a masked LM whose forward returns .logits); with ``reference``
    also the leaderboard's UniProt / selection-type average, and with ``active_params`` paper 002's Spearman per
    billion active parameters (of the leaderboard average, else of the mean over assays)."""
    from pipeline.eval.proteingym import (METRICS, efficiency, evaluate_assays, leaderboard_aggregate,
                                          leaderboard_columns_absent, load_reference, masked_lm_logits_fn)

    assays, skipped = load_proteingym_assays(data, reference)
    res = evaluate_assays(assays, masked_lm_logits_fn(model), window=window, batch_size=batch_size, progress=True)
    per, agg = res["per_assay"], res["aggregate"]
    table = [(i, m["n"], *(m[k] for k in METRICS)) for i, m in per.items()]
    board, ref = None, load_reference(reference) if reference is not None else None
    absent = leaderboard_columns_absent(ref) if ref is not None else []
    if absent:
        print(f"note: {reference} has no {' and no '.join(absent)} column: the leaderboard's average (by UniProt "
              "and selection type) is left out; the mean over assays is reported", file=sys.stderr)
    elif ref is not None:
        board = leaderboard_aggregate(per, ref, reference)
    extra = [] if board is None else [(f"leaderboard ({board['n_uniprot']} UniProt, {board['n_types']} types)",
                                       agg["n_mutants"], *(board[k] for k in METRICS))]
    headline = board["spearman"] if board is not None else agg["spearman"]
    eff = None if active_params is None else {
        "spearman_per_billion_active": efficiency(headline, active_params), "active_params": int(active_params),
        "spearman": headline, "of": "leaderboard" if board is not None else "mean over assays"}
    return {"assays": list(per), "skipped": skipped, "window": window, "batch_size": batch_size,
            "scoring": "masked-marginals", "per_assay": per, "aggregate": agg, "leaderboard": board,
            "efficiency": eff,
            "scores": {a.dms_id: {"mutant": a.mutants, "DMS_score": a.dms_score.tolist(),
                                  "DMS_score_bin": a.dms_score_bin.tolist(), "score": res["scores"][a.dms_id].tolist()}
                       for a in assays},
            "table": table + [(f"mean of {agg['n']}", agg["n_mutants"], *(agg[k] for k in METRICS))] + extra,
            "columns": ("assay", "n", "spearman", "AUC", "MCC")}


def write_proteingym_scores(result: dict, out: Path) -> Path:
    """Per-mutant scores, one CSV per assay (mutant, DMS_score, DMS_score_bin, score), beside the JSON; the JSON
    keeps the metrics only."""
    import csv

    folder = out.parent / f"{out.stem}-scores"
    folder.mkdir(parents=True, exist_ok=True)
    for dms_id, cols in result.pop("scores").items():
        with open(folder / f"{dms_id}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(cols)
            w.writerows(zip(*cols.values()))
    return folder


def run_text(trained, args, data: Path, depths) -> dict:
    """A benchmark of the table (pipeline/eval/benchmarks.py) at ``depths``; refused for a model it does not score
    (Benchmark.check_model: a text task on a protein model, a protein task on a text model)."""
    from pipeline.eval.benchmark import depth_runs

    bench = text_tasks()[args.task]
    bench.check_model(trained)
    return bench.run(trained, data, depth_runs(trained, depths), args)


def protein_tasks() -> tuple:
    """The tasks a foreign checkpoint (a Hugging Face ESM2 directory, a fair-esm .pt) is evaluated on, as it is."""
    return ("proteingym", "mlm") + tuple(n for n, b in text_tasks().items() if b.model == "protein")


def run_milestones(args, depths, data: Path) -> int:
    """--milestones: the task on every word milestone of --checkpoint (pipeline/eval/milestones.py), one row per
    milestone (words seen, then the headline metric of each task folder, per depth); the JSON, a metric-against-words
    plot and MLflow metrics at step = words seen (in a run nested under the training run)."""
    from pipeline.checkpoint import load_trained_model
    from pipeline.eval.benchmark import headline
    from pipeline.eval.milestones import find_milestones
    from pipeline.eval.plots import plot_curves

    try:
        found, missing = find_milestones(Path(args.checkpoint))
        for line in missing:
            print(f"warning: {line}", file=sys.stderr)
        if not found:
            raise ValueError(f"{args.checkpoint}: no milestone checkpoint to evaluate")
        bench = text_tasks()[args.task]
        rows, entries, trained = [], [], None
        for m in found:
            require_trust(m.path, args.trust_checkpoint)
            trained = load_trained_model(m.path, trusted=args.trust_checkpoint)
            ks = depths or default_depths(trained.cfg)
            if depths:
                check_depths(depths, trained.cfg, m.path / "config.yaml", text=args.depths)
            result = run_text(trained, args, data, ks)
            ks_run = [r[0] for r in result["table"]]
            if args.task == "babylm":  # one column per task folder
                names = list(result["columns"][1:])
                value = lambda n, k, result=result: result["per_depth"][str(k)][n]  # noqa: E731
            else:  # the task's headline metric
                names = [bench.metrics[0]]
                value = lambda n, k, result=result: headline(bench, result, k)  # noqa: E731
            columns = ("words", *(n if len(ks_run) == 1 else f"{n} K={k}" for k in ks_run for n in names))
            rows.append((m.words, *(value(n, k) for k in ks_run for n in names)))
            entries.append({"name": m.name, "target": m.target, "words": m.words, "step": m.step, "path": str(m.path),
                            "result": result})
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(" | ".join(f"{c:>12}" for c in ("milestone", *columns)))
    for e, row in zip(entries, rows):
        print(" | ".join([f"{e['name']:>12}", f"{row[0]:>12,}", *(f"{v:>12.4f}" for v in row[1:])]))
    base = Path(args.checkpoint)
    out = args.output or base / f"eval-{args.task}-milestones.json"
    doc = {"task": args.task, "data": str(data), "checkpoint": str(base), "milestones": entries, "missing": missing,
           "columns": columns, "table": rows}
    try:
        write_atomic(out, json.dumps(doc, indent=1, default=float))
    except OSError as e:
        print(f"error: cannot write {out} ({e.strerror or e}); pass --output PATH", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    png = plot_curves(columns, rows, f"{args.task} on {data.name} against words seen, {len(rows)} milestones of "
                      f"{base}", out.with_name(f"{out.stem}-vs-words.png"))
    print(f"wrote {png}")
    if not args.no_mlflow and trained is not None:
        log = log_to_mlflow(trained, args.task, doc, out, data, png)
        if log:
            print(f"logged to MLflow run {log[0]} (nested in training run {log[1]}), step = words seen")
    return 0


def log_proteingym_to_mlflow(trained, result: dict, out: Path, data: Path) -> tuple[str, str] | None:
    """In a run nested under the training run (:func:`start_eval_run`): eval/proteingym/{spearman,auc,mcc} (mean
    over assays) and eval/proteingym/DMS_ID/... at the checkpoint's training step (no depth axis, so no plot), and
    the JSON as an artifact. Returns (evaluation run id, training run id)."""
    run_id, uri = mlflow_target(trained)
    if not run_id:
        return None
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    child = start_eval_run(client, run_id, trained, "proteingym", data)
    step, now_ms = int(trained.client_state.get("step", 0)), int(time.time() * 1000)
    keys = ("spearman", "auc", "mcc")
    named = [(f"eval/proteingym/{k}", result["aggregate"][k]) for k in keys]
    if result.get("leaderboard"):
        named += [(f"eval/proteingym/leaderboard/{k}", result["leaderboard"][k]) for k in keys]
    if result.get("efficiency"):
        named.append(("eval/proteingym/spearman_per_billion_active", result["efficiency"]["spearman_per_billion_active"]))
    named += [(f"eval/proteingym/{i}/{k}", m[k]) for i, m in result["per_assay"].items() for k in keys]
    metrics = [Metric(name, float(v), now_ms, step) for name, v in named if np.isfinite(v)]
    log_metric_batches(client, child, metrics)
    client.log_artifact(child, str(out), "eval")
    client.set_terminated(child)
    return child, run_id


def task_plot(trained, task: str, result: dict, out: Path, data: Path) -> Path | None:
    """The task's own plot when its benchmark declares one (Benchmark.plot: the tasks without a depth axis), else
    :func:`depth_plot`."""
    bench = text_tasks().get(task)
    if bench is not None and bench.plot is not None:
        title = f"{task} of {trained.cfg.family} {trained.tag_dir.name} on {data.name}\n{trained.tag_dir}"
        return bench.plot(result, out, title)
    return depth_plot(trained, task, result, out, data)


def depth_plot(trained, task: str, result: dict, out: Path, data: Path) -> Path | None:
    """OUT_STEM-vs-depth.png beside the JSON for a task with a depth axis (None for the others): the first bounded
    metric beside the loss against K, chance dotted where the task reports it, on the y-range rule of
    pipeline/eval/plots.py; titled with the model, checkpoint, step, data and seed, so the file alone says what it
    shows. Drawn with or without MLflow (an export has no run to log to)."""
    from pipeline.eval.plots import plot_depth

    cols, rows = result["columns"], result["table"]
    if cols[0] != "K" or not rows:
        return None
    step = trained.client_state.get("step")
    n = result.get("sequences") or result.get("passages") or result.get("n_pairs") or result.get("n_items")
    title = (f"{task} of {trained.cfg.family} {trained.tag_dir.name}"
             + (f" (step {step})" if step is not None else "") + f" on {data.name}"
             + (f", {n} items" if n else "") + f", seed {result.get('seed', 0)}: metric against core iterations K"
             + f"\n{trained.tag_dir}")
    return plot_depth(cols, rows, title, out.with_name(f"{out.stem}-vs-depth.png"), result.get("chance"))


def log_to_mlflow(trained, task: str, result: dict, out: Path, data: Path,
                  png: Path | None = None, figures: list = ()) -> tuple[str, str] | None:
    """In a run nested under the checkpoint's training run (:func:`start_eval_run`), when its store is reachable:
    eval/TASK/METRIC with step = K, the JSON and ``png`` (the metric-vs-depth plot, :func:`depth_plot`). Returns
    (evaluation run id, training run id)."""
    run_id, uri = mlflow_target(trained)
    if not run_id:
        return None
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    child = start_eval_run(client, run_id, trained, task, data)
    cols, rows = result["columns"], result["table"]
    now_ms = int(time.time() * 1000)
    depth_axis = cols[0] in ("K", "words")  # mlm has one row and no depth: step 0, no plot; milestones: words seen
    label = lambda row: f"{row[0]}/" if isinstance(row[0], str) else ""  # noqa: E731 - rows named by a string
    metrics = [Metric(f"eval/{task}/{label(row)}{name.strip('|')}", float(row[j]), now_ms,
                      int(row[0]) if depth_axis else 0)
               for row in rows for j, name in enumerate(cols) if j > 0 and np.isfinite(row[j])]
    log_metric_batches(client, child, metrics)
    client.log_artifact(child, str(out), "eval")
    for f in [png, *figures]:
        if f is not None:
            client.log_artifact(child, str(f), "eval")
    client.set_terminated(child)
    return child, run_id


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run dir, its checkpoints/ dir, a tag dir, an export, or (the "
                   "protein tasks) a Hugging Face ESM2 directory or fair-esm .pt read as it is")
    p.add_argument("--task", required=True, choices=TASKS, help="what to measure (docs/evaluation.md): "
                   + "; ".join(f"{b.name}: {b.help}" for b in text_tasks().values()))
    p.add_argument("--data", required=True, help="reconstruction: FASTA(.gz) or shard dir; rnagym: CSV or dir; "
                   "blimp, comps, ewok, entity_tracking, wug_*: JSONL or a folder of them; babylm: "
                   "evaluation_data/full_eval (or fast_eval); lambada: text or JSONL; proteingym: assay CSV or dir; "
                   "validation: shard dirs, comma-separated; flip: a landscape's split CSVs (dir) or one; contacts: "
                   "PDB / mmCIF files (dir) or one; expert_*, memory_motifs: the proteins' FASTA; "
                   "nrc, ssp, reactivity: the task's file (or folder) or a tools/prepare_task.py shard dir")
    p.add_argument("--depths", default=None, help="e.g. 1-8 or 1,2,4,8 (default: the trained R for "
                   "recursive_gpt, 1-8 for eco_rna); capped at 4 x the deepest training depth (a cap never below 8)")
    p.add_argument(TRUST_FLAG, action="store_true", help=TRUST_HELP)
    p.add_argument("--seed", type=int, default=0, help="seeds the masks and the initial-state table")
    p.add_argument("--reference-sheet", type=Path, default=None, help="RNAGym reference_sheet.csv")
    p.add_argument("--reference", type=Path, default=None, help="proteingym: DMS_substitutions.csv (wild types; "
                   "required for a folder)")
    p.add_argument("--window", type=int, default=1024, help="proteingym, flip: tokens per window incl. <cls>/<eos> "
                   "(ProteinGym's optimal window, 1024; flip's probe cuts longer sequences to it, as ESM's --truncate); "
                   "contacts: the longest chain + 2; expert_*: windows a protein is read in")
    p.add_argument("--batch-size", type=int, default=None, help="proteingym, flip: masked copies per forward "
                   "pass (32); "
                   "mlm: sequences per forward pass (32); the BabyLM tasks: items per forward pass (64, the BabyLM "
                   "pipeline's, whose batches it repeats)")
    p.add_argument("--spm", type=Path, default=None, help="text tasks: sentencepiece model (default: the export's "
                   "tokenizer.json / tokenizer.model, else tokenizer.model beside the training shards)")
    p.add_argument("--milestones", action="store_true", help="text tasks: score every word milestone of --checkpoint "
                   "(a run's milestone checkpoints, or an export's chck_* folders) and plot each metric against "
                   "words seen (pipeline/eval/milestones.py)")
    for bench in text_tasks().values():  # each benchmark's own options
        if bench.options is not None:
            bench.options(p)
    p.add_argument("--output", type=Path, default=None, help="JSON path (default: TAG_DIR/eval-TASK.json)")
    p.add_argument("--no-mlflow", action="store_true",
                   help="write the JSON only; do not log the result as a run nested in the training's MLflow run")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    try:  # the checks that need no model first: a bad flag fails in a fraction of a second, before torch loads
        one_depth = args.task in ("proteingym", "mlm") or not getattr(text_tasks().get(args.task), "depth_axis", 1)
        if one_depth and args.depths:  # one depth: a sweep would repeat one number
            raise ValueError(f"--depths does not apply to --task {args.task} (one forward depth per model)")
        if args.reference is not None and args.task != "proteingym":
            raise ValueError("--reference is for --task proteingym (rnagym: --reference-sheet)")
        depths = parse_depths(args.depths) if args.depths else None  # parsed first: a bad --depths fails early
        data = Path(args.data)
        for d in ([Path(x) for x in args.data.split(",")] if args.task == "validation" else [data]):
            if not d.exists():
                raise FileNotFoundError(f"{d}: no such file or directory")
        if args.spm is not None and not args.spm.is_file():
            raise FileNotFoundError(f"{args.spm}: --spm: no such file")
        if args.output is not None and not args.output.parent.is_dir():
            raise FileNotFoundError(f"{args.output.parent}: --output: no such directory")
        if args.milestones and args.task not in text_tasks():
            raise ValueError(f"--milestones is for the text tasks ({', '.join(text_tasks())}), not --task {args.task}")
        from pipeline.checkpoint import is_foreign_checkpoint, load_foreign_model, load_trained_model
        from pipeline.checkpoint.layout import hold_off_rotation

        if is_foreign_checkpoint(args.checkpoint):  # an ESM2 baseline as it is: no conversion step
            if args.task not in protein_tasks() or args.milestones:
                raise ValueError(f"{args.checkpoint}: a foreign checkpoint (Hugging Face directory or fair-esm .pt) "
                                 f"is evaluated on {', '.join(protein_tasks())}, not --task {args.task}"
                                 + (" --milestones" if args.milestones else ""))
            trained = load_foreign_model(args.checkpoint)
        else:
            hold_off_rotation(args.checkpoint)  # a training rotating the run's checkpoints keeps this one until we exit
            if args.milestones:
                return run_milestones(args, depths, data)
            tag_dir, cfg, _ = locate_checkpoint(args.checkpoint)  # config and client state, no weights yet
            if depths:
                check_depths(depths, cfg, tag_dir / "config.yaml", text=args.depths)
            require_trust(tag_dir, args.trust_checkpoint)  # before anything is unpickled
            trained = load_trained_model(tag_dir, trusted=args.trust_checkpoint)
        if args.task not in ("proteingym", "mlm", "validation"):  # these have no depth axis (validation: eval.depths)
            depths = depths or default_depths(trained.cfg)
        if args.task in text_tasks():
            result = run_text(trained, args, data, depths)
        elif args.task == "validation":
            result = run_validation(trained, [Path(x) for x in args.data.split(",")], depths, args.seed)
        elif args.task == "mlm":
            result = run_mlm(trained, data, args.seed, args.batch_size or 32)
        elif args.task == "proteingym":
            result = run_proteingym(proteingym_model(trained), data, args.reference, args.window,
                                    args.batch_size or 32, active_params(trained.cfg))
        elif args.task == "reconstruction":
            result = run_reconstruction(trained, data, depths, args.seed)
        elif args.task in SWEEPS:  # an adapted model's task (pipeline/eval/task_sweeps.py)
            result = SWEEPS[args.task](trained, data, depths, args.seed)
        else:
            result = run_rnagym(trained, data, depths, args.seed, args.reference_sheet)
    except (FileNotFoundError, ValueError) as e:  # ConfigError and ShardError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unreadable data (permissions, a directory where a file was expected): names the path
        print(f"error: {e.filename or args.data}: {e.strerror or e}", file=sys.stderr)
        return 2
    cols = result["columns"]
    home = trained.tag_dir if trained.tag_dir.is_dir() else trained.tag_dir.parent  # a fair-esm .pt: its folder
    out = args.output or home / f"eval-{args.task}.json"
    if args.task == "proteingym":
        width = max(len(str(r[0])) for r in result["table"])
        print(f"{cols[0]:<{width}} | " + " | ".join(f"{c:>10}" for c in cols[1:]))
        for row in result["table"]:
            print(f"{row[0]:<{width}} | {row[1]:>10d} | " + " | ".join(f"{v:>10.4f}" for v in row[2:]))
        if result["skipped"]:
            print(f"note: not in {args.reference}, not scored: {', '.join(result['skipped'])}", file=sys.stderr)
        eff = result["efficiency"]
        print(f"Spearman per billion active parameters: {eff['spearman_per_billion_active']:.4f} ({eff['of']} "
              f"Spearman {eff['spearman']:.4f} / {eff['active_params']:,} active parameters)")
        print(f"wrote {write_proteingym_scores(result, out)}/")
    elif args.task == "validation":
        width = max(map(len, result["metrics"]))
        print("\n".join(f"{k:<{width}} {v:.6f}" for k, v in result["metrics"].items()))
    else:
        w = max([10] + [len(str(r[0])) for r in result["table"]])  # rows named by a string (a split, a category)
        print(" | ".join(f"{c:>{w if j == 0 else 10}}" for j, c in enumerate(cols)))
        for row in result["table"]:
            print(" | ".join(f"{row[0]:>{w}}" if j == 0 else f"{v:>10.4f}" for j, v in enumerate(row)))
    for note in result.get("caveats", ()):  # what a benchmark could not do as asked (flip: AAV indels, ...)
        print(f"note: {note}", file=sys.stderr)
    if "types_line" in result:
        print(result["types_line"])
    if result.get("skipped_line"):
        print(result["skipped_line"])
    figures = result.pop("figures", {})  # a task's own figures, drawn beside the JSON below
    result.update(task=args.task, checkpoint=str(trained.tag_dir), data=str(data), seed=args.seed, depths=depths)
    if args.task == "proteingym":
        result.update(reference=str(args.reference) if args.reference else None)
    try:
        write_atomic(out, json.dumps(result, indent=1, default=float))  # never half a JSON where the result belongs
    except OSError as e:  # e.g. a read-only export: the table above stands, the JSON needs another place
        print(f"error: cannot write {out} ({e.strerror or e}); pass --output PATH to write the JSON elsewhere",
              file=sys.stderr)
        return 2
    print(f"wrote {out}")
    png = None if args.task == "proteingym" else task_plot(trained, args.task, result, out, data)
    if png is not None:
        print(f"wrote {png}")
    drawn = [draw(out.with_name(f"{out.stem}-{name}.png"), f"{args.task} of {trained.tag_dir} on {data.name}, seed "
                  f"{args.seed}: {name} against core iterations K") for name, draw in figures.items()]
    for f in drawn:
        print(f"wrote {f}")
    if not args.no_mlflow:
        log = log_proteingym_to_mlflow(trained, result, out, data) if args.task == "proteingym" else \
            log_to_mlflow(trained, args.task, result, out, data, png, drawn)
        if log:
            print(f"logged to MLflow run {log[0]} (nested in training run {log[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
