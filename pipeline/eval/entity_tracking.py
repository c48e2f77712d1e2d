"""Entity Tracking (Kim & Schuster, 2023) as the BabyLM 2025 pipeline reads it (read_files.py
``decode_entity_tracking``): each line holds ``input_prefix``, ``options`` (the correct one first) and ``numops``;
option i is ``input_prefix + options[i]`` with ``options[i]`` the completion. Subset: ``{file stem}_{numops}_ops``; the
average is the mean over the splits regular, ambiref and move_contents of the mean over each split's subsets
(run.py ``process_results``). Scoring: pipeline/eval/ranked.py; registered in pipeline/eval/benchmarks.py."""
from __future__ import annotations

from pathlib import Path

from pipeline.eval.benchmark import ranked
from pipeline.eval.ranked import Item, read_folder, string


def decode(rec: dict, path: Path, where: str) -> Item:
    prefix, options = string(rec, "input_prefix"), rec["options"]
    if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
        raise TypeError("key 'options' is not a list of two or more strings")
    return Item(tuple(prefix + o for o in options), tuple(options), f"{path.stem}_{rec['numops']}_ops", where=where)


def read(path) -> list[Item]:
    return read_folder(Path(path), decode, "Entity Tracking: input_prefix, options, numops")


BENCHMARK = ranked("entity_tracking", "Entity Tracking (BabyLM 2025 entity_tracking/): accuracy per file and number "
                   "of operations, averaged over the three splits", read,
                   folders=("entity_tracking", "entity_tracking_fast"), average="entity_tracking")
