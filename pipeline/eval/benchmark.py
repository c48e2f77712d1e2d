"""What a text benchmark declares (:class:`Benchmark`) and the runs every ranked-completion task shares.

Each benchmark module (blimp.py, comps.py, ewok.py, entity_tracking.py, wug.py, lambada.py) declares its reader, its
scorer kind, its metrics, the BabyLM pipeline's folder names it reads and its command-line options in one
``Benchmark``; pipeline/eval/benchmarks.py registers them in the one table that launchers/evaluate.py (its --task
choices, options and dispatch), the depth sweeps, the milestone curves, MLflow logging and the plots read.

A run returns the launcher's result dict: ``per_depth`` {K: the task's report}, ``columns`` ("K", then the metrics) and
``table`` (one row per K) from which the printed table, the MLflow metrics (eval/TASK/METRIC at step K) and the
metric-against-K plot are made.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

SCORERS = ("ranked", "ranked_spearman", "minimal_pairs", "teacher_forced", "masked_marginals", "trained_head",
           "routing", "memory")
MODELS = ("text", "protein")  # what a benchmark scores: a text family's LM, or a masked LM over the ESM-2 alphabet


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """name: --task NAME (and the MLflow prefix eval/NAME/); help: one line for --help.
    read: data path (file or folder) -> items (pipeline/eval/ranked.py Item; None for a task with its own reader
        inside ``run``).
    scorer: "ranked" (summed completion log-probabilities, the first of the best options chosen, accuracy per
        subset), "ranked_spearman" (the same scores, Spearman's rho of the first option's probability with human
        ratios), "minimal_pairs" (BLiMP: ranked for whole sentences, conditional scores for the prefix methods),
        "teacher_forced" (LAMBADA's top-k of every target token), "masked_marginals" (sum of log p(mt) - log p(wt)
        with each position masked in the wild type), "trained_head" (a head fitted on the frozen model's features:
        FLIP's probe, the contact regression), "routing" (MoE expert choices against residue annotations) or
        "memory" (the latent N-gram memory's addresses and residuals); a benchmark with two protocols joins their
        kinds with "+".
    model: "text" (a family that reads text, Family.text) or "protein" (a masked LM over the ESM-2 alphabet: the
        ProtLingo family, and ESM2 checkpoints read through Family.from_foreign).
    depth_axis: whether the task sweeps depths (--depths); a protein task has one forward depth and refuses it.
    plot: (result, JSON path, title) -> the PNG written beside the JSON, for a task without a depth axis (the
        depth tasks get launchers/evaluate.py's metric-against-K plot); None: none.
    metrics: the headline metric first (the column --task babylm and the milestone curves show), then what else the
        table always holds (per-subset accuracies follow it, named by subset).
    folders: the folder names of the BabyLM pipeline's evaluation_data/{full_eval,fast_eval} this benchmark reads
        (--task babylm runs each it finds, named by the folder).
    options: adds this benchmark's own flags to launchers/evaluate.py's parser (None: none).
    run: (trained model, data path, [(K, depth argument)], parsed args) -> the result dict (module docstring).
    prediction: which option field a prediction names ("completions", or "sentences" for COMPS).
    average: how the average is taken over subsets ("uid", or "entity_tracking": over the three splits).
    """

    name: str
    help: str
    scorer: str
    metrics: tuple[str, ...]
    run: Callable
    read: Callable | None = None
    folders: tuple[str, ...] = ()
    options: Callable[[argparse.ArgumentParser], None] | None = None
    prediction: str = "completions"
    average: str = "uid"
    model: str = "text"
    depth_axis: bool = True
    plot: Callable | None = None

    def __post_init__(self):
        if any(kind not in SCORERS for kind in self.scorer.split("+")):
            raise ValueError(f"{self.name}: scorer must be one of {SCORERS} (or kinds joined by +), got {self.scorer!r}")
        if self.model not in MODELS:
            raise ValueError(f"{self.name}: model must be one of {MODELS}, got {self.model!r}")

    def check_model(self, trained) -> None:
        """ValueError naming the task unless ``trained`` is a model this benchmark scores (``model``)."""
        from pipeline.families import get_family

        family = get_family(trained.cfg.family)
        if self.model == "text" and not family.text:
            raise ValueError(f"--task {self.name} scores text; {trained.cfg.family} is not a text model")
        if self.model == "protein" and (family.tokenizer != "esm" or family.inference is None):
            raise ValueError(f"--task {self.name} needs a masked LM over the ESM-2 alphabet; {trained.cfg.family} "
                             f"reads {family.tokenizer} tokens")


def depth_runs(trained, depths: list[int]) -> list[tuple[int, int | None]]:
    """[(K shown, depth passed to the model)]: every requested depth for a family whose depth is selectable, else
    its one trained depth once (a standard decoder's layer count, passed as None)."""
    from pipeline.families import get_family

    depth = get_family(trained.cfg.family).depth
    if not depth.selectable:
        return [(depth.trained(trained.cfg)[0], None)]
    return [(k, k) for k in depths]


def ranked_report(bench: Benchmark, items: list, scores: np.ndarray) -> dict:
    """One depth's report of a ranked task: accuracies (or Spearman's rho), the per-item summed log-probabilities
    ``scores`` [items, options], the choices and the pipeline's predictions."""
    from pipeline.eval.ranked import accuracy_report, choose, predictions, spearman_report

    chosen = choose(scores)
    if bench.scorer == "ranked_spearman":
        rep = spearman_report(items, scores)
        preds = predictions(items, chosen, bench.prediction, probs=rep["probs"])
    else:
        rep = accuracy_report(items, chosen, bench.average)
        preds = predictions(items, chosen, bench.prediction)
    return {**rep, "chosen": chosen.tolist(), "scores": scores.tolist(), "predictions": preds}


def run_ranked(bench: Benchmark, trained, data: Path, runs, args) -> dict:
    """Score ``bench.read(data)`` at every depth of ``runs`` (pipeline/eval/ranked.py) and tabulate."""
    from pipeline.eval.ranked import hf_tokenizer, model_logits_fn, score_items

    items = bench.read(data)
    tokenizer = hf_tokenizer(trained, getattr(args, "spm", None))
    batch = getattr(args, "batch_size", None) or 64
    per_depth = {}
    for k, d in runs:
        scores = score_items(items, tokenizer, model_logits_fn(trained.model, d), batch_size=batch,
                             desc=f"{bench.name} K={k}")
        per_depth[str(k)] = ranked_report(bench, items, scores)
    first = per_depth[str(runs[0][0])]
    if bench.scorer == "ranked_spearman":
        columns, table = ("K", "spearman"), [(k, per_depth[str(k)]["spearman"]) for k, _ in runs]
    else:
        subsets = list(first["accuracy"])
        columns = ("K", "accuracy", *subsets)
        table = [(k, per_depth[str(k)]["average"], *(per_depth[str(k)]["accuracy"][u] for u in subsets))
                 for k, _ in runs]
    return {"n_items": len(items), "per_depth": per_depth, "columns": columns, "table": table,
            "scorer": bench.scorer}


def ranked(name: str, help: str, read: Callable, folders: tuple = (), spearman: bool = False,
           prediction: str = "completions", average: str = "uid") -> Benchmark:
    """A ranked-completion benchmark: its reader and names; scoring and reporting are run_ranked's."""
    holder: dict = {}

    def run(trained, data, runs, args):
        return run_ranked(holder["bench"], trained, data, runs, args)

    bench = Benchmark(name=name, help=help, scorer="ranked_spearman" if spearman else "ranked",
                      metrics=("spearman",) if spearman else ("accuracy",), run=run, read=read, folders=folders,
                      prediction=prediction, average=average)
    holder["bench"] = bench
    return bench


def headline(bench: Benchmark, result: dict, k) -> float:
    """The benchmark's headline metric at depth ``k`` of its result (its ``metrics[0]`` column)."""
    cols = list(result["columns"])
    row = next(r for r in result["table"] if r[0] == k)
    return float(row[cols.index(bench.metrics[0])])
