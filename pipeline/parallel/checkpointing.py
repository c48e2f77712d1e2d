"""Activation checkpointing (``train.activation_checkpointing: blocks``): every transformer block of the model (the
classes its family lists in ``Family.blocks``) keeps only its inputs in the forward pass and recomputes its
activations in backward (``torch.utils.checkpoint``, non-reentrant). Memory then holds one block's activations at a
time plus each block's input, for one more forward of every block.

Applied from outside the model, like the other execution paths here: each block's ``forward`` is wrapped on the
instance, so parameter names, the state dict and checkpoints are unchanged. For Eco-RNA a block of the shared core
is recomputed at each of its applications inside the backward window; applications outside the window (truncated
backprop) and evaluation run under no_grad, where nothing is saved and the wrapper steps aside. Randomness in a
block (dropout) is replayed: torch saves and restores the RNG state.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from pipeline.errors import ConfigError

MODES = ("none", "blocks")


def apply_activation_checkpointing(model: torch.nn.Module, block_types: tuple) -> int:
    """Wrap the forward of every module of ``block_types`` in ``model``; returns how many were wrapped."""
    n = 0
    for module in model.modules():
        if block_types and isinstance(module, block_types):
            module.forward = _recomputed(module.forward)
            n += 1
    if not n:
        raise ConfigError("train.activation_checkpointing: blocks, but the model has no transformer block its family "
                          "declares (Family.blocks)")
    return n


def _recomputed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # no backward will come: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run
