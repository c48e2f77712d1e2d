"""The optimizer's parameter groups and the learning-rate schedule (a factor of each group's peak lr, set by the
Trainer before every step: the factor may follow the words or samples consumed, which a step-counting torch
scheduler cannot see)."""
from __future__ import annotations

import math

import torch

from pipeline.config import ConfigError, RunConfig


def schedule_horizon(cfg: RunConfig, dataset_samples: int) -> dict:
    """What the cosine decays over, fixed at a run's first start and kept in its checkpoints.

    ``optim.schedule_steps`` if set; else the word budget (``train.max_words``) or the epoch budget
    (``train.max_epochs``, in samples) when one is set, so a budgeted run decays over its budget instead of sitting
    at peak lr until ``max_steps``; else ``train.max_steps``. Extending a resumed run (``--set train.max_steps=...``)
    does not re-stretch it: past the horizon the lr stays at the floor.
    """
    o, t = cfg.optim, cfg.train
    if o.schedule_steps:
        return {"unit": "steps", "total": o.schedule_steps}
    if t.max_words is not None:
        return {"unit": "words", "total": t.max_words}
    if t.max_epochs is not None:
        return {"unit": "samples", "total": t.max_epochs * dataset_samples}
    return {"unit": "steps", "total": t.max_steps}


def lr_factor(optim, horizon: dict, step: int, cumulative: dict) -> float:
    """lr / optim.lr at 0-based ``step``: linear warmup over optim.warmup_steps, then cosine to optim.min_lr_ratio
    over the horizon's progress (steps, or the words or samples consumed before this step)."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if horizon["unit"] == "steps":
        progress = (step - optim.warmup_steps) / max(1, horizon["total"] - optim.warmup_steps)
    else:
        progress = cumulative.get(horizon["unit"], 0.0) / max(1.0, horizon["total"])
    progress = min(1.0, max(0.0, progress))
    floor = optim.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_lambda(cfg: RunConfig):
    """The step-horizon schedule as a function of the 0-based step (optim.schedule_steps or train.max_steps)."""
    horizon = {"unit": "steps", "total": cfg.optim.schedule_steps or cfg.train.max_steps}
    return lambda step: lr_factor(cfg.optim, horizon, step, {})


def param_groups(model: torch.nn.Module, optim) -> list[dict]:
    """AdamW groups, each with a ``name`` (DeepSpeed's MoE group split needs one).

    Matrices are decayed; gains, biases, vectors and what the model names in ``no_weight_decay()`` (Eco-RNA's
    identity-initialized B and W_o, ProtLingo's memory tables) are not. A group the model names in ``lr_groups()``
    gets ``optim.lr * optim.lr_scale[group]``; an lr_scale for a group the model does not have is a ConfigError.
    """
    exempt = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    named_groups = model.lr_groups() if hasattr(model, "lr_groups") else {}
    scales = dict(optim.lr_scale or {})
    unknown = sorted(set(scales) - set(named_groups))
    if unknown:
        raise ConfigError(f"optim.lr_scale.{unknown[0]}: the model has no such parameter group "
                          f"(it has: {', '.join(sorted(named_groups)) or 'none'})")
    named = list(model.named_parameters())
    stray = sorted((exempt | set().union(*named_groups.values())) - {n for n, _ in named})
    if stray:
        raise ValueError(f"no_weight_decay / lr_groups name unknown parameters {stray[:3]}")
    group_of = {n: g for g, names in named_groups.items() for n in names}
    groups: dict[tuple, dict] = {}
    for n, p in named:
        decay = p.ndim >= 2 and n not in exempt
        lr_group = group_of.get(n) if group_of.get(n) in scales else None
        key = (lr_group or "", decay)
        if key not in groups:
            groups[key] = {"name": f"{lr_group + '_' if lr_group else ''}{'decay' if decay else 'no_decay'}",
                           "params": [], "weight_decay": optim.weight_decay if decay else 0.0,
                           "lr": optim.lr * (scales[lr_group] if lr_group else 1.0)}
        groups[key]["params"].append(p)
    return list(groups.values())
