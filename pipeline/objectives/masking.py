"""Input corruption for masked language modelling (pure numpy, one sequence at a time)."""
from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


def bert_mask(tokens: np.ndarray, rng: np.random.Generator, *, select_prob: float, mask_prob: float,
              random_prob: float, mask_id: int, num_special: int, random_pool: np.ndarray):
    """Select ``max(1, floor(select_prob * |U|))`` of the non-special positions U (none if U is empty).

    Of the selected positions, ``mask_prob`` become <mask>, ``random_prob`` a token drawn from ``random_pool``, the rest
    keep their token; every selected position is supervised. Returns (inputs, labels) as int64 [L] arrays, labels
    IGNORE_INDEX where unsupervised.
    """
    tokens = tokens.astype(np.int64)
    eligible = np.flatnonzero(tokens >= num_special)
    labels = np.full_like(tokens, IGNORE_INDEX)
    inputs = tokens.copy()
    if eligible.size == 0:
        return inputs, labels
    n = min(max(1, int(select_prob * eligible.size)), eligible.size)
    chosen = rng.choice(eligible, size=n, replace=False)
    labels[chosen] = tokens[chosen]
    u = rng.random(n)
    to_mask = chosen[u < mask_prob]
    to_random = chosen[(u >= mask_prob) & (u < mask_prob + random_prob)]
    inputs[to_mask] = mask_id
    inputs[to_random] = rng.choice(random_pool, size=to_random.size)
    return inputs, labels
