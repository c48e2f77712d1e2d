"""The BabyLM 2025 wug tasks (adjective nominalization, past tense; read_files.py ``decode_wug``): each line holds
``sentences`` (the options, tab-separated, each scored whole) and ``ratio`` (the humans' preference for the first).
The metric is Spearman's rho between the model's probability of the first option (softmax over the options' summed
log-probabilities) and the ratios (compute_results.py ``rank_and_evaluate_wug``); every item's subset is the task
name. Scoring: pipeline/eval/ranked.py; registered in pipeline/eval/benchmarks.py as wug_adj and wug_past."""
from __future__ import annotations

from functools import partial
from pathlib import Path

from pipeline.eval.benchmark import ranked
from pipeline.eval.ranked import Item, read_folder, string


def decode(rec: dict, path: Path, where: str, task: str) -> Item:
    options = tuple(string(rec, "sentences").split("\t"))
    return Item(options, options, task, ratio=float(rec["ratio"]), where=where)


def reader(task: str):
    return lambda path: read_folder(Path(path), partial(decode, task=task), f"{task}: sentences, ratio")


def _benchmark(task: str, folder: str, what: str):
    return ranked(task, f"the {what} wug test (BabyLM 2025 {folder}/): Spearman's rho with the human ratios",
                  reader(task), folders=(folder,), spearman=True)


ADJ = _benchmark("wug_adj", "wug_adj_nominalization", "adjective nominalization")
PAST = _benchmark("wug_past", "wug_past_tense", "past tense")
