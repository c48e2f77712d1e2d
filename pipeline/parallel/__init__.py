"""Execution paths that change where a model's parts run, never what they compute (torchtitan's ``parallelize``
beside ``model.py``): expert parallelism over DeepSpeed's expert groups (``expert_parallel``) and, on CUDA,
MegaBlocks' dMoE kernels (``megablocks``). The model files keep the math; ``UpcycledMoE.compute_experts`` is the one
method these paths replace.

This module imports neither DeepSpeed nor MegaBlocks (``megablocks.py`` imports MegaBlocks only when asked): the
engine calls ``check_parallelism`` before DeepSpeed starts, so a bad combination fails in a second with one line naming
the key.
"""
from __future__ import annotations

import torch

from pipeline.errors import ConfigError
from pipeline.parallel.groups import EP_KEY, check_expert_parallel, group_name  # noqa: F401 - re-exported

def resolve_moe_backend(model_cfg, dtype: torch.dtype | None = None, expert_parallel: bool = False) -> str:
    """``model.moe_backend`` -> 'torch' (the reference ``compute_experts``), 'grouped' (torch's grouped GEMM) or
    'megablocks', as ``pipeline/parallel/megablocks.py`` decides it (auto: MegaBlocks on CUDA when it imports and
    training runs in bf16, ``dtype``, else torch's grouped GEMM on CUDA in bf16); where the asked one cannot run, a
    ConfigError naming the key. Without MoE layers the backend is moot: 'torch'."""
    backend = getattr(model_cfg, "moe_backend", "torch")
    if backend == "torch" or not getattr(model_cfg, "moe_layers", None):
        return "torch"
    from pipeline.parallel import megablocks as mb  # importable on CPU: it imports megablocks only when asked

    try:
        return mb.resolve_moe_backend(backend, dtype, expert_parallel)
    except (mb.MegaBlocksUnavailable, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def check_parallelism(cfg, world_size: int, zero_stage: int, dtype: torch.dtype | None = None) -> str:
    """Everything about EP and the MoE backend that can be wrong, before DeepSpeed starts; returns the backend.
    ``dtype``: the training precision (torch.bfloat16 or torch.float32), when known."""
    ep = cfg.train.expert_parallel_size
    check_expert_parallel(cfg.model, ep, world_size, zero_stage)
    backend = resolve_moe_backend(cfg.model, dtype, expert_parallel=ep > 1)
    if backend in ("megablocks", "grouped") and ep > 1:
        # Both replace compute_experts: the grouped GEMM would have to run on the tokens the all-to-all delivers to
        # each rank's local experts. That combination is not built (apply_megablocks refuses an EP module).
        raise ConfigError(f"{EP_KEY}: {ep} with model.moe_backend {backend} is not supported; use "
                          "model.moe_backend: torch for expert parallelism, or expert_parallel_size 1")
    return backend


def parallelize(model: torch.nn.Module, cfg, zero_stage: int, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Apply the MoE backend, expert parallelism, kernels (pipeline/parallel/kernels.py) and activation checkpointing
    of ``cfg`` to ``model`` (weights loaded, optimizer not yet built). Needs ``deepspeed.comm`` initialized when ``train.expert_parallel_size`` > 1."""
    import torch.distributed as dist

    backend = check_parallelism(cfg, dist.get_world_size() if dist.is_initialized() else 1, zero_stage, dtype)
    if backend in ("megablocks", "grouped"):
        from pipeline.parallel.megablocks import apply_megablocks

        # in place: the same parameters and names, compute_experts on MegaBlocks' or torch's grouped GEMM
        apply_megablocks(model, "grouped_gemm" if backend == "megablocks" else "torch")
    if cfg.train.expert_parallel_size > 1:
        from pipeline.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, cfg.train.expert_parallel_size, zero_stage)
    from pipeline.families import get_family
    from pipeline.parallel.kernels import apply_kernels

    family = get_family(cfg.family)
    blocks = family.blocks
    apply_kernels(model, cfg, family.compiled or blocks)  # fused norms, compiled regions: before checkpointing
    if cfg.train.activation_checkpointing == "blocks":
        from pipeline.parallel.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, blocks)
    return model


def optimizer_groups(model: torch.nn.Module, param_groups: list[dict]) -> list[dict]:
    """``param_groups`` as DeepSpeed's MoE support needs them: unchanged without expert-parallel parameters, else
    with the experts split into ``moe`` groups (``expert_parallel.moe_param_groups``)."""
    if not any(getattr(p, "allreduce", True) is False for p in model.parameters()):
        return param_groups
    from pipeline.parallel.expert_parallel import moe_param_groups

    return moe_param_groups(param_groups)
