"""Helpers over torch.distributed that also run in a single process (no process group: the local value)."""
from __future__ import annotations

import torch.distributed as dist


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank (any picklable object); ``obj`` itself without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
