"""Validation on a cadence: the family's held-out metrics every ``eval.every`` steps, split over the ranks, exact.

The held-out set is the first ``eval.max_samples`` sequences of ``data.val_shards`` (manifest order), each cropped,
framed and masked once by the family's training transform with a generator owned by (eval.seed, index)
(``pipeline.eval.reconstruction.heldout_samples``, what ``launchers/evaluate.py`` uses), then cut into batches of
``eval.batch_size`` in order. Batch j is evaluated by rank j mod world; every rank runs the same number of forward
passes (a rank without a batch in the last round repeats its first and discards it), because ZeRO-3 gathers
parameters and expert parallelism exchanges tokens inside the forward, collectively. The family's ``validate``
returns sums (CE, correct, tokens, expert counts); their all-reduce, then one division, gives the metrics: sums, never
means of means, so world size 1 and 2 and every ZeRO stage give the same numbers up to summation order, and the
same as ``launchers/evaluate.py`` on the checkpoint (Eco-RNA: ``--task reconstruction``; ProtLingo: ``--task mlm``;
any family: ``--task validation``).

Metrics are named ``val/<stat>`` (Eco-RNA: val/loss_K<k>, val/accuracy_K<k> for K in eval.depths; the others:
val/loss and val/perplexity, ProtLingo also routing entropy and effective experts per MoE layer and memory address
usage), plus val/seconds.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import RunConfig
from pipeline.data.batch import collate
from pipeline.data.compat import check_shards_fit
from pipeline.data.streams import reads_meta, set_records, set_sequences
from pipeline.data.shards import MANIFEST
from pipeline.errors import ConfigError
from pipeline.eval.reconstruction import heldout_samples
from pipeline.families import Family


def val_shard_dirs(cfg: RunConfig) -> list[str]:
    """``data.val_shards``, or by default the ``val/`` split data_prep writes beside each training shard directory
    named ``train`` (``--val-fraction``) that has one."""
    if cfg.data.val_shards is not None:
        return list(cfg.data.val_shards)
    specs = [s.shards for s in cfg.data.sources] if cfg.data.sources else [cfg.data.train_shards]
    return [str(Path(s).parent / "val") for s in specs
            if Path(s).name == "train" and (Path(s).parent / "val" / MANIFEST).is_file()]


def check_validation(cfg: RunConfig, family: Family) -> list[str]:
    """The validation shard directories of a run with ``eval.every`` > 0, refused at start (ConfigError naming the
    key) when there are none, the family has no validation, or they do not fit the model like the training shards."""
    if not cfg.eval.every:
        return []
    if family.validate is None:
        raise ConfigError(f"eval.every: the {family.name} family has no validation")
    dirs = val_shard_dirs(cfg)
    if not dirs:
        raise ConfigError("data.val_shards: eval.every is set but there is no validation set: give data.val_shards, "
                          "or write the training shards with `data_prep ... --val-fraction F` (DIR/train, DIR/val)")
    for i, d in enumerate(dirs):
        key = "data.val_shards" if cfg.data.val_shards is not None else f"data.val_shards (default {d})"
        check_shards_fit(d, family, cfg.model.vocab_size, key if len(dirs) == 1 else f"{key}[{i}]")
    return dirs


def heldout_batches(cfg: RunConfig, family: Family, dirs: list[str], cache=None) -> list:
    """The validation set as collated batches (the same on every rank and every evaluation); ``cache``: where the
    shards of a remote set are fetched to (RunPlan.cache)."""
    limit = cfg.eval.max_samples
    transform = family.make_transform(cfg)
    read = set_records if reads_meta(transform) else set_sequences  # a task's records carry their labels
    seqs = []
    for d in dirs:
        seqs += read(d, None if limit is None else limit - len(seqs), cache)
    seqs = seqs[:limit] if limit is not None else seqs
    if not seqs:
        raise ConfigError(f"data.val_shards: {', '.join(dirs)} hold no sequence")
    samples = heldout_samples(seqs, transform, cfg.eval.seed)
    size = cfg.eval.batch_size
    return [collate(samples[i:i + size], pad_id=family.pad_id) for i in range(0, len(samples), size)]


def _add(into: dict, stats: dict, totals: dict):
    for k, (num, den) in stats.items():
        acc = into.setdefault(("stat", k), [0.0, 0.0])
        acc[0], acc[1] = acc[0] + float(num), acc[1] + float(den)
    for k, v in totals.items():
        acc = into.setdefault(("total", k), [0.0, 0.0])
        acc[0] += float(v)


def reduce_sums(sums: dict) -> dict:
    """Sum {(kind, name): [a, b]} over the ranks (float64; the union of every rank's names)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sums
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(sums))
    keys = sorted({k for ks in names for k in ks})
    t = torch.tensor([sums.get(k, [0.0, 0.0]) for k in keys], dtype=torch.float64).reshape(-1, 2)
    dist.all_reduce(t)
    return {k: row.tolist() for k, row in zip(keys, t)}


def metrics_from_sums(sums: dict, family: Family) -> dict:
    """val/<stat> = numerator / denominator; val/perplexity = exp(val/loss); the family's derived metrics."""
    out = {f"val/{k}": a / b for (kind, k), (a, b) in sorted(sums.items()) if kind == "stat" and b > 0}
    if "val/loss" in out:
        out["val/perplexity"] = math.exp(min(out["val/loss"], 700.0))
    if family.derive_metrics is not None:
        totals = {k: a for (kind, k), (a, _) in sums.items() if kind == "total"}
        out.update({f"val/{k}": v for k, v in family.derive_metrics(totals).items()})
    return out


@torch.no_grad()
def evaluate(model, cfg: RunConfig, family: Family, batches: list, device, rank: int = 0, world: int = 1) -> dict:
    """The validation metrics of ``model`` (a bare module: the engine's ``module``) on ``batches``, rank ``rank`` of
    ``world`` evaluating batches rank, rank + world, ... (see the module docstring); every rank gets the result."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    sums: dict = {}
    try:
        for r in range(math.ceil(len(batches) / world)):
            j = r * world + rank
            stats, totals = family.validate(model, batches[j if j < len(batches) else rank % len(batches)].to(device),
                                            cfg)
            if j < len(batches):  # else a lockstep pass whose result is not counted
                _add(sums, stats, totals)
    finally:
        model.train(was_training)
    out = metrics_from_sums(reduce_sums(sums), family)
    out["val/seconds"] = time.perf_counter() - t0
    return out


def chance(batches: list) -> dict:
    """What a guess that ignores the input reaches on the validation set's supervised tokens
    (``pipeline.eval.plots.chance_levels``: the commonest target's frequency, the targets' entropy in nats)."""
    from pipeline.data.tokenizer import IGNORE_INDEX
    from pipeline.eval.plots import chance_levels

    return chance_levels(t for b in batches for t in b.labels[b.labels != IGNORE_INDEX].tolist())


def plot_history(history: list[dict], path: Path, train: list[tuple[int, float]] = (), chance: dict | None = None,
                 title: str = "validation") -> Path | None:
    """validation.png: the training loss and every val/loss* metric against the step (Eco-RNA: one line per K),
    beside val/accuracy* when logged, with the chance level (pipeline/eval/plots.py); None without a loss."""
    from pipeline.eval.plots import plot_validation

    return plot_validation(history, list(train), path, chance, title)
