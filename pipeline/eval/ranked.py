"""Ranked completions, scored exactly as the BabyLM 2025 evaluation pipeline's causal backend scores them
(``babylm/evaluation-pipeline-2025``, evaluation_pipeline/sentence_zero_shot: dataset.py ``process_causal_sentences``
and ``get_causal_collate_fn``, compute_results.py ``compute_causal_results`` and ``rank_and_evaluate``, run.py
``process_results``): BLiMP and its supplement, COMPS, EWoK, Entity Tracking and the wug tasks
(docs/evaluation.md, "BabyLM zero-shot tasks").

An item holds options; option j is a whole ``sentence`` and its ``completion``, a suffix of it. Per option:

1. the whole sentence goes through the model's tokenizer as a user calls it (``tokenizer(sentence,
   return_offsets_mapping=True)``: ``<s>`` first, the export's tokenizer.json);
2. the completion mask marks every token whose character span ends after the completion's first character
   (``end > len(sentence) - len(completion) + offsets[0][0]``; ``<s>`` has offsets (0, 0) and never counts);
3. the rows of a batch are right-padded with the tokenizer's pad id, the model reads ``tokens[:, :-1]`` with the
   attention mask, and the score is the sum over the masked targets ``tokens[:, 1:]`` of ``log_softmax(logits)``.

The pipeline forwards one option index at a time over a batch of items (all first options, then all second
options, ...); this module does the same with the same batch composition, so each forward sees the pipeline's shapes
and the logits are the same floats. The chosen option is the first of the highest scores (``torch.max`` /
``np.argmax``: a tie goes to the first option, which is the correct one in every task's files). Accuracy is counted
per value of every metadata key (``UID`` and, for BLiMP, ``field`` and ``linguistics_term``; for EWoK its context and
target contrasts), the average is the mean over the ``UID`` subsets (Entity Tracking: the mean over its three splits
of the mean over their subsets), and per-item predictions take the pipeline's predictions.json form
``{UID: {"predictions": [{"id": "UID_i", "pred": chosen completion (COMPS: sentence)}]}}``.

The model enters as ``logits_fn(input_ids [B, L], attention_mask [B, L] bool) -> logits [B, L, V]`` (the pipeline
module at a chosen depth, or a transformers model), the tokenizer as a transformers tokenizer with offsets.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class Item:
    """One example: options (sentence, completion), the correct one first (the pipeline's ``label`` is 0 in every
    task), ``uid`` (its subset), ``meta`` {aggregation key: value} (``UID`` included), ``ratio`` (wug tasks: the
    human ratio), ``where`` (file:line)."""

    sentences: tuple[str, ...]
    completions: tuple[str, ...]
    uid: str
    meta: dict = field(default_factory=dict)
    ratio: float | None = None
    where: str = ""
    label: int = 0


class DataError(ValueError):
    """A task file that does not fit its format: the message names the file, the line and the key."""


def read_jsonl(path: Path, decode: Callable[[dict, Path, str], Item], what: str) -> list[Item]:
    """Items of one JSONL file (``decode(record, file, where) -> Item``); a blank line is skipped, a line that is
    not a JSON object or lacks a key is one DataError naming file:line (and the key)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{where}: expected a JSON object ({what})")
            try:
                item = decode(rec, path, where)
            except KeyError as e:
                raise DataError(f"{where}: key {e.args[0]!r} missing ({what})") from None
            except (TypeError, ValueError, AttributeError) as e:
                raise DataError(f"{where}: {e} ({what})") from None
            for s, c in zip(item.sentences, item.completions):
                if not isinstance(s, str) or not isinstance(c, str) or not s.endswith(c):
                    raise DataError(f"{where}: the completion {c!r} is not the end of its sentence {s!r} ({what})")
            out.append(item)
    return out


def read_folder(path: Path, decode: Callable, what: str) -> list[Item]:
    """Every ``*.jsonl`` of a folder (sorted by name) or one file. The pipeline reads a folder in the order the
    file system lists it; predictions are numbered per UID, and every task's UID is one file's (or, for EWoK, one
    domain's, a file each in the BabyLM data), so the order of the files changes no prediction id."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path}: no *.jsonl files ({what})")
    items = [it for f in files for it in read_jsonl(f, decode, what)]
    if not items:
        raise DataError(f"{path}: no items ({what})")
    return items


def string(rec: dict, key: str) -> str:
    v = rec[key]
    if not isinstance(v, str):
        raise TypeError(f"key {key!r} is not a string")
    return v


# ---- scoring ---------------------------------------------------------------------------------------------------------
def encode(tokenizer, sentence: str, completion: str) -> tuple[list[int], list[int]]:
    """(token ids, completion mask) of one option, the pipeline's rule (module docstring, steps 1-2)."""
    out = tokenizer(sentence, return_offsets_mapping=True)
    ids, offsets = list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]
    start_char = len(sentence) - len(completion) + offsets[0][0]
    return ids, [1 if end > start_char else 0 for _, end in offsets]


def score_items(items: Sequence[Item], tokenizer, logits_fn: Callable, *, batch_size: int = 64,
                desc: str | None = None) -> np.ndarray:
    """Summed completion log-probabilities [n items, max options] (float64 of the float32 sums; NaN where an item
    has fewer options), in batches of ``batch_size`` items, one forward per option index (module docstring)."""
    import torch

    from pipeline.eval.cli import progress

    n_opt = max(len(it.sentences) for it in items)
    scores = np.full((len(items), n_opt), np.nan)
    encoded = [[encode(tokenizer, s, c) for s, c in zip(it.sentences, it.completions)] for it in items]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    starts = range(0, len(items), batch_size)
    if desc is not None:
        starts = progress(starts, desc=desc, unit="batch")
    for s in starts:
        rows = range(s, min(s + batch_size, len(items)))
        for j in range(n_opt):
            members = [i for i in rows if j < len(encoded[i])]
            if not members:
                continue
            seqs = [encoded[i][j] for i in members]
            L = max(len(ids) for ids, _ in seqs)
            tokens = torch.full((len(seqs), L), pad, dtype=torch.long)
            attn = torch.zeros(len(seqs), L, dtype=torch.long)
            phrase = torch.zeros(len(seqs), L, dtype=torch.long)
            for r, (ids, mask) in enumerate(seqs):
                tokens[r, :len(ids)] = torch.tensor(ids)
                attn[r, :len(ids)] = 1
                phrase[r, :len(ids)] = torch.tensor(mask)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            with torch.inference_mode():
                logits = logits_fn(inputs, attn[:, :-1].bool())
                logp = torch.log_softmax(logits, dim=-1)
                picked = torch.gather(logp, -1, targets.to(logp.device).unsqueeze(-1)).squeeze(-1)
                summed = torch.sum(picked * phrase[:, 1:].to(picked.device), dim=1).cpu()
            scores[members, j] = summed.double().numpy()
    return scores


def choose(scores: np.ndarray) -> np.ndarray:
    """The chosen option of each row: the first of its highest scores (a tie goes to the first option, as
    torch.max in the pipeline and argmax in lm-evaluation-harness). Rows with fewer options hold NaN at the end,
    which is never chosen."""
    filled = np.where(np.isnan(scores), -np.inf, scores)
    return np.argmax(filled, axis=1)


# ---- aggregation ------------------------------------------------------------------------------------------------------
ENTITY_TRACKING_SPLITS = ("regular", "ambiref", "move_contents")


def accuracy_report(items: Sequence[Item], chosen: np.ndarray, average: str = "uid") -> dict:
    """{"accuracy": {UID: fraction}, "by": {key: {value: fraction}} for the other metadata keys, "n": {UID: items},
    "average": fraction}. ``average``: "uid" (the mean over the UID subsets, the pipeline's default) or
    "entity_tracking" (per split the mean of its subsets, then the mean over the splits present; the split means
    also appear under "splits")."""
    correct = (np.asarray(chosen) == np.array([it.label for it in items]))
    counts: dict[str, dict[str, list[int]]] = {}
    for it, ok in zip(items, correct):
        for key, value in {"UID": it.uid, **it.meta}.items():
            c = counts.setdefault(key, {}).setdefault(str(value), [0, 0])
            c[0] += int(ok)
            c[1] += 1
    acc = {key: {v: c[0] / c[1] for v, c in sorted(vals.items())} for key, vals in counts.items()}
    uid = acc.pop("UID")
    out = {"accuracy": uid, "by": acc, "n": {v: c[1] for v, c in sorted(counts["UID"].items())},
           "n_items": len(items), "micro": float(correct.mean())}
    if average == "entity_tracking":
        splits = {}
        for split in ENTITY_TRACKING_SPLITS:
            keys = [k for k in uid if k.startswith(split)]
            if keys:
                splits[split] = float(np.mean([uid[k] for k in keys]))
        out["splits"] = splits
        out["average"] = float(np.mean(list(splits.values()))) if splits else float("nan")
    else:
        out["average"] = float(np.mean(list(uid.values())))
    return out


def spearman_report(items: Sequence[Item], scores: np.ndarray) -> dict:
    """The wug tasks: the model's probability of the first option (softmax over the options' summed
    log-probabilities) against the human ratio, Spearman's rho (scipy), and the per-item probabilities."""
    from scipy.stats import spearmanr

    s = scores - scores.max(axis=1, keepdims=True)
    probs = np.exp(s[:, 0]) / np.exp(s).sum(axis=1)
    ratios = np.array([it.ratio for it in items], dtype=np.float64)
    rho = spearmanr(probs, ratios)[0] if len(items) > 1 else float("nan")
    return {"spearman": float(rho), "n_items": len(items), "probs": probs.tolist()}


def predictions(items: Sequence[Item], chosen: np.ndarray, field_name: str = "completions",
                probs: Sequence[float] | None = None) -> dict:
    """The pipeline's predictions.json: {UID: {"predictions": [{"id": f"{UID}_{i}", "pred": ...}]}} in data order,
    ``pred`` the chosen option's completion (``field_name`` "sentences": its whole sentence, as for COMPS), with
    ``prob`` for the wug tasks."""
    out: dict[str, dict] = {}
    for k, (it, c) in enumerate(zip(items, chosen)):
        preds = out.setdefault(it.uid, {"predictions": []})["predictions"]
        rec = {"id": f"{it.uid}_{len(preds)}", "pred": getattr(it, field_name)[int(c)]}
        if probs is not None:
            rec["prob"] = float(probs[k])
        preds.append(rec)
    return out


# ---- the model and tokenizer of a trained run or export ------------------------------------------------------------------
def hf_tokenizer(trained, spm: Path | None = None):
    """The tokenizer a user of the model calls: an export's tokenizer.json (AutoTokenizer), else the run's
    sentencepiece model (``spm``, the export's tokenizer.model, or the one beside the training shards) converted
    the way the export converts it (pipeline/data/hf_tokenizers.py), so a checkpoint and its export score alike."""
    from pipeline.checkpoint import is_export
    from pipeline.data.hf_tokenizers import sentencepiece_tokenizer
    from pipeline.data.tokenizer import SPM_NAME
    from pipeline.objectives.causal_lm import spm_model_path

    tag = trained.tag_dir
    if spm is None and is_export(tag) and (tag / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        import pipeline.hf  # noqa: F401  (the export's model type known: AutoTokenizer runs none of its code)

        return AutoTokenizer.from_pretrained(str(tag))
    if spm is None and is_export(tag) and (tag / SPM_NAME).is_file():
        spm = tag / SPM_NAME
    spm = spm or spm_model_path(trained.cfg)
    if not Path(spm).is_file():
        raise FileNotFoundError(f"{spm}: sentencepiece model not found (pass --spm, or evaluate an export of "
                                "tools/convert_checkpoint.py, which holds its tokenizer)")
    return sentencepiece_tokenizer(Path(spm))


def model_logits_fn(model, depth: int | None):
    """``logits_fn`` of a pipeline causal LM (``model(ids, mask, depth)``) at ``depth`` (None: a standard stack's
    one depth), on the model's device."""
    import torch

    device = next(model.parameters()).device

    def logits_fn(ids, mask):
        with torch.inference_mode():
            return model(ids.to(device), mask.to(device), depth)

    return logits_fn


def spm_encode(trained, spm: Path | None = None) -> Callable[[str], list[int]]:
    """sentencepiece's encode of the run's model (``spm``, an export's tokenizer.model, else the one beside the
    training shards): the prefix methods of BLiMP and LAMBADA tokenize with it (no <s>; they add it)."""
    import sentencepiece

    from pipeline.checkpoint import is_export
    from pipeline.data.tokenizer import SPM_NAME
    from pipeline.objectives.causal_lm import spm_model_path

    if spm is None and is_export(trained.tag_dir) and (trained.tag_dir / SPM_NAME).is_file():
        spm = trained.tag_dir / SPM_NAME
    spm = spm or spm_model_path(trained.cfg)  # a path only: the training shards need not be on this machine
    if not Path(spm).is_file():
        raise FileNotFoundError(f"{spm}: sentencepiece model not found (pass --spm, or evaluate an export of "
                                "tools/convert_checkpoint.py, which holds its tokenizer)")
    return sentencepiece.SentencePieceProcessor(model_file=str(spm)).encode
