"""EWoK (Ivanova et al., 2024) as the BabyLM 2025 pipeline reads it (read_files.py ``decode_ewok``, without
--full_sentence_scores): each line holds ``Context1``, ``Context2``, ``Target1``, ``Target2``, ``Domain``,
``ContextType``, ``ContextDiff`` and ``TargetDiff``. The options are "Context1 Target1" and "Context1 Target2" (both
after Context1: the pipeline reads Context2 but its causal backend never scores it), the completion " Target" with
its leading space, so the targets' tokens are scored given the first context. Subsets: ``Domain``; accuracy also per
context type and per context and target contrast. Scoring: pipeline/eval/ranked.py; registered in
pipeline/eval/benchmarks.py."""
from __future__ import annotations

from pathlib import Path

from pipeline.eval.benchmark import ranked
from pipeline.eval.ranked import Item, read_folder, string


def decode(rec: dict, path: Path, where: str) -> Item:
    c1, t1, t2 = string(rec, "Context1"), string(rec, "Target1"), string(rec, "Target2")
    string(rec, "Context2")  # the pipeline reads it (a file without it fails there too)
    meta = {"context_type": rec["ContextType"], "context_contrast": rec["ContextDiff"],
            "target_contrast": rec["TargetDiff"]}
    return Item((f"{c1} {t1}", f"{c1} {t2}"), (f" {t1}", f" {t2}"), str(rec["Domain"]), meta=meta, where=where)


def read(path) -> list[Item]:
    return read_folder(Path(path), decode, "EWoK: Context1, Context2, Target1, Target2, Domain, ContextType, "
                                           "ContextDiff, TargetDiff")


BENCHMARK = ranked("ewok", "EWoK world knowledge (BabyLM 2025 ewok_filtered/): accuracy per domain", read,
                   folders=("ewok_filtered", "ewok_fast"))
