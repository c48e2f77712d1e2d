"""BLiMP-style minimal-pair evaluation (paper 003, Sec. 3; Warstadt et al., 2020), model-agnostic.

A pair is correct when the model gives the good item a summed log-probability at least as high as the bad one's: a
tie goes to the first option, the good sentence, as the BabyLM 2025 pipeline (torch.max) and lm-evaluation-harness
(argmax) decide it. Three comparisons, as in the BLiMP release (each record says which it supports):

* ``full`` (``simple_LM_method``): log P(sentence_good) vs log P(sentence_bad), whole sentences after <s>;
* ``one_prefix``: log P(one_prefix_word_good | one_prefix_prefix) vs log P(one_prefix_word_bad | same prefix);
* ``two_prefix``: log P(two_prefix_word | two_prefix_prefix_good) vs log P(two_prefix_word | two_prefix_prefix_bad).

The model enters only through ``score_fn``: a callable mapping a list of ``(context, continuation)`` string pairs to
the summed log-probability of each continuation given its context (context "" = start of text). Adapters build one
from a whole-text scorer ``logprob_fn(list[str]) -> list[float]`` (:func:`from_text_logprob`) or from a causal LM
and a sentencepiece processor (:func:`model_score_fn`). Accuracy is reported per phenomenon (``UID``) and as the
macro average over phenomena, and per ``field`` and ``linguistics_term``.

Phenomena are named as the BabyLM pipeline names them (read_files.py ``decode_blimp``): a record with ``field`` by its
``UID``; one without (the BLiMP supplement's files) by its file's name, its field and term "supplement". The ``full``
method is scored by pipeline/eval/ranked.py, the pipeline's causal backend (the whole sentence through the model's
tokenizer after ``<s>``); the prefix methods, which the pipeline does not have, by :func:`model_score_fn`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from pipeline.data.tokenizer import SPM_BOS_ID
from pipeline.eval.benchmark import Benchmark

METHODS = ("full", "one_prefix", "two_prefix")
ScoreFn = Callable[[list[tuple[str, str]]], list[float]]

_FIELDS = {
    "full": ("simple_LM_method", ("sentence_good", "sentence_bad")),
    "one_prefix": ("one_prefix_method", ("one_prefix_prefix", "one_prefix_word_good", "one_prefix_word_bad")),
    "two_prefix": ("two_prefix_method", ("two_prefix_prefix_good", "two_prefix_prefix_bad", "two_prefix_word")),
}


@dataclass(frozen=True)
class MinimalPair:
    uid: str  # phenomenon
    field: str  # morphology / syntax / semantics / ... ("supplement" for the supplement's files)
    good: tuple[str, str]  # (context, continuation) scored for the good item
    bad: tuple[str, str]
    where: str  # file:line, for messages
    term: str = ""  # linguistics_term


def phenomenon(rec: dict, where: str) -> tuple[str, str, str]:
    """(UID, field, linguistics_term) of a record as the BabyLM pipeline names them: a record with ``field`` by
    its fields, one without by its file's name (the supplement)."""
    if "field" not in rec:
        return Path(where.rsplit(":", 1)[0]).stem, "supplement", "supplement"
    if not isinstance(rec.get("UID"), str):
        raise ValueError(f"{where}: field 'UID' missing or not a string (a record with 'field' is named by its UID)")
    field = str(rec["field"])
    return rec["UID"], "syntax/semantics" if field == "syntax_semantics" else field, str(rec.get("linguistics_term", ""))


def read_records(path) -> list[tuple[str, dict]]:
    """A BLiMP JSONL file, or a directory of them (sorted) -> [(file:line, record)]."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no *.jsonl files")
    out = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f}:{i}: invalid JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{f}:{i}: expected a JSON object")
                out.append((f"{f}:{i}", rec))
    return out


def make_pairs(records: Sequence[tuple[str, dict]], method: str = "full") -> list[MinimalPair]:
    """Records -> pairs for ``method``; records whose ``<method>_method`` flag is false are skipped (a missing flag
    counts as supported when the fields are present). A supported record missing a field is an error.
    :func:`select_pairs` also says what was skipped."""
    return select_pairs(records, method)[0]


SKIP_FLAG_FALSE = "flag_false"  # the record sets <method>_method: false (BLiMP: the method does not apply)
SKIP_NO_FIELDS = "no_fields"  # neither the flag nor the method's fields are in the record


def select_pairs(records: Sequence[tuple[str, dict]], method: str = "full") -> tuple[list[MinimalPair], dict]:
    """(pairs for ``method``, what was skipped): ``{"method", "records": n skipped, "paradigms": n skipped whole,
    "of_paradigms": n seen, "per_paradigm": {uid: {"records": skipped, "of": total, "reason": {reason: n}}}}`` with
    reasons :data:`SKIP_FLAG_FALSE` and :data:`SKIP_NO_FIELDS`; a paradigm appears there only when some of its
    records were skipped. BLiMP's one_prefix and two_prefix methods apply to some paradigms only, so skipping is
    expected with them; it is reported, never silent (:func:`describe_skipped`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    flag, fields = _FIELDS[method]
    pairs = []
    totals: dict[str, int] = {}
    skipped: dict[str, dict] = {}

    def skip(uid: str, reason: str):
        d = skipped.setdefault(uid, {"records": 0, "reason": {}})
        d["records"] += 1
        d["reason"][reason] = d["reason"].get(reason, 0) + 1

    for where, rec in records:
        uid, field, term = phenomenon(rec, where)
        totals[uid] = totals.get(uid, 0) + 1
        if rec.get(flag) is False:
            skip(uid, SKIP_FLAG_FALSE)
            continue
        missing = [k for k in fields if not isinstance(rec.get(k), str)]
        if missing:
            if flag not in rec and method != "full":
                skip(uid, SKIP_NO_FIELDS)  # a file without the prefix variants at all
                continue
            raise ValueError(f"{where}: field {missing[0]!r} missing or not a string (method {method})")
        if method == "full":
            good, bad = ("", rec["sentence_good"]), ("", rec["sentence_bad"])
        elif method == "one_prefix":
            good = (rec["one_prefix_prefix"], rec["one_prefix_word_good"])
            bad = (rec["one_prefix_prefix"], rec["one_prefix_word_bad"])
        else:
            good = (rec["two_prefix_prefix_good"], rec["two_prefix_word"])
            bad = (rec["two_prefix_prefix_bad"], rec["two_prefix_word"])
        pairs.append(MinimalPair(uid, field, good, bad, where, term))
    for uid, d in skipped.items():
        d["of"] = totals[uid]
    report = {"method": method, "records": sum(d["records"] for d in skipped.values()),
              "paradigms": sum(d["records"] == d["of"] for d in skipped.values()), "of_paradigms": len(totals),
              "per_paradigm": dict(sorted(skipped.items()))}
    return pairs, report


def describe_skipped(report: dict) -> str:
    """One line from :func:`select_pairs`' report: how many paradigms and records were skipped, which, and why."""
    method = report["method"]
    flag = _FIELDS[method][0]
    per = report["per_paradigm"]
    whole = [u for u, d in per.items() if d["records"] == d["of"]]
    part = [f"{u} ({d['records']} of {d['of']})" for u, d in per.items() if d["records"] < d["of"]]
    reasons: dict[str, int] = {}
    for d in per.values():
        for r, n in d["reason"].items():
            reasons[r] = reasons.get(r, 0) + n
    why = {SKIP_FLAG_FALSE: f"{flag} is false", SKIP_NO_FIELDS: f"neither {flag} nor its fields"}
    text = (f"skipped: --blimp-method {method} skips {report['paradigms']} of {report['of_paradigms']} paradigms, "
            f"{report['records']} records")
    if whole:
        text += f": {', '.join(whole)}"
    if part:
        text += f"; partly: {', '.join(part)}"
    return text + " (" + "; ".join(f"{n} records: {why[r]}" for r, n in sorted(reasons.items())) + ")"


def evaluate_pairs(pairs: Sequence[MinimalPair], score_fn: ScoreFn | None = None,
                   scores: np.ndarray | None = None) -> dict:
    """Score every item once (``score_fn``, or ``scores`` [n_pairs, 2] already computed: good, bad) and aggregate:
    {"per_phenomenon": {uid: {accuracy, n, field}}, "macro_accuracy", "micro_accuracy", "n_pairs", "by": {"field":
    {...}, "linguistics_term": {...}}, "scores", "predictions"} with the BabyLM pipeline's predictions.json form
    (:func:`pipeline.eval.ranked.predictions`: the chosen sentence, or continuation for the prefix methods). A tie
    goes to the good sentence (module docstring)."""
    from pipeline.eval.ranked import choose

    if not pairs:
        raise ValueError("no minimal pairs to evaluate")
    if scores is None:
        items = [x for p in pairs for x in (p.good, p.bad)]
        flat = np.asarray(score_fn(items), dtype=np.float64)
        if flat.shape != (len(items),):
            raise ValueError(f"score_fn returned {flat.shape} scores for {len(items)} items")
        scores = flat.reshape(len(pairs), 2)
    chosen = choose(np.asarray(scores, dtype=np.float64))
    correct = chosen == 0  # [n_pairs]
    per: dict[str, dict] = {}
    by: dict[str, dict[str, list[int]]] = {"field": {}, "linguistics_term": {}}
    preds: dict[str, dict] = {}
    for p, ok, c in zip(pairs, correct, chosen):
        d = per.setdefault(p.uid, {"correct": 0, "n": 0, "field": p.field})
        d["correct"] += int(ok)
        d["n"] += 1
        for key, value in (("field", p.field), ("linguistics_term", p.term)):
            cnt = by[key].setdefault(value, [0, 0])
            cnt[0] += int(ok)
            cnt[1] += 1
        out = preds.setdefault(p.uid, {"predictions": []})["predictions"]
        out.append({"id": f"{p.uid}_{len(out)}", "pred": (p.good, p.bad)[int(c)][1]})
    for d in per.values():
        d["accuracy"] = d["correct"] / d["n"]
    return {"per_phenomenon": dict(sorted(per.items())),
            "macro_accuracy": float(np.mean([d["accuracy"] for d in per.values()])),
            "micro_accuracy": float(correct.mean()), "n_pairs": len(pairs),
            "by": {k: {v: c[0] / c[1] for v, c in sorted(vals.items())} for k, vals in by.items()},
            "scores": np.asarray(scores).tolist(), "chosen": chosen.tolist(), "predictions": preds}


def ranked_items(pairs: Sequence[MinimalPair]) -> list:
    """The ``full`` pairs as ranked-completion items (pipeline/eval/ranked.py): options (good, bad), each scored
    whole."""
    from pipeline.eval.ranked import Item

    out = []
    for p in pairs:
        if p.good[0] or p.bad[0]:
            raise ValueError(f"{p.where}: a prefix pair is not a whole-sentence item")
        out.append(Item((p.good[1], p.bad[1]), (p.good[1], p.bad[1]), p.uid, where=p.where))
    return out


def evaluate_blimp(path, score_fn: ScoreFn, method: str = "full") -> dict:
    """Read ``path`` (file or directory), build the ``method`` pairs, evaluate."""
    out = evaluate_pairs(make_pairs(read_records(path), method), score_fn)
    out["method"] = method
    return out


# ------------------------------------------------------------------------------------------------------------------
# Adapters: ways to obtain a score_fn
# ------------------------------------------------------------------------------------------------------------------
def join(context: str, continuation: str) -> str:
    """The text a (context, continuation) pair stands for: one space between words unless either side has it."""
    if not context or continuation[:1].isspace() or context[-1:].isspace():
        return context + continuation
    return context + " " + continuation


def from_text_logprob(logprob_fn: Callable[[list[str]], list[float]]) -> ScoreFn:
    """Whole-text log P(text) -> conditional scores by the chain rule: log P(c | x) = log P(x c) - log P(x)."""

    def score(items: list[tuple[str, str]]) -> list[float]:
        contexts = sorted({c for c, _ in items if c})
        full = logprob_fn([join(c, w) for c, w in items])
        ctx = dict(zip(contexts, logprob_fn(contexts))) if contexts else {}
        return [f - (ctx[c] if c else 0.0) for f, (c, _) in zip(full, items)]

    return score


def split_tokens(encode: Callable[[str], list[int]], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) such that their concatenation is the tokenization of the joined text when
    the context's tokens are a prefix of it (the usual case at a word boundary); otherwise the two parts are
    tokenized separately, so the continuation is always scored in full."""
    ctx = list(encode(context)) if context else []
    full = list(encode(join(context, continuation)))
    if full[:len(ctx)] == ctx and len(full) > len(ctx):
        return ctx, full[len(ctx):]
    return ctx, list(encode(continuation))


def iter_next_token_logprobs(model, sequences: Sequence[Sequence[int]], *, depth: int | None = None,
                             batch_size: int = 16, device=None, desc: str | None = None) -> Iterator[np.ndarray]:
    """For each sequence of n ids, log-probabilities [n, V] (fp32) of the next token at every position; rows are
    right-padded into batches with an attention mask (a causal model's real positions never see the padding).
    With ``desc``, a progress bar over the batches on stderr (pipeline.eval.cli.progress)."""
    import torch

    device = device or next(model.parameters()).device
    starts = range(0, len(sequences), batch_size)
    if desc is not None:
        from pipeline.eval.cli import progress

        starts = progress(starts, desc=desc, unit="batch")
    for s in starts:
        chunk = sequences[s:s + batch_size]
        L = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        mask = torch.zeros(len(chunk), L, dtype=torch.bool)
        for i, x in enumerate(chunk):
            ids[i, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
            mask[i, :len(x)] = True
        with torch.no_grad():
            kw = {} if depth is None else {"depth": depth}
            logits = model(ids.to(device), mask.to(device), **kw)  # [b, L, V]
            logp = torch.log_softmax(logits.float(), -1).cpu()
        for i, x in enumerate(chunk):
            yield logp[i, :len(x)].numpy()


def model_score_fn(model, encode: Callable[[str], list[int]], *, bos_id: int = SPM_BOS_ID, depth: int | None = None,
                   batch_size: int = 16, device=None, desc: str | None = None) -> ScoreFn:
    """A causal LM (``model(ids [B, L], mask [B, L], depth=...) -> logits [B, L, V]``) and a tokenizer -> score_fn.
    Every sequence starts with <s>; the continuation's tokens are summed given <s> + context. ``desc``: a progress
    bar over the batches."""

    def score(items: list[tuple[str, str]]) -> list[float]:
        seqs, spans = [], []
        for c, w in items:
            ctx, cont = split_tokens(encode, c, w)
            seqs.append([bos_id] + ctx + cont)
            spans.append((1 + len(ctx), cont))
        out = []
        for logp, (start, cont) in zip(iter_next_token_logprobs(model, seqs, depth=depth, batch_size=batch_size,
                                                                device=device, desc=desc), spans):
            # token at position p is predicted at position p - 1
            out.append(float(sum(logp[start + j - 1, t] for j, t in enumerate(cont))))
        return out

    return score


# ------------------------------------------------------------------------------------------------------------------
# The benchmark (pipeline/eval/benchmarks.py): launchers/evaluate.py --task blimp
# ------------------------------------------------------------------------------------------------------------------
def add_options(p):
    p.add_argument("--blimp-method", default="full", choices=METHODS,
                   help="blimp: score whole sentences (full, default: the BabyLM pipeline's scoring) or the word "
                        "after a shared prefix (pipeline/eval/blimp.py)")


def run(trained, data, runs, args) -> dict:
    """BLiMP (or its supplement) at every depth of ``runs``: the full method through pipeline/eval/ranked.py, the
    prefix methods through :func:`model_score_fn` on sentencepiece ids."""
    from pipeline.eval.ranked import hf_tokenizer, model_logits_fn, score_items, spm_encode

    method = getattr(args, "blimp_method", "full")
    records = read_records(data)
    pairs, skipped = select_pairs(records, method)
    if not pairs:
        raise ValueError(f"{data}: no record supports --blimp-method {method} ({describe_skipped(skipped)})")
    per_depth = {}
    if method == "full":
        items, tok = ranked_items(pairs), hf_tokenizer(trained, getattr(args, "spm", None))
        for k, d in runs:
            scores = score_items(items, tok, model_logits_fn(trained.model, d),
                                 batch_size=getattr(args, "batch_size", None) or 64, desc=f"blimp K={k}")
            per_depth[str(k)] = evaluate_pairs(pairs, scores=scores)
    else:
        encode = spm_encode(trained, getattr(args, "spm", None))
        for k, d in runs:
            per_depth[str(k)] = evaluate_pairs(pairs, model_score_fn(trained.model, encode, depth=d,
                                                                     desc=f"blimp K={k}"))
    uids = sorted(next(iter(per_depth.values()))["per_phenomenon"])
    acc = lambda k, u: per_depth[str(k)]["per_phenomenon"][u]["accuracy"]  # noqa: E731
    return {"method": method, "n_pairs": len(pairs), "n_records": len(records), "skipped": skipped,
            "skipped_line": describe_skipped(skipped) if skipped["records"] else None,
            "per_depth": per_depth, "scorer": "minimal_pairs",
            "table": [(k, per_depth[str(k)]["macro_accuracy"], *(acc(k, u) for u in uids)) for k, _ in runs],
            "columns": ("K", "macro_accuracy", *uids)}


BENCHMARK = Benchmark(name="blimp", help="BLiMP minimal pairs or the BLiMP supplement (a folder of JSONL files): "
                      "accuracy per phenomenon and the macro average", scorer="minimal_pairs",
                      metrics=("macro_accuracy",), run=run,
                      folders=("blimp_filtered", "supplement_filtered", "blimp_fast", "supplement_fast"),
                      options=add_options, prediction="sentences")
