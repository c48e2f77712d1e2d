"""Fixed-weight depth sweeps of an adapted model (paper 000, Sec. 3.5, Tables A5 and A6, Figures 4 and A1):
``launchers/evaluate.py --task nrc|ssp|reactivity --checkpoint ADAPTED --data FILE --depths 1-8``.

The checkpoint (backbone and head), the inputs and the initial states are fixed across K: every batch runs one
trajectory from the seed-fixed evaluation table (the family's ``Adaptation.eval_state``, as the zero-shot sweeps use
it) and the head reads it out at every requested K (``TaskModel.at_depths``), so the numbers at K = 4 of a 1-8 sweep
are those of a K = 4 evaluation, bit for bit. The inputs are the task's validation inputs: each record framed and,
where the task allows, cropped by the task's transform with a generator owned by (seed, index), in batches of the
checkpoint's ``eval.batch_size``: the computation of the training's validation (pipeline/validation.py) on the same
records, which is why a training's ``val/accuracy_K4`` and a sweep's K = 4 agree.

Data: the task's own file (its reader, pipeline/tasks) or a shard directory of tools/prepare_task.py. A sequence
longer than the model's window is evaluated on one seeded window when the task allows (nRC) and otherwise left out
and counted (secondary structure and reactivity score whole sequences); both are said on stderr and kept in the
JSON. The metric of each K is the task's, pooled over the data set (its ``metrics``); its figures are declared by
the task (``Task.figures``, pipeline/eval/task_plots.py).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from pipeline.data.batch import collate
from pipeline.data.streams import set_records
from pipeline.data.tokenizer import NucleotideTokenizer
from pipeline.eval.reconstruction import heldout_samples
from pipeline.families import get_family
from pipeline.tasks import TASKS, get_task, training_spec
from pipeline.tasks.base import crop_note


def task_inputs(task, tcfg, data: Path) -> tuple[list, list[str]]:
    """([(residue tokens uint8, meta)], record ids) of ``data``: a shard directory of tools/prepare_task.py, or a file
    the task's reader takes."""
    data = Path(data)
    if data.is_dir() and (data / "manifest.json").is_file():
        items = set_records(str(data))
    else:
        tok = NucleotideTokenizer("rna")
        items = []
        for r in task.read(data, tcfg):
            try:
                items.append((tok.encode(r.sequence), task.meta(r)))
            except ValueError as e:
                raise ValueError(f"{r.where}: {e}") from None
    if not items:
        raise ValueError(f"{data}: no record to evaluate")
    return items, [str(m.get("id", i)) for i, (_, m) in enumerate(items)]


@torch.no_grad()
def sweep(trained, task_name: str, data: Path, depths: list[int], seed: int = 0,
          batch_size: int | None = None) -> dict:
    """The task's metrics at every K of ``depths`` (module docstring): {"per_depth": {K: headline + details},
    "entries": {K: the task's per-sequence entries}, "ids", "sequences", "left_out" / "cropped", "window"}."""
    from pipeline.eval.cli import progress

    cfg = trained.cfg
    if cfg.task is None or cfg.task.name != task_name:
        had = f"its task is {cfg.task.name}" if cfg.task is not None else "it has no task head (a pretraining run)"
        raise ValueError(f"--task {task_name}: {trained.tag_dir} is not adapted to {task_name} ({had}); fine-tune it "
                         "with launchers/finetune.py (docs/adaptation.md)")
    task, spec, family = get_task(task_name), training_spec(cfg), get_family(cfg.family)
    items, ids = task_inputs(task, cfg.task, data)
    window = cfg.data.context_length - 2
    longer = [i for i, (t, _) in enumerate(items) if len(t) > window]
    total = len(items)
    if longer:
        print(f"warning: {data}: {crop_note(len(longer), total, window, task.crop_eval)}", file=sys.stderr)
        if not task.crop_eval:
            keep = [i for i in range(total) if len(items[i][0]) <= window]
            items, ids = [items[i] for i in keep], [ids[i] for i in keep]
            if not items:
                raise ValueError(f"{data}: every sequence is longer than the model's window of {window} residues")
    samples = heldout_samples(items, spec.make_transform(cfg), seed)
    size = batch_size or cfg.eval.batch_size
    model = trained.model.eval()
    device = next(model.parameters()).device
    entries: dict[int, list] = {k: [] for k in depths}
    for i in progress(range(0, len(samples), size), desc=f"{task_name} K={depths[0]}-{depths[-1]}", unit="batch"):
        b = collate(samples[i:i + size], pad_id=spec.pad_id).to(device)
        init = family.adapt.eval_state(cfg, b.attention_mask, seed)
        for k, pred in model.at_depths(b.input_ids, b.attention_mask, depths, init).items():
            entries[k] += task.collect(pred, b, cfg.task)
    per_depth = {}
    for k in depths:
        headline, details = task.metrics(entries[k], cfg.task)
        per_depth[k] = {**headline, **details}
    return {"per_depth": per_depth, "entries": entries, "ids": ids, "sequences": len(items), "window": window,
            ("cropped" if task.crop_eval else "left_out"): len(longer), "records": total}


def run(task_name: str, trained, data: Path, depths: list[int], seed: int) -> dict:
    """launchers/evaluate.py's result for a task sweep: the table (K and the task's headline metrics), the JSON's
    per-depth details, the chance level where the task has one, and "figures" {suffix: draw(path, title)} that the
    launcher draws beside the JSON (and pops before writing it)."""
    task = get_task(task_name)
    res = sweep(trained, task_name, data, depths, seed)
    entries = res.pop("entries")
    per_depth = res["per_depth"]
    table = [(k, *(per_depth[k][c] for c in task.columns)) for k in depths]
    figures = {}
    for ref in task.figures:
        module, _, name = ref.partition(":")
        draw = getattr(importlib.import_module(module), name)
        figures[name.replace("_", "-")] = (lambda path, title, draw=draw:
                                           draw(res, entries, depths, trained.cfg.task, path, title))
    chance = task.chance(entries[depths[0]], trained.cfg.task) if task.chance else None
    return {**res, "per_depth": {str(k): v for k, v in per_depth.items()}, "table": table,
            "columns": ("K", *task.columns), **({"chance": chance} if chance else {}), "figures": figures}


def _runner(name: str):
    return lambda trained, data, depths, seed: run(name, trained, data, depths, seed)


# launchers/evaluate.py's tasks of adapted models: one entry per registered task
SWEEPS = {name: _runner(name) for name in TASKS}
