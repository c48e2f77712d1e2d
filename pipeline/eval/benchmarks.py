"""The one table of the benchmarks (pipeline/eval/benchmark.py's Benchmark, each declared in its own module):
launchers/evaluate.py reads its task names, options and runs from here, and so do ``--task babylm`` (every BabyLM
pipeline folder found), the milestone curves (``--milestones``), MLflow logging and the plots. A new benchmark is
one module with a ``Benchmark`` and one line below."""
from __future__ import annotations

from pathlib import Path

from pipeline.eval import blimp, comps, contacts, entity_tracking, ewok, flip, lambada, memory_motifs, routing, wug
from pipeline.eval.benchmark import Benchmark

TABLE: dict[str, Benchmark] = {b.name: b for b in (blimp.BENCHMARK, comps.BENCHMARK, ewok.BENCHMARK,
                                                     entity_tracking.BENCHMARK, wug.ADJ, wug.PAST, lambada.BENCHMARK)}
# The protein benchmarks (ProtLingo, and ESM2 checkpoints read as they are): no depth axis, model "protein"
TABLE.update({b.name: b for b in (flip.BENCHMARK, contacts.BENCHMARK, routing.SPECIALIZATION,
                                  routing.INTERVENTION, memory_motifs.BENCHMARK)})

# --task babylm: the BabyLM 2025 pipeline's task folders (evaluation_data/full_eval and fast_eval), in the order
# its eval_zero_shot.sh / eval_zero_shot_fast.sh run them, each with the benchmark that reads it
FOLDERS: dict[str, Benchmark] = {folder: b for b in TABLE.values() for folder in b.folders}
ORDER = ("blimp_filtered", "blimp_fast", "supplement_filtered", "supplement_fast", "ewok_filtered", "ewok_fast",
         "entity_tracking", "entity_tracking_fast", "wug_adj_nominalization", "wug_past_tense", "comps")


def babylm_folders(data: Path) -> list[tuple[str, Benchmark]]:
    """(folder name, benchmark) of every BabyLM task folder directly inside ``data``, in ORDER; ValueError naming
    ``data`` and the names looked for when there is none."""
    data = Path(data)
    if not data.is_dir():
        raise ValueError(f"{data}: --task babylm reads a folder of task folders (evaluation_data/full_eval or "
                         "fast_eval of the BabyLM 2025 pipeline)")
    found = [(name, FOLDERS[name]) for name in ORDER if (data / name).is_dir()]
    if not found:
        raise ValueError(f"{data}: no BabyLM task folder in it (looked for {', '.join(ORDER)})")
    return found


def run_babylm(trained, data, runs, args) -> dict:
    """Every BabyLM task folder of ``data`` (babylm_folders), each by its benchmark's own run; the table holds each
    folder's headline metric per K (BLiMP's macro accuracy, the others' average accuracy, the wug tasks' rho)."""
    from pipeline.eval.benchmark import headline

    found = babylm_folders(data)
    tasks = {name: {"task": bench.name, **bench.run(trained, Path(data) / name, runs, args)} for name, bench in found}
    table = [(k, *(headline(bench, tasks[name], k) for name, bench in found)) for k, _ in runs]
    return {"tasks": tasks, "columns": ("K", *(name for name, _ in found)), "table": table,
            "per_depth": {str(row[0]): dict(zip((n for n, _ in found), row[1:])) for row in table}}


BABYLM = Benchmark(name="babylm", help="every BabyLM 2025 task folder found in --data (evaluation_data/full_eval or "
                   "fast_eval: blimp_filtered, supplement_filtered, ewok_filtered, entity_tracking, comps, wug_*), "
                   "each named by its folder", scorer="ranked", metrics=ORDER, run=run_babylm)
TABLE[BABYLM.name] = BABYLM
