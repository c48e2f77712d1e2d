"""LAMBADA pass@k with gold-prefix scoring (paper 003, Sec. 3; Paperno et al., 2016), model-agnostic.

Each passage's target is its last whitespace-delimited word; the context is everything before it. The target word
is tokenized (``split_tokens``: the continuation of the context's tokenization) into t_1..t_m, and the passage
passes when *every* t_j ranks in the model's top k (k = 5) for the next token given <s> + context + t_1..t_{j-1}, the
true prefix (teacher forcing), not the model's own guesses. A token's rank counts only strictly more probable
tokens, so ties fall in the passage's favour. ``accuracy`` (k = 1) is reported beside pass@k.

The model enters only through ``logprobs_fn``: a callable mapping a list of id sequences to, for each sequence of n
ids, next-token log-probabilities [n, V] (:func:`pipeline.eval.blimp.iter_next_token_logprobs` builds it from a
causal LM). Input: plain text, one passage per line (blank lines skipped), or JSONL with a ``text`` field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from pipeline.data.tokenizer import SPM_BOS_ID
from pipeline.eval.benchmark import Benchmark
from pipeline.eval.blimp import split_tokens

LogprobsFn = Callable[[list[list[int]]], Sequence[np.ndarray]]


def read_passages(path) -> list[str]:
    """``.jsonl`` / ``.json`` lines with ``text``, anything else one passage per line."""
    path = Path(path)
    out = []
    jsonl = path.suffix in (".jsonl", ".json")
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if jsonl:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: invalid JSON ({e.msg})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise ValueError(f"{path}:{i}: expected an object with a string 'text' field")
                text = rec["text"]
            else:
                text = line.rstrip("\r\n")
            text = text.strip()
            if text:
                out.append(text)
    if not out:
        raise ValueError(f"{path}: no passages")
    return out


def split_passage(text: str) -> tuple[str, str]:
    """(context, final word): the last whitespace-delimited word; the context keeps no trailing space."""
    text = text.strip()
    cut = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t"))
    if cut < 0:
        raise ValueError(f"passage has no context before its final word: {text[:60]!r}")
    return text[:cut].rstrip(), text[cut + 1:]


def target_ranks(logp: np.ndarray, start: int, target: Sequence[int]) -> list[int]:
    """logp [n, V] for a sequence whose tokens start..start+m-1 are ``target``: 0-based rank of each target token
    in the distribution that predicts it (position p is predicted at p - 1)."""
    ranks = []
    for j, t in enumerate(target):
        row = logp[start + j - 1]
        ranks.append(int((row > row[t]).sum()))
    return ranks


def evaluate_lambada(passages: Sequence[str], encode: Callable[[str], list[int]], logprobs_fn: LogprobsFn, *,
                     k: int = 5, bos_id: int = SPM_BOS_ID) -> dict:
    """{"pass_at_k", "accuracy" (pass@1), "k", "n", "mean_target_tokens", "per_passage": [{rank_max, n_tokens}]}."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    seqs, spans = [], []
    for text in passages:
        context, word = split_passage(text)
        ctx, target = split_tokens(encode, context, word)
        seqs.append([bos_id] + ctx + target)
        spans.append((1 + len(ctx), target))
    per = []
    for logp, (start, target) in zip(logprobs_fn(seqs), spans):
        ranks = target_ranks(np.asarray(logp), start, target)
        per.append({"rank_max": max(ranks), "n_tokens": len(target)})
    worst = np.array([p["rank_max"] for p in per])
    return {"pass_at_k": float((worst < k).mean()), "accuracy": float((worst < 1).mean()), "k": k, "n": len(per),
            "mean_target_tokens": float(np.mean([p["n_tokens"] for p in per])), "per_passage": per}


def model_logprobs_fn(model, *, depth: int | None = None, batch_size: int = 16, device=None,
                      desc: str | None = None) -> LogprobsFn:
    """A causal LM (``model(ids, mask, depth=...) -> logits``) as a logprobs_fn; ``desc``: a progress bar."""
    from pipeline.eval.blimp import iter_next_token_logprobs

    return lambda seqs: iter_next_token_logprobs(model, seqs, depth=depth, batch_size=batch_size, device=device,
                                                 desc=desc)


def run(trained, data, runs, args) -> dict:
    """pass@5 and accuracy at every depth of ``runs`` (launchers/evaluate.py --task lambada)."""
    from pipeline.eval.ranked import spm_encode

    encode = spm_encode(trained, getattr(args, "spm", None))
    passages = read_passages(data)
    per_depth = {}
    for k, d in runs:
        res = evaluate_lambada(passages, encode, model_logprobs_fn(trained.model, depth=d, desc=f"lambada K={k}"), k=5)
        per_depth[str(k)] = {key: v for key, v in res.items() if key != "per_passage"}
    return {"passages": len(passages), "per_depth": per_depth, "columns": ("K", "pass@5", "accuracy"),
            "table": [(k, per_depth[str(k)]["pass_at_k"], per_depth[str(k)]["accuracy"]) for k, _ in runs]}


BENCHMARK = Benchmark(name="lambada", help="LAMBADA pass@5 with gold-prefix scoring (text or JSONL)",
                      scorer="teacher_forced", metrics=("pass@5", "accuracy"), run=run)
