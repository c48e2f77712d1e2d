"""Kernel choices applied to a built model from outside, keeping its parameters, names and state dict:

- ``train.fused_norm``: every RMSNorm as one fused operator each way (pipeline/models/norm_op.py), or the plain
  autograd formula;
- ``train.compile: blocks``: each transformer block (the classes its family lists in ``Family.compiled``, else
  ``Family.blocks``) runs through ``torch.compile``, which fuses the elementwise work around the GEMMs (RoPE,
  QK-norm, RMSNorm, SwiGLU, residual adds) into a few kernels. Shapes are dynamic: the wavefront's core calls change their row count at every step, and a block
  compiled per shape would recompile at each. Recompiles are bounded (``RECOMPILE_LIMIT`` graphs per block; beyond
  that torch runs the block eagerly) and counted by :func:`compiled_graphs`;
- ``train.cuda_graphs``: the compiled blocks in torch.compile's "reduce-overhead" mode, which records a CUDA graph
  per shape and replays it (one launch for a block's kernels).
"""
from __future__ import annotations

import torch

from pipeline.errors import ConfigError
from pipeline.models.layers import set_fused_norms

COMPILE_MODES = ("none", "blocks")
# Graphs one block's forward may compile (grad and no-grad modes, a few distinct ranks of dynamic dims): more means
# shapes are specializing, which the counter shows, and torch falls back to eager for the rest instead of stalling.
RECOMPILE_LIMIT = 8


def apply_kernels(model: torch.nn.Module, cfg, block_types: tuple) -> torch.nn.Module:
    """Apply train.fused_norm and train.compile to ``model`` in place; returns it."""
    set_fused_norms(model, cfg.train.fused_norm)
    if cfg.train.compile == "blocks":
        compile_blocks(model, block_types, "reduce-overhead" if cfg.train.cuda_graphs else None)
    return model


def compile_blocks(model: torch.nn.Module, block_types: tuple, mode: str | None = None) -> int:
    """Each module of ``block_types`` runs its forward through torch.compile (dynamic shapes, torch.compile's
    ``mode``); returns the count."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
    n = 0
    for module in model.modules():
        if block_types and isinstance(module, block_types):
            module.forward = torch.compile(module.forward, dynamic=True, mode=mode)
            n += 1
    if not n:
        raise ConfigError("train.compile: blocks, but the model has no module its family declares "
                          "(Family.compiled or Family.blocks)")
    return n


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (first compiles and recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
