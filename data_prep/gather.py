"""Byte ranges of one buffer joined into one array (the cluster join's tokens: data_prep/join.py,
data_prep/cluster_write.py)."""
from __future__ import annotations

import numpy as np


def gather(data: np.ndarray, starts: np.ndarray, sizes: np.ndarray, group: int = 8192) -> np.ndarray:
    """data[starts[0]:starts[0]+sizes[0]] + data[starts[1]:...] + ...: joins of views, ``group`` rows at a time (a
    fancy index would take 8 bytes per byte, one view per row 200 bytes per row)."""
    total = int(sizes.sum())
    out = np.empty(total, np.uint8)
    if total == 0:
        return out
    view, at = memoryview(data), 0
    starts, sizes = starts.tolist(), sizes.tolist()
    for i in range(0, len(sizes), group):
        part = b"".join([view[a:a + n] for a, n in zip(starts[i:i + group], sizes[i:i + group])])
        out[at:at + len(part)] = np.frombuffer(part, np.uint8)
        at += len(part)
    return out
