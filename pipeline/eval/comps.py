"""COMPS (Misra et al., 2023) as the BabyLM 2025 pipeline reads it (read_files.py ``decode_comps``): each line holds
``prefix_acceptable``, ``prefix_unacceptable`` and ``property_phrase``; the two options are "prefix property" for
either prefix, the completion the shared property phrase, so only the property's tokens are scored, after each
prefix. Subsets by file: comps_base -> base, comps_wugs -> wugs, comps_wugs_dist-before -> wugs_dist_before, any
other file -> wugs_dist_in_between (the pipeline's rule). A prediction is the chosen whole sentence. Scoring:
pipeline/eval/ranked.py; registered in pipeline/eval/benchmarks.py."""
from __future__ import annotations

from pathlib import Path

from pipeline.eval.benchmark import ranked
from pipeline.eval.ranked import Item, read_folder, string

SUBSETS = {"comps_base": "base", "comps_wugs": "wugs", "comps_wugs_dist-before": "wugs_dist_before"}
OTHER = "wugs_dist_in_between"


def decode(rec: dict, path: Path, where: str) -> Item:
    prop = string(rec, "property_phrase")
    good, bad = string(rec, "prefix_acceptable"), string(rec, "prefix_unacceptable")
    return Item((f"{good} {prop}", f"{bad} {prop}"), (prop, prop), SUBSETS.get(path.stem, OTHER), where=where)


def read(path) -> list[Item]:
    return read_folder(Path(path), decode, "COMPS: prefix_acceptable, prefix_unacceptable, property_phrase")


BENCHMARK = ranked("comps", "COMPS property knowledge (BabyLM 2025 comps/ files): accuracy per subset", read,
                   folders=("comps",), prediction="sentences")
