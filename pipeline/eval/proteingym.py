"""ProteinGym zero-shot substitution benchmark: masked marginals of a masked protein LM, model-agnostic.

The model enters only through ``logits_fn(tokens: LongTensor [B, L], attention_mask: BoolTensor [B, L]) ->
FloatTensor [B, L, 33]``: logits over the ESM-2 alphabet of :mod:`pipeline.data.protein_tokenizer` (ids equal to
Hugging Face ``EsmTokenizer``: ``<cls>`` 0, ``<pad>`` 1, ``<eos>`` 2, ``<mask>`` 32). Our ESM2/ProtLingo models,
``transformers.EsmForMaskedLM`` or a hand-written function all fit; everything else here is torch-free bookkeeping
plus one batched call site.

Scoring (the official ProteinGym ESM script, ``proteingym/baselines/esm/compute_fitness.py``,
``--scoring-strategy masked-marginals``, ProteinGym @ bb685245):

* The wild type is framed as ``<cls> WT <eos>`` (ESM-2's batch converter: prepend_bos, append_eos). For every
  position ``i`` of the framed sequence the script masks token ``i``, runs the model, takes ``log_softmax`` over the
  vocabulary and keeps the row at ``i``: ``lp[i, :]``. Only residue positions enter a score, so we mask only the
  residue positions some mutant of the assay touches; the numbers are the same, the passes fewer.
* Mutant strings are 1-based (``--offset-idx`` 1; ``DMS_substitutions.csv`` has no ``start_idx`` column, so every
  assay uses offset 1). A residue at 1-based position ``p`` sits at framed index ``p`` (``1 + (p - offset)``, the
  script's "add 1 for BOS").
* ``label_row``: a mutant ``A1P:D2N`` (substitutions joined by ``:``) scores
  ``sum over its substitutions of lp[p, mt] - lp[p, wt]``, every term from the pass that masked ``p`` alone in the
  *wild-type* context (the other substitutions of the mutant are not applied).
* Sequences longer than the model window (1024 tokens, ``<cls>``/``<eos>`` included: ``seq_len_wo_special`` is
  passed ``len(WT) + 2``) use ``--scoring-window optimal``: the masked framed sequence is cut to the window
  ``get_optimal_window(i, len(WT) + 2, 1024)`` (``proteingym/utils/scoring_utils.py``, reproduced in
  :func:`optimal_window`) centred on the *masked position* ``i``, clipped to the sequence, and ``lp[i]`` is read at
  ``i - start``. The window is a plain slice of the framed tokens: a window in the middle of a long protein holds
  neither ``<cls>`` nor ``<eos>``, as in the script. The window belongs to each masked position, not to a mutant:
  the two substitutions of a double mutant far apart are each read from the window centred on their own position.
  (Tranception's ``get_sequence_slices`` picks one window per mutant at the barycentre of its positions; that is
  Tranception's autoregressive scoring, not ESM's masked marginals, and is not used here.)
* Batching: the masked copies are batched, ``batch_size`` per call, with copies of one length per batch (all copies
  have one length unless an odd window makes the middle windows one shorter), so nothing is ever padded and the
  attention mask is all True: a model that ignores the mask gets the same numbers as one that honours it. Each
  (wild type, window size, position) is computed once per :func:`evaluate_assays` call, so assays that share a
  wild type share their passes.

Inputs. An assay CSV (ProteinGym ``DMS_ProteinGym_substitutions/<DMS_id>.csv``) needs ``mutant``, ``DMS_score``
and ``DMS_score_bin`` (0/1); ``mutated_sequence`` is checked when present (it must be the wild type with the
mutant applied). The wild type is the reference file's ``target_seq`` (upper-cased, as the script does) when a
``DMS_substitutions.csv`` is given; without one it is reconstructed from the assay: every row's
``mutated_sequence`` with its substituted positions put back to the mutant's ``wt`` letters, and all rows must give
the same sequence. Every mutant is validated before any model call: a malformed string, a position outside
``1..len(WT)``, a ``wt`` letter that is not the wild type's, a target letter outside the 20 standard amino acids
(ProteinGym's ``AA_vocab``) or a position repeated within a mutant is a ValueError naming the file, line and mutant;
a bad reference row names the file and line. After scoring, a mutant whose score is not finite (the model produced
NaN/inf at one of its positions) is an error naming it: every mutant is scored or the run fails.

Metrics per assay, as ``proteingym/performance_DMS_benchmarks.py`` computes them:

* Spearman: ``spearmanr(DMS_score, score)``;
* AUC: ``roc_auc_score(y_true=DMS_score_bin, y_score=score)``, the raw AUC, not folded (a model that ranks fitness
  upside down gets AUC < 0.5, as on the leaderboard); NaN when ``DMS_score_bin`` has one class (the script's
  ``except`` branch);
* MCC: ``matthews_corrcoef(DMS_score_bin, score >= median(score))`` (the score binarised at its own median,
  ties going to 1).

Aggregates over several assays. :func:`aggregate` is the plain mean over assays, with the number of assays ``n``
and NaN metrics left out and counted. :func:`leaderboard_aggregate` is the leaderboard's number
(``proteingym/performance_DMS_benchmarks.py`` @ bb685245), from the reference file's ``UniProt_ID`` and
``coarse_selection_type`` columns: each assay's metric rounded to 3 decimals (the DMS-level table's ``round(3)``),
averaged within each (UniProt ID, selection type) pair, then within each selection type, then over the types; NaN
left out at every level (pandas' mean). A protein measured by several assays counts once per type, and each type
counts equally however many proteins it holds. :func:`efficiency` is paper 002's Table 1 ratio.
"""
from __future__ import annotations

import csv
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
from scipy.stats import ConstantInputWarning, spearmanr
from sklearn.metrics import matthews_corrcoef, roc_auc_score

from pipeline.data.protein_tokenizer import CLS_ID, EOS_ID, MASK_ID, RESIDUES, VOCAB

MODEL_WINDOW = 1024  # tokens, <cls>/<eos> included: compute_fitness.py's model_window
OFFSET = 1  # mutant positions are 1-based (compute_fitness.py --offset-idx default; no start_idx in the reference)
MUTANT_SEP = ":"  # ProteinGym joins the substitutions of a multi-mutant with ':'
AA_VOCAB = "ACDEFGHIKLMNPQRSTVWY"  # ProteinGym's scoring_utils.AA_vocab: the allowed target letters
ASSAY_COLUMNS = ("mutant", "DMS_score", "DMS_score_bin")
REFERENCE_COLUMNS = ("DMS_id", "DMS_filename", "target_seq")
METRICS = ("spearman", "auc", "mcc")
V = len(VOCAB)
_TOKEN_ID = {t: i for i, t in enumerate(VOCAB) if t in RESIDUES}
_SUBSTITUTION = re.compile(r"^([A-Z])([1-9][0-9]*)([A-Z])$")


@dataclass(frozen=True)
class Substitution:
    wt: str
    pos: int  # 1-based, as in the mutant string
    mt: str


@dataclass
class Assay:
    dms_id: str
    path: Path
    wt: str  # the wild type scored (reference target_seq, or reconstructed from the assay)
    wt_source: str  # "reference" | "assay"
    mutants: list[str]
    substitutions: list[tuple[Substitution, ...]]
    dms_score: np.ndarray  # float64 [n]
    dms_score_bin: np.ndarray  # int64 [n], 0/1
    lines: list[int]  # file line of each mutant, for error messages


LogitsFn = Callable  # (LongTensor [B, L], BoolTensor [B, L]) -> FloatTensor [B, L, V]


# ----------------------------------------------------------------------------------------------------------
# Parsing and validation
# ----------------------------------------------------------------------------------------------------------

def _read_csv(path: Path, required: Iterable[str]) -> tuple[list[tuple[int, dict]], list[str]]:
    """Rows as (file line, dict); ``utf-8-sig`` and ``newline=''`` absorb a BOM and the reference file's CRLF."""
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in (reader.fieldnames or [])]
        reader.fieldnames = header
        missing = [c for c in required if c not in header]
        if missing:
            raise ValueError(f"{path}: required column {missing[0]!r} is missing (header: {header})")
        rows = [(reader.line_num, row) for row in reader]
    return rows, header


def parse_mutant(text: str) -> tuple[Substitution, ...]:
    """``"A1P:D2N"`` -> substitutions; ValueError for anything else (empty, lower case, ``,`` separator, ``A0P``)."""
    parts = text.strip().split(MUTANT_SEP)
    subs = []
    for part in parts:
        m = _SUBSTITUTION.match(part)
        if not m:
            raise ValueError(f"mutant {text!r}: {part!r} is not a substitution like 'A42G' (1-based position, "
                             f"upper-case letters, multi-mutants joined by {MUTANT_SEP!r})")
        subs.append(Substitution(m.group(1), int(m.group(2)), m.group(3)))
    return tuple(subs)


def check_mutant(subs: tuple[Substitution, ...], wt: str, text: str):
    """ValueError naming the mutant unless every substitution is a valid change of ``wt``."""
    seen = set()
    for s in subs:
        if not 1 <= s.pos <= len(wt):
            raise ValueError(f"mutant {text!r}: position {s.pos} is outside the wild type (1..{len(wt)})")
        if wt[s.pos - 1] != s.wt:
            raise ValueError(f"mutant {text!r}: the wild type has {wt[s.pos - 1]!r} at position {s.pos}, "
                             f"the mutant says {s.wt!r}")
        if s.mt not in AA_VOCAB:
            raise ValueError(f"mutant {text!r}: target {s.mt!r} is not one of the 20 standard amino acids")
        if s.pos in seen:  # label_row would count the position twice against one wild-type letter
            raise ValueError(f"mutant {text!r}: position {s.pos} is substituted twice")
        seen.add(s.pos)


def check_wild_type(wt: str, where: str):
    bad = [(i + 1, c) for i, c in enumerate(wt) if c not in _TOKEN_ID]
    if not wt:
        raise ValueError(f"{where}: empty wild-type sequence")
    if bad:
        raise ValueError(f"{where}: wild type has {bad[0][1]!r} at position {bad[0][0]}, "
                         "not an ESM-2 amino-acid token")


def apply_mutant(wt: str, subs: tuple[Substitution, ...]) -> str:
    s = list(wt)
    for sub in subs:
        s[sub.pos - 1] = sub.mt
    return "".join(s)


def load_reference(path) -> dict[str, dict]:
    """``DMS_substitutions.csv`` -> {DMS_filename: {"dms_id", "target_seq", "line", <every column>}}.

    A row without DMS_id / DMS_filename / target_seq, a target_seq outside the ESM-2 amino acids or of another
    length than its ``seq_len``, or a DMS_id / DMS_filename seen before is a ValueError naming file and line.
    """
    path = Path(path)
    rows, _ = _read_csv(path, REFERENCE_COLUMNS)
    ref, ids = {}, {}
    for line, row in rows:
        row = {k: (v or "").strip() for k, v in row.items() if k}
        dms_id, fname, seq = row["DMS_id"], row["DMS_filename"], row["target_seq"].upper()  # the script upper-cases
        where = f"{path}:{line}"
        for col in REFERENCE_COLUMNS:
            if not row[col]:
                raise ValueError(f"{where}: empty {col}")
        check_wild_type(seq, f"{where} ({dms_id})")
        if row.get("seq_len") and row["seq_len"] != str(len(seq)):
            raise ValueError(f"{where} ({dms_id}): target_seq has {len(seq)} residues, seq_len says {row['seq_len']}")
        if fname in ref or dms_id in ids:
            first = ref[fname]["line"] if fname in ref else ids[dms_id]
            raise ValueError(f"{where}: {dms_id} / {fname} already listed at line {first}")
        ref[fname] = {**row, "dms_id": dms_id, "target_seq": seq, "line": line}
        ids[dms_id] = line
    if not ref:
        raise ValueError(f"{path}: no assays listed")
    return ref


def reference_entry(reference: Mapping[str, dict], assay_path: Path, reference_path) -> dict:
    """The reference row of an assay file: by DMS_filename, else by DMS_id = file stem."""
    assay_path = Path(assay_path)
    if assay_path.name in reference:
        return reference[assay_path.name]
    for entry in reference.values():
        if entry["dms_id"] == assay_path.stem:
            return entry
    raise ValueError(f"{assay_path}: not listed in {reference_path} (no DMS_filename {assay_path.name!r} "
                     f"or DMS_id {assay_path.stem!r})")


def wild_type_from_assay(path: Path, rows: list[tuple[int, dict]], parsed: list[tuple[Substitution, ...]]) -> str:
    """The wild type implied by the rows: each ``mutated_sequence`` with its substituted positions set back to the
    mutant's wt letters; every row must imply the same sequence (ValueError naming the first that does not)."""
    wt, first = None, None
    for (line, row), subs in zip(rows, parsed):
        seq, text = (row.get("mutated_sequence") or "").strip().upper(), row["mutant"].strip()
        where = f"{path}:{line}"
        if not seq:
            raise ValueError(f"{where}: mutant {text!r} has no mutated_sequence to rebuild the wild type from "
                             "(pass --reference DMS_substitutions.csv)")
        s = list(seq)
        for sub in subs:
            if not 1 <= sub.pos <= len(s):
                raise ValueError(f"{where}: mutant {text!r}: position {sub.pos} is outside its mutated_sequence "
                                 f"(1..{len(s)})")
            if s[sub.pos - 1] != sub.mt:
                raise ValueError(f"{where}: mutant {text!r}: mutated_sequence has {s[sub.pos - 1]!r} at position "
                                 f"{sub.pos}, not {sub.mt!r}")
            s[sub.pos - 1] = sub.wt
        cand = "".join(s)
        if wt is None:
            wt, first = cand, line
        elif cand != wt:
            diff = next((i for i, (a, b) in enumerate(zip(cand, wt)) if a != b), min(len(cand), len(wt)))
            raise ValueError(f"{where}: mutant {text!r} implies a wild type different from line {first}'s "
                             f"(length {len(cand)} vs {len(wt)}, first difference at position {diff + 1})")
    return wt


def load_assay(path, reference_entry: Mapping | None = None) -> Assay:
    """Parse and validate one assay CSV (see the module docstring); the wild type comes from ``reference_entry``
    (a :func:`load_reference` row) or, without one, from the assay's mutated sequences."""
    path = Path(path)
    rows, header = _read_csv(path, ASSAY_COLUMNS)
    if not rows:
        raise ValueError(f"{path}: no mutants")
    parsed, scores, bins = [], [], []
    for line, row in rows:
        where, text = f"{path}:{line}", (row["mutant"] or "").strip()
        try:
            parsed.append(parse_mutant(text))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        try:
            score = float(row["DMS_score"])
        except (TypeError, ValueError):
            score = math.nan
        if not math.isfinite(score):
            raise ValueError(f"{where}: mutant {text!r}: DMS_score {row['DMS_score']!r} is not a finite number")
        try:
            b = float(row["DMS_score_bin"])
        except (TypeError, ValueError):
            b = math.nan
        if b not in (0.0, 1.0):
            raise ValueError(f"{where}: mutant {text!r}: DMS_score_bin {row['DMS_score_bin']!r} is not 0 or 1")
        scores.append(score)
        bins.append(int(b))
    if reference_entry is not None:
        wt, source, dms_id = reference_entry["target_seq"], "reference", reference_entry["dms_id"]
    else:
        wt, source, dms_id = wild_type_from_assay(path, rows, parsed).upper(), "assay", path.stem
    check_wild_type(wt, f"{path} ({source} wild type)")
    has_seq = "mutated_sequence" in header
    for (line, row), subs in zip(rows, parsed):
        text = row["mutant"].strip()
        try:
            check_mutant(subs, wt, text)
        except ValueError as e:
            raise ValueError(f"{path}:{line}: {e}") from None
        seq = (row.get("mutated_sequence") or "").strip().upper() if has_seq else ""
        if seq and seq != apply_mutant(wt, subs):  # a shifted offset or another isoform: the mutant is not what it says
            raise ValueError(f"{path}:{line}: mutant {text!r}: mutated_sequence is not the wild type with this mutant "
                             "applied")
    return Assay(dms_id, path, wt, source, [r["mutant"].strip() for _, r in rows], parsed,
                 np.asarray(scores, dtype=np.float64), np.asarray(bins, dtype=np.int64), [ln for ln, _ in rows])


# ----------------------------------------------------------------------------------------------------------
# Windows and masked marginals
# ----------------------------------------------------------------------------------------------------------

def optimal_window(mutation_position_relative: int, seq_len_wo_special: int, model_window: int) -> tuple[int, int]:
    """``get_optimal_window`` of ProteinGym's ``utils/scoring_utils.py``, line for line: [start, end) of the
    window used for (framed) position ``mutation_position_relative``. Despite its name the ESM script passes
    ``seq_len_wo_special = len(WT) + 2``, i.e. the framed length; so do we."""
    half_model_window = model_window // 2
    if seq_len_wo_special <= model_window:
        return 0, seq_len_wo_special
    elif mutation_position_relative < half_model_window:
        return 0, model_window
    elif mutation_position_relative >= seq_len_wo_special - half_model_window:
        return seq_len_wo_special - model_window, seq_len_wo_special
    else:
        return (max(0, mutation_position_relative - half_model_window),
                min(seq_len_wo_special, mutation_position_relative + half_model_window))


def framed_ids(wt: str) -> np.ndarray:
    """``<cls> WT <eos>`` as ESM-2 ids (int64 [len(WT) + 2])."""
    return np.array([CLS_ID, *(_TOKEN_ID[c] for c in wt), EOS_ID], dtype=np.int64)


def masked_marginals(wt: str, positions: Iterable[int], logits_fn: LogitsFn, *, window: int = MODEL_WINDOW,
                     batch_size: int = 32, cache: dict | None = None,
                     desc: str | None = None) -> tuple[dict[int, np.ndarray], dict]:
    """{p: log-probs float64 [V]} at each 1-based residue position ``p``, masked alone in the wild-type context and
    read from its :func:`optimal_window`; and {p: (start, end)} the window each came from.

    ``cache`` (keyed by wild type, window and position) lets several assays on one wild type share the passes; it
    is only valid for one ``logits_fn``. ``desc``: a progress bar over the forward passes on stderr.
    """
    import torch

    if window < 2:
        raise ValueError(f"window: need at least 2 tokens, got {window}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    cache = {} if cache is None else cache
    ids = framed_ids(wt)
    n = len(ids)
    spans = {p: optimal_window(p, n, window) for p in sorted(set(positions))}  # framed index of residue p is p
    todo = [p for p in spans if (wt, window, p) not in cache]
    by_len: dict[int, list[int]] = {}
    for p in todo:
        by_len.setdefault(spans[p][1] - spans[p][0], []).append(p)
    batches = [ps[b:b + batch_size] for ps in by_len.values() for b in range(0, len(ps), batch_size)]
    if desc is not None:
        from pipeline.eval.cli import progress

        batches = progress(batches, desc=desc, unit="batch")
    for chunk in batches:
        length = spans[chunk[0]][1] - spans[chunk[0]][0]
        rows = np.stack([ids[spans[p][0]:spans[p][1]] for p in chunk])
        at = np.array([p - spans[p][0] for p in chunk])  # the masked token's index inside its window
        rows[np.arange(len(chunk)), at] = MASK_ID
        tokens = torch.from_numpy(rows)
        with torch.no_grad():
            logits = logits_fn(tokens, torch.ones_like(tokens, dtype=torch.bool))
        if tuple(logits.shape) != (len(chunk), length, V):
            raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for tokens {tuple(tokens.shape)}; "
                             f"expected [{len(chunk)}, {length}, {V}] (logits over the 33-token ESM-2 alphabet)")
        picked = logits[torch.arange(len(chunk)), torch.from_numpy(at)]  # [b, V] at the masked positions
        lp = torch.log_softmax(picked.detach().float().cpu(), dim=-1).double().numpy()
        for p, row in zip(chunk, lp):
            cache[(wt, window, p)] = row
    return {p: cache[(wt, window, p)] for p in spans}, spans


def masked_lm_logits_fn(model):
    """The ProteinGym ``logits_fn`` of a masked LM: ``model(input_ids, attention_mask).logits`` on the model's
    device, back as fp32 on the CPU. Any family with that forward fits (ProtLingo, the fixed-depth control, HF
    EsmForMaskedLM); the scorer checks that the logits cover the 33 ESM-2 tokens."""
    import torch

    device = next(model.parameters(), torch.empty(0)).device

    @torch.no_grad()
    def logits_fn(tokens, attention_mask):
        out = model(tokens.to(device), attention_mask.to(device))
        logits = getattr(out, "logits", None)
        if logits is None:
            raise ValueError(f"{type(model).__name__}(input_ids, attention_mask) returned {type(out).__name__} "
                             "without .logits: --task proteingym needs a masked LM")
        return logits.float().cpu()

    return logits_fn


def score_mutants(subs_list: list[tuple[Substitution, ...]], logprobs: Mapping[int, np.ndarray]) -> np.ndarray:
    """``label_row``: sum over a mutant's substitutions of lp[p, mt] - lp[p, wt] (float64 [n])."""
    out = np.empty(len(subs_list), dtype=np.float64)
    for k, subs in enumerate(subs_list):
        out[k] = sum(logprobs[s.pos][_TOKEN_ID[s.mt]] - logprobs[s.pos][_TOKEN_ID[s.wt]] for s in subs)
    return out


# ----------------------------------------------------------------------------------------------------------
# Metrics and evaluation
# ----------------------------------------------------------------------------------------------------------

def assay_metrics(score: np.ndarray, dms_score: np.ndarray, dms_score_bin: np.ndarray) -> dict:
    """Spearman, raw AUC and median-split MCC as performance_DMS_benchmarks.py computes them (module docstring)."""
    score, dms_score, dms_score_bin = (np.asarray(a) for a in (score, dms_score, dms_score_bin))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConstantInputWarning)  # constant score -> NaN, reported as such
        rho = float(spearmanr(dms_score, score)[0])
    auc = float(roc_auc_score(dms_score_bin, score)) if len(np.unique(dms_score_bin)) == 2 else math.nan
    pred = (score >= np.median(score)).astype(np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one predicted class: sklearn's MCC is 0
        mcc = float(matthews_corrcoef(dms_score_bin, pred))
    return {"spearman": rho, "auc": auc, "mcc": mcc, "n": int(len(score))}


def score_assay(assay: Assay, logits_fn: LogitsFn, *, window: int = MODEL_WINDOW, batch_size: int = 32,
                cache: dict | None = None, progress: bool = False) -> dict:
    """Scores (float64 [n], every one finite or a ValueError naming the mutant), metrics and window count;
    ``progress``: a bar over the assay's forward passes on stderr."""
    positions = {s.pos for subs in assay.substitutions for s in subs}
    lp, spans = masked_marginals(assay.wt, positions, logits_fn, window=window, batch_size=batch_size, cache=cache,
                                 desc=f"proteingym {assay.dms_id}" if progress else None)
    scores = score_mutants(assay.substitutions, lp)
    bad = np.flatnonzero(~np.isfinite(scores))
    if len(bad):
        k = bad[0]
        raise ValueError(f"{assay.path}:{assay.lines[k]}: mutant {assay.mutants[k]!r} cannot be scored: the model's "
                         f"log-probabilities are not finite at its positions ({len(bad)} mutants in all)")
    return {"scores": scores, "metrics": assay_metrics(scores, assay.dms_score, assay.dms_score_bin),
            "windows": len(set(spans.values())), "positions": len(spans)}


def aggregate(per_assay: Mapping[str, dict]) -> dict:
    """Mean over assays of each metric (NaN left out and counted in ``n_nan``), ``n`` = number of assays."""
    out = {"n": len(per_assay), "n_mutants": int(sum(m["n"] for m in per_assay.values()))}
    for k in METRICS:
        vals = np.array([m[k] for m in per_assay.values()], dtype=np.float64)
        ok = vals[np.isfinite(vals)]
        out[k] = float(ok.mean()) if len(ok) else math.nan
        out[f"n_nan_{k}"] = int(len(vals) - len(ok))
    return out


def evaluate_assays(assays: list[Assay], logits_fn: LogitsFn, *, window: int = MODEL_WINDOW,
                    batch_size: int = 32, progress: bool = False) -> dict:
    """Score every assay; {"per_assay": {DMS_id: metrics + windows}, "scores": {DMS_id: float64 [n]},
    "aggregate": :func:`aggregate`}. Assays on one wild type share their masked passes. ``progress``: one bar per
    assay over its forward passes, on stderr."""
    ids = [a.dms_id for a in assays]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup:
        raise ValueError(f"assay {dup} given twice")
    cache: dict = {}
    per_assay, scores = {}, {}
    for a in assays:
        res = score_assay(a, logits_fn, window=window, batch_size=batch_size, cache=cache, progress=progress)
        per_assay[a.dms_id] = {**res["metrics"], "windows": res["windows"], "positions": res["positions"],
                               "seq_len": len(a.wt), "wt_source": a.wt_source, "file": str(a.path),
                               "n_multi": sum(len(s) > 1 for s in a.substitutions)}
        scores[a.dms_id] = res["scores"]
    return {"per_assay": per_assay, "scores": scores, "aggregate": aggregate(per_assay)}


LEADERBOARD_COLUMNS = ("UniProt_ID", "coarse_selection_type")
ROUND = 3  # performance_DMS_benchmarks.py: pandas .round(3) (numpy rounding) of each assay's metrics before any average


def leaderboard_aggregate(per_assay: Mapping[str, dict], reference: Mapping[str, dict], reference_path) -> dict:
    """The ProteinGym leaderboard's average of ``per_assay`` ({DMS_id: metrics}) by the columns of ``reference``
    (:func:`load_reference`; module docstring): {"spearman", "auc", "mcc": the average over selection types,
    "by_type": {type: {metric: the type's average, "uniprot_ids": [...]}}, "n_assays", "n_uniprot", "n_types"}.
    ValueError naming the reference file when it lacks the columns or an assay."""
    by_id = {row["dms_id"]: row for row in reference.values()}
    groups: dict[tuple[str, str], list[str]] = {}
    for dms_id in per_assay:
        row = by_id.get(dms_id)
        if row is None:
            raise ValueError(f"{reference_path}: assay {dms_id} is not listed (the leaderboard average needs its "
                             "UniProt_ID and coarse_selection_type)")
        missing = [c for c in LEADERBOARD_COLUMNS if not row.get(c)]
        if missing:
            raise ValueError(f"{reference_path}:{row['line']} ({dms_id}): no {missing[0]} (the leaderboard average "
                             f"groups assays by {' and '.join(LEADERBOARD_COLUMNS)})")
        groups.setdefault((row["UniProt_ID"], row["coarse_selection_type"]), []).append(dms_id)

    def nanmean(values) -> float:
        v = np.array([x for x in values if np.isfinite(x)], dtype=np.float64)
        return float(v.mean()) if len(v) else math.nan

    out: dict = {"by_type": {}}
    types = sorted({t for _, t in groups})
    for t in types:
        pairs = sorted(u for u, tt in groups if tt == t)
        entry: dict = {"uniprot_ids": pairs}
        for k in METRICS:
            per_pair = [nanmean(float(np.round(per_assay[d][k], ROUND)) for d in groups[(u, t)]) for u in pairs]
            entry[k] = nanmean(per_pair)
        out["by_type"][t] = entry
    for k in METRICS:
        out[k] = nanmean(out["by_type"][t][k] for t in types)
    out.update(n_assays=len(per_assay), n_uniprot=len({u for u, _ in groups}), n_types=len(types))
    return out


def efficiency(spearman: float, active_params: int) -> float:
    """Paper 002's Table 1 parameter efficiency: ProteinGym Spearman per billion active parameters (the parameters
    one token uses: ProtLingoConfig.num_active_params, one of the E routed experts of each MoE layer and the R table
    rows of each memory layer a token reads; every parameter of a dense model)."""
    return spearman / (active_params / 1e9)
