"""A supervised adaptation task's spec (paper 000, Sec. 3.5, A.5, A.7), its registry, and the training spec of an
adapted model built from a family's spec and a task's: the training engine, checkpoints, validation, evaluation and
export ask that spec, as they ask a family's, and never branch on a task's name.

A task declares, in its own module (pipeline/tasks/nrc.py, ssp.py, reactivity.py), what adapting to it means:

- its reader: the task's published file formats -> :class:`Record` (id, sequence, label, file and line), with one
  error line naming the file and line for bad input (tools/prepare_task.py writes the records as shards whose meta
  holds the label; evaluation reads the files directly);
- its label encoding: a record's meta -> the sample's ``labels`` / ``targets`` and its supervised ``units`` (what
  the step's exact normalization counts: sequences, valid pair cells, measured values);
- its head (a class of pipeline/models/heads.py, sized by the task config's ``head``);
- its loss and validation sums on the head's prediction, and its metric (the sweep's numbers, pooled over a data set).

Layering: this package sits with the families (layer 4): it uses models, objectives and data, and pipeline.config
reads its registry to build the typed ``task:`` section (one dataclass per task, errors naming the field).
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.data.tokenizer import IGNORE_INDEX, NucleotideTokenizer
from pipeline.errors import ConfigError

BACKBONE_MODES = ("full", "frozen")


@dataclass
class TaskConfig(abc.ABC):
    """The ``task:`` section's fields every task has; each task's config subclasses it with its head's sizes.

    name: the task (nrc, ssp, reactivity).
    backbone: ``full`` adapts every backbone weight with the head (the paper's protocol, A.5); ``frozen`` trains the
        head alone on the backbone's features (no backbone gradient, no optimizer state for it).
    """

    name: str = ""
    backbone: str = "full"

    def __post_init__(self):
        if self.backbone not in BACKBONE_MODES:
            raise ConfigError(f"task.backbone: must be one of {', '.join(BACKBONE_MODES)}, got {self.backbone!r}")

    @abc.abstractmethod
    def head(self, d_model: int) -> dict:
        """{"name": a class of pipeline/models/heads.py, "kwargs": its arguments, "first": whether it reads the
        first-iteration features}: what builds the head here and in an export's Hugging Face class."""

    def outputs(self) -> list[str]:
        """The names of the head's outputs (classes, probes), for an export's id2label; [] when unnamed."""
        return []


@dataclass
class Record:
    """One labelled sequence of a task file: ``where`` is its file and line (every later error names it)."""

    id: str
    sequence: str  # upper case, RNA alphabet as read (T and U both allowed; the tokenizer writes T as U)
    label: object  # the task's label (a class name, a partner vector, reactivity profiles)
    where: str


@dataclass(frozen=True, kw_only=True)
class Task:
    """One task (module docstring). Callables get the task config (``tcfg``) of the run."""

    name: str
    config_cls: type
    # path -> [Record]: a file (or folder) in one of the task's formats; ``formats`` says which, for errors and help
    read: Callable
    formats: str
    meta: Callable  # Record -> the JSON meta of its shard sample (the label, as encode reads it)
    # (meta, crop start, residues kept, tcfg, where) -> {"labels" [n + 2], optional "targets" [n + 2, ...], "units"}
    encode: Callable
    # (prediction, Batch, tcfg) -> (summed loss tensor, stats {name: (numerator, denominator)})
    loss: Callable
    # (prediction, Batch, tcfg) -> stats {name: (numerator, denominator)} of a validation batch at one depth
    validate: Callable
    # (prediction, Batch, tcfg) -> one list entry per sequence (host data) for ``metrics``
    collect: Callable
    # (entries, tcfg) -> (headline {metric: value} in ``columns`` order, details (per class, per probe, ...))
    metrics: Callable
    columns: tuple
    # a sequence longer than the model's window: cropped (at a seeded random window) or left out of an evaluation
    crop_eval: bool = False
    # (entries, tcfg) -> {"accuracy": ..., "loss": ...} a guess ignoring the input reaches (the depth plot's dotted
    # line), or None
    chance: Callable | None = None
    # "module:function" of the figures a sweep draws beside its table (pipeline/eval/task_plots.py), each called as
    # (sweep result, {K: entries}, depths, tcfg, path, title) -> path; imported when a sweep runs
    figures: tuple = ()


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"task.name: unknown task {name!r} (known: {', '.join(sorted(TASKS))})")
    return TASKS[name]


# ---- the sample transform: a record's tokens and meta -> a training sample -------------------------------------------
class TaskTransform:
    """(tokens uint8 [n] residues, rng, meta) -> {"input_ids" [n' + 2], "labels", "targets", "units"}: the record
    framed ``<cls> ... <eos>``, cropped to one window of ``data.context_length - 2`` residues at a position drawn from
    ``rng`` when longer (the pretraining's crop; the label cropped alike), and its label encoded by the task.
    ``reads_meta``: the loader hands it each record's meta (pipeline/data/streams.py)."""

    reads_meta = True

    def __init__(self, task: Task, cfg):
        self.task, self.tcfg, self.window = task, cfg.task, cfg.data.context_length - 2
        self.cls_id, self.eos_id = NucleotideTokenizer.cls_id, NucleotideTokenizer.eos_id

    def __call__(self, tokens: np.ndarray, rng, meta: dict) -> dict:
        n = len(tokens)
        start = int(rng.integers(n - self.window + 1)) if n > self.window else 0
        kept = tokens[start:start + self.window]
        ids = np.concatenate([[self.cls_id], kept, [self.eos_id]]).astype(np.int64)
        where = f"record {meta.get('id', '?')}"
        return {"input_ids": ids, **self.task.encode(meta, start, len(kept), self.tcfg, where)}


def frame_labels(values: np.ndarray) -> np.ndarray:
    """[n] int64 residue labels -> [n + 2] with IGNORE_INDEX at <cls> and <eos>."""
    return np.concatenate([[IGNORE_INDEX], np.asarray(values, dtype=np.int64), [IGNORE_INDEX]])


# ---- the training spec of an adapted model ---------------------------------------------------------------------------
def adapted_family(family, task: Task, cfg):
    """The Family spec the engine trains (and checkpoints, validates, exports) for ``task`` on ``family``'s backbone:
    the model is a TaskModel (backbone + the task's head), the transform the task's, the plan the family's (depths
    from its objective's law, or fixed), the loss the task's on the head's prediction, normalized by the batch's units
    (pipeline/data/batch.py), validation the task's sums at each K of eval.depths from the evaluation table."""
    from pipeline.families import Family
    from pipeline.models.heads import TaskModel, build_head
    from pipeline.objectives.eco_rna import LossOutput

    if family.adapt is None:
        raise ConfigError(f"task: the {family.name} family has no task heads (its spec declares no Adaptation)")
    adapt, tcfg = family.adapt, cfg.task

    def build_model(model_cfg):
        backbone = family.build_model(model_cfg)
        spec = tcfg.head(adapt.width(model_cfg))
        model = TaskModel(backbone, build_head(spec["name"], spec["kwargs"]), first=spec["first"])
        if tcfg.backbone == "frozen":  # no gradient and no optimizer state for the backbone (train/optim.py)
            model.backbone.requires_grad_(False)
        return model

    first = tcfg.head(adapt.width(cfg.model))["first"]

    def loss(model, batch, run_cfg, plan):
        out = adapt.forward(model, batch, run_cfg, plan)
        total, stats = task.loss(out.prediction, batch, run_cfg.task)
        return LossOutput(total, batch.num_supervised, stats, {
            "row_iterations": out.row_iterations, "flops": adapt.flops(run_cfg, plan, batch, first)})

    def validate(model, batch, run_cfg):
        init = adapt.eval_state(run_cfg, batch.attention_mask, run_cfg.eval.seed)
        stats = {}
        for k, pred in model.at_depths(batch.input_ids, batch.attention_mask, run_cfg.eval.depths, init).items():
            stats.update({f"{name}_K{k}": v for name, v in task.validate(pred, batch, run_cfg.task).items()})
        return stats, {}

    def check(run_cfg):
        family.check_config(run_cfg)
        if run_cfg.train.max_tokens_per_microbatch == "auto":
            raise ConfigError("train.max_tokens_per_microbatch: auto sizes a microbatch by the family's memory model, "
                              "which does not count task heads; give a number of tokens or micro_batch_size rows")
        if run_cfg.train.init_from_optimizer:
            raise ConfigError("train.init_from_optimizer: a task model has parameters (its head) the source's "
                              "optimizer state does not hold; start from the weights (set it to false)")

    return dataclasses.replace(
        family, build_model=build_model, make_transform=lambda run_cfg: TaskTransform(task, run_cfg), loss=loss,
        validate=validate, check_config=check, derive_metrics=None, inference=None, import_weights=None,
        hf=adapt.hf, execution=lambda model, run_cfg, probe: family.execution(model.backbone, run_cfg, probe),
        init_state=lambda run_cfg, source_config, load: init_state(run_cfg, build_model, source_config, load))


def init_state(cfg, build_model: Callable, source_config: dict, load: Callable) -> dict | None:
    """The state a task run starts from (train.init_from; ``source_config``: the source's config.yaml, ``load``: its
    full state dict, read only when needed): None when the source is a run of the same task (every tensor present:
    the engine loads it as it is); else the source's backbone under ``backbone.`` (a pretraining run's whole model,
    another task's backbone without its head) with the head as the run's seed initializes it."""
    import torch

    saved = source_config.get("task")
    if saved and saved.get("name") == cfg.task.name:
        return None
    torch.manual_seed(cfg.seed)  # the head: the Trainer's initial weights (it seeds the same way before building)
    fresh = build_model(cfg.model).state_dict()
    state = load()
    if saved:  # another task's run: its backbone, without its head
        state = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
    merged = {f"backbone.{k}": v for k, v in state.items()}
    unknown = sorted(set(merged) - set(fresh))
    missing = sorted(k for k in fresh if k.startswith("backbone.") and k not in merged)
    if unknown or missing:
        raise ConfigError(f"train.init_from: its weights are not this task model's backbone (missing {missing[:3]}, "
                          f"unexpected {unknown[:3]})")
    return {**fresh, **merged}


def task_section(raw, from_dict) -> TaskConfig:
    """A run config's ``task:`` section as its task's config dataclass, read by pipeline/config.py's ``from_dict``
    (passed in: the config layer sits above this one)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"task: expected a mapping, got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"task.name: required, one of {', '.join(sorted(TASKS))}")
    return from_dict(get_task(name).config_cls, raw, prefix="task.")


def training_spec(cfg):
    """The Family spec a run config trains and loads: its family's, or with a ``task:`` section the adapted model's
    (:func:`adapted_family`)."""
    from pipeline.families import get_family

    family = get_family(cfg.family)
    if getattr(cfg, "task", None) is None:
        return family
    return adapted_family(family, get_task(cfg.task.name), cfg)


def crop_note(count: int, total: int, window: int, crop: bool) -> str:
    """The warning a sweep prints when sequences are longer than the window."""
    what = "evaluated on one seeded window of" if crop else "left out (the metric needs whole sequences); window"
    return f"{count:,} of {total:,} sequences are longer than the model's window: {what} {window:,} residues"


__all__ = ["BACKBONE_MODES", "Record", "Task", "TaskConfig", "TaskTransform", "TASKS", "adapted_family",
           "frame_labels", "get_task", "register_task", "task_section", "training_spec"]
