"""Input corruption for masked language modelling (pure numpy, one sequence at a time; paper 000, A.2)."""
from __future__ import annotations

import numpy as np

from pipeline.data.tokenizer import IGNORE_INDEX  # noqa: F401 - re-exported


def target_count(n_eligible: int, select_prob: float) -> int:
    """q = max(1, min(floor(p_sel |U|), |U|)) for a non-empty row, 0 for an empty one."""
    return 0 if n_eligible == 0 else max(1, min(int(select_prob * n_eligible), n_eligible))


def select_tokens(n: int, q: int, rng: np.random.Generator) -> np.ndarray:
    """q unique indices of range(n), uniformly."""
    return np.sort(rng.choice(n, size=q, replace=False))


def select_spans(n: int, q: int, span_mean: float, rng: np.random.Generator) -> np.ndarray:
    """Union of random spans over range(n) until q unique indices are selected.

    Each span starts uniformly in [0, n) and has length max(1, floor(Y)), Y ~ Exp(mean span_mean), clipped at n.
    The span that crosses q contributes only its first new positions, so exactly q are returned.
    """
    chosen = np.zeros(n, dtype=bool)
    count = 0
    while count < q:
        start = int(rng.integers(0, n))
        length = max(1, int(rng.exponential(span_mean)))
        span = np.arange(start, min(n, start + length))
        new = span[~chosen[span]][: q - count]
        chosen[new] = True
        count += len(new)
    return np.flatnonzero(chosen)


def last_segment(tokens: np.ndarray, num_special: int, sep_id: int) -> np.ndarray:
    """Positions of the non-special tokens after the last <sep> (``kind: last_segment``: the answer of a
    question/answer record); a ValueError when the record has no <sep>."""
    seps = np.flatnonzero(tokens == sep_id)
    if seps.size == 0:
        raise ValueError(f"data.masking.kind last_segment: a record of {tokens.size} tokens has no <sep> (the "
                         "boundary before the answer); is this the task's data?")
    tail = np.arange(int(seps[-1]) + 1, tokens.size)
    return tail[tokens[tail] >= num_special]


def corrupt(tokens: np.ndarray, rng: np.random.Generator, *, kind: str, select_prob: float, span_mean: float,
            mask_prob: float, random_prob: float, mask_id: int, num_special: int, random_pool: np.ndarray,
            sep_id: int | None = None):
    """Select supervised positions among the non-special tokens U and corrupt them.

    Special tokens are never selected; ``kind: last_segment`` selects the tokens after the last <sep> (``sep_id``).
    Of the selected positions, ``mask_prob`` become <mask>, ``random_prob`` a token drawn from ``random_pool``, the
    rest keep their token; every selected position is supervised.
    Returns (inputs, labels): int64 [L], labels IGNORE_INDEX where unsupervised.
    """
    tokens = tokens.astype(np.int64)
    eligible = np.flatnonzero(tokens >= num_special)  # U, positions in the sequence
    labels = np.full_like(tokens, IGNORE_INDEX)
    inputs = tokens.copy()
    if kind == "last_segment":
        chosen = last_segment(tokens, num_special, sep_id)
        q = chosen.size
    else:
        q = target_count(eligible.size, select_prob)
        if q == 0:
            return inputs, labels
        picked = (select_spans(eligible.size, q, span_mean, rng) if kind == "span"
                  else select_tokens(eligible.size, q, rng))
        chosen = eligible[picked]  # spans are contiguous in U, which skips special tokens
    labels[chosen] = tokens[chosen]
    u = rng.random(q)
    inputs[chosen[u < mask_prob]] = mask_id
    to_random = chosen[(u >= mask_prob) & (u < mask_prob + random_prob)]
    inputs[to_random] = rng.choice(random_pool, size=to_random.size)
    return inputs, labels


def make_mlm_transform(context_length: int, masking, *, cls_id: int, eos_id: int, mask_id: int, num_special: int,
                       random_pool: np.ndarray, sep_id: int | None = None):
    """The masked LMs' sample transform: a record longer than ``context_length - 2`` is cropped to a uniformly random
    window of that many tokens, framed as <cls> window <eos>, then corrupted by ``masking`` (a MaskingConfig). All
    randomness comes from the sample's ``rng``. Returns (uint tokens, rng) -> {"input_ids", "labels"}."""
    body = context_length - 2

    def transform(tokens: np.ndarray, rng: np.random.Generator) -> dict:
        if len(tokens) > body and masking.kind == "last_segment":  # a crop could cut the question or the answer
            raise ValueError(f"data.masking.kind last_segment: a record of {len(tokens)} tokens does not fit "
                             f"data.context_length {context_length} (<cls> and <eos> included); raise it")
        if len(tokens) > body:
            start = int(rng.integers(0, len(tokens) - body + 1))
            tokens = tokens[start:start + body]
        framed = np.concatenate([[cls_id], tokens, [eos_id]])
        inputs, labels = corrupt(framed, rng, kind=masking.kind, select_prob=masking.select_prob,
                                 span_mean=masking.span_mean, mask_prob=masking.mask_prob,
                                 random_prob=masking.random_prob, mask_id=mask_id, num_special=num_special,
                                 random_pool=random_pool, sep_id=sep_id)
        return {"input_ids": inputs, "labels": labels}

    return transform
