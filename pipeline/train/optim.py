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
    named = [(n, p) for n, p in named if p.requires_grad]  # a frozen backbone (task.backbone: frozen) has no state
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


def make_optimizer(groups: list[dict], optim, device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW over ``groups``: the fused kernel (optim.fused; auto = on CUDA), else torch's default choice."""
    fused = optim.fused if optim.fused != "auto" else device.type == "cuda"
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                             **({"fused": True} if fused else {}))


def lean_overflow_check(zero_optimizer) -> bool:
    """Replace ZeRO-1/2's per-gradient overflow check by one foreach norm of all gradients; True if replaced.

    DeepSpeed checks bf16 gradients for inf/NaN before each update (bf16 ``check_grad_overflow``, on by default) and
    skips the update when one is found: the trainer relies on that skip (train.max_nonfinite_steps). Its check loops
    over the gradients with about 15 kernels each (amax, amin, isfinite, ...): 1,883 kernels and 49 ms of a 265 ms
    step on one H200 for the 80M model. ``torch._foreach_norm`` finds the same thing (a norm is finite exactly when
    every element is, short of a finite overflow of the sum of squares, which is no update worth taking either) in a
    few launches. The flag's all-reduce and the skip stay DeepSpeed's own (``has_overflow``)."""
    serial = getattr(zero_optimizer, "has_overflow_partitioned_grads_serial", None)
    if serial is None or not getattr(zero_optimizer, "check_grad_overflow", False) or getattr(
            zero_optimizer, "cpu_offload", False):
        return False

    def has_overflow_partitioned_grads_serial():
        grads = [g for i in range(len(zero_optimizer.bit16_groups)) for g in zero_optimizer.averaged_gradients[i]
                 if g is not None]
        if not grads:
            return torch.zeros(1, dtype=torch.bool)
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads)])
        return (~torch.isfinite(norms)).any().reshape(1)

    zero_optimizer.has_overflow_partitioned_grads_serial = has_overflow_partitioned_grads_serial
    return True
