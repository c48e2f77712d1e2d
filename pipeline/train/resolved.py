"""What a training runs with, as resolved on its machine: the layout, attention kernel, norm, MoE backend, compile
mode, microbatch and the memory model's prediction. Printed by rank 0 among a training's first lines as one
``resolved: key=value ...`` line (bench/gpu_report.py reads it) and logged as MLflow params ``resolved.<key>``, so
that a run says what it ran, not only what its config asked for (``auto`` settings differ by device)."""
from __future__ import annotations

import torch

from pipeline.train.memory import step_memory


def resolved_settings(model, cfg, plan, device) -> dict:
    """{name: value without spaces} for ``model`` (the engine's module) on ``device``; ``plan`` the RunPlan."""
    probe = torch.empty(0, device=device, dtype=plan.dtype)
    out = dict(plan.family.execution(model, cfg, probe))
    t = cfg.train
    out["norm"] = "fused" if t.fused_norm else "plain"
    out["moe"] = plan.moe_backend if getattr(cfg.model, "moe_layers", None) else "none"
    out["compile"] = t.compile
    out["cuda_graphs"] = str(bool(t.cuda_graphs)).lower()
    out["precision"] = "bf16" if plan.dtype == torch.bfloat16 else "fp32"
    out["zero_stage"] = plan.zero_stage
    tokens = t.max_tokens_per_microbatch or t.micro_batch_size * cfg.data.context_length
    out["microbatch"] = (f"{tokens}-tokens{'-auto' if plan.microbatch else ''}" if t.max_tokens_per_microbatch
                         else f"{t.micro_batch_size}-rows")
    out["grad_accum_steps"] = t.grad_accum_steps
    memory = step_memory(cfg, plan.family, zero_stage=plan.zero_stage, world=plan.world_size,
                         bf16=plan.dtype == torch.bfloat16, ds_config=plan.ds_config)
    out["memory_model_gib"] = f"{memory.peak(tokens) / 2 ** 30:.2f}"
    return out


def line(settings: dict) -> str:
    return "resolved: " + " ".join(f"{k}={v}" for k, v in settings.items())
