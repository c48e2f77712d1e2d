"""RNAGym zero-shot fitness evaluation (paper appendix A.6, Eqs. A.10-A.12), model-agnostic.

The model enters only through ``forward``: a callable that maps one framed token sequence
``int64 [n]`` (``<cls> ... <eos>``, ids of :mod:`pipeline.data.tokenizer`) to log-probabilities ``[n, V]``.
Everything else (parsing, wild-type recovery, windowing, scoring, metrics, type-balanced aggregation) is
plain numpy/scipy/scikit-learn, so it runs the same on one process, in a test, or inside a launcher.

Data conventions (RNAGym ``fitness_processed_assays``): one CSV per assay named ``<DMS_ID>.csv`` with columns
``mutant,DMS_score,sequence``; ``mutant`` holds 1-based substitutions joined by commas (``"U6C,C74U"``), the
wild-type row has an empty mutant; ncRNA assays use U and mRNA-coding assays use T.

U/T (alphabet convention, fixed for every assay and every depth, as A.6 requires): every sequence -- the sheet's
RAW_CONSTRUCT_SEQ, each assay row and each mutation letter -- is upper-cased and T is written as U
(:func:`_normalise`, tokenized with ``NucleotideTokenizer(alphabet='rna')``), so an mRNA-coding wild type that RNAGym
writes in T reaches the model in U, exactly like the ncRNA assays. Why: Eco-RNA's vocabulary keeps U and T as
different tokens because its pretraining writes RNA sources with U and DNA sources with T (A.3), and what these
assays measure is the fitness of an RNA molecule (the mRNA, for the coding assays), so the RNA spelling is the one
that says "this is RNA" to the model; one alphabet for all five types also means no type is scored in a token
set the others are not. The price: the coding sequences the model saw in pretraining come mostly from DNA
sources (OpenGenome2, in T), so a T-spelt coding wild type would be closer to that data. The paper does not say
which spelling it used; this is our choice, and changing it is a different protocol, not a fix.

RNA types (Eq. A.12): the reference sheet's RNA_TYPE must name one of the paper's five types, :data:`RNA_TYPES`
(case, ``_`` and spaces are not significant). The older ``reference_sheet.csv`` writes the two splicing assays
(Julien 2016, Ke 2017) as bare ``mRNA``; upstream's ``reference_sheet_final.csv`` calls them ``mRNA-splicing``
and the coding assays ``mRNA-coding``, so bare ``mRNA`` is read as ``mRNA-splicing``. Any other value is an error
naming the sheet, line, DMS_ID and value: an assay is never dropped or put in a type of its own.

Undefined metrics (Eq. A.11; see :func:`assay_metrics`): when the median-binarised fitness or the median-binarised
score has one class, MCC is 0 (scikit-learn's convention for a zero denominator) and the assay stays in every
mean. AUC with one fitness class and Spearman with a constant F or y are undefined: they are NaN for that assay,
left out of that metric's means and counted (``n_nan``).
"""
from __future__ import annotations

import csv
import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
from scipy.stats import ConstantInputWarning, spearmanr
from sklearn.metrics import matthews_corrcoef, roc_auc_score

from pipeline.data.tokenizer import CLS_ID, EOS_ID, NUM_SPECIAL, VOCAB, NucleotideTokenizer

METRICS = ("spearman", "auc", "mcc")
# The paper's five RNA types (A.6), in its order; the report and the aggregate use these names.
RNA_TYPES = ("mRNA-coding", "Ribozyme", "tRNA", "mRNA-splicing", "Aptamer")
# Sheet spellings that are not a type name up to case/separators. Bare "mRNA" is the older sheet's name for the
# splicing assays (upstream's final sheet renames them mRNA-splicing); nothing else is guessed.
RNA_TYPE_ALIASES = {"mrna": "mRNA-splicing"}
ASSAY_COLUMNS = ("mutant", "DMS_score", "sequence")
SHEET_COLUMNS = ("DMS_ID", "RNA_TYPE", "RAW_CONSTRUCT_SEQ")
_MUTATION = re.compile(r"^([A-Za-z])(\d+)([A-Za-z])$")
_TOKENIZER = NucleotideTokenizer(alphabet="rna")


def _normalise(seq: str) -> str:
    """Upper case, T -> U: RNAGym writes mRNA-coding assays in T and ncRNA assays in U; the model reads every assay
    in U (the RNA spelling of Eco-RNA's pretraining, see the module docstring)."""
    return seq.strip().upper().replace("T", "U")


def _read_csv(path: Path, required: Iterable[str]) -> tuple[list[tuple[int, dict]], list[str]]:
    """Rows as (file line number, dict); ``utf-8-sig`` and ``newline=''`` absorb a BOM and CRLF endings."""
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in (reader.fieldnames or [])]
        reader.fieldnames = header
        for col in required:
            if col not in header:
                raise ValueError(f"{path}: required column {col!r} is missing (header: {header})")
        rows = [(reader.line_num, row) for row in reader]
    return rows, header


# ----------------------------------------------------------------------------------------------------------
# Reference sheet
# ----------------------------------------------------------------------------------------------------------

def _type_key(name: str) -> str:
    """Case and separators are spelling, not meaning ("mRNA coding", "mrna_coding", "mRNA-coding")."""
    return re.sub(r"[\s_-]+", "-", name.strip().lower())


_TYPE_BY_KEY = {**{_type_key(t): t for t in RNA_TYPES}, **RNA_TYPE_ALIASES}


def canonical_rna_type(value: str) -> str:
    """A sheet RNA_TYPE -> one of :data:`RNA_TYPES`; ValueError (naming the value) for anything else."""
    try:
        return _TYPE_BY_KEY[_type_key(value)]
    except KeyError:
        raise ValueError(f"RNA_TYPE {value!r} is not one of the paper's five types {list(RNA_TYPES)} "
                         "(bare 'mRNA' is read as 'mRNA-splicing')") from None


def load_reference_sheet(path) -> dict[str, dict]:
    """``reference_sheet.csv`` -> {DMS_ID: {"rna_type", "rna_type_sheet", "wt", <every other column, lower-cased>}}.

    ``rna_type`` is RNA_TYPE mapped onto the paper's five types (:func:`canonical_rna_type`; an unknown value is a
    ValueError naming file, line, DMS_ID and value), ``rna_type_sheet`` the value as the sheet writes it. ``wt`` is
    RAW_CONSTRUCT_SEQ normalised to the U alphabet, or None when the sheet leaves it empty.
    """
    path = Path(path)
    rows, header = _read_csv(path, SHEET_COLUMNS)
    sheet: dict[str, dict] = {}
    for line, row in rows:
        dms_id = (row["DMS_ID"] or "").strip()
        if not dms_id:
            continue
        if dms_id in sheet:
            raise ValueError(f"{path}: DMS_ID {dms_id!r} appears twice (second at line {line})")
        entry = {col.lower(): (row.get(col) or "").strip() for col in header if col}
        rna_type = entry["rna_type"]
        if not rna_type:
            raise ValueError(f"{path}: DMS_ID {dms_id!r} (line {line}) has an empty RNA_TYPE")
        try:
            entry["rna_type"] = canonical_rna_type(rna_type)
        except ValueError as e:
            raise ValueError(f"{path}: DMS_ID {dms_id!r} (line {line}): {e}") from None
        entry["rna_type_sheet"] = rna_type
        raw = entry.pop("raw_construct_seq")
        entry["raw_construct_seq"] = raw
        entry["wt"] = _normalise(raw) if raw else None
        sheet[dms_id] = entry
    return sheet


# ----------------------------------------------------------------------------------------------------------
# Assays
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Assay:
    """One RNAGym assay with its substitutions flattened for vectorised scoring.

    N = kept variants (rows with a mutant and a finite DMS_score), M = total substitutions over them, L = len(wt).
    A wild-type row (empty mutant) is not a variant: it only offers its sequence as the wild type, and is counted in
    ``wt_rows`` (RNAGym's own scorer drops it: ``performance_fitness.py``, ``df.dropna(subset=["mutant"])``, the empty
    mutant being read as NaN). ``assay_from_mutants`` (scoring outside a benchmark) keeps "" as the wild type itself.
    """
    dms_id: str
    path: Path
    wt: str                      # wild type, upper-case U alphabet, length L
    wt_source: str               # "reference" | "wt_row" | "reconstructed" | "given" (assay_from_mutants)
    mutants: tuple[str, ...]     # [N] mutant strings as normalised here ("" for the wild-type row)
    dms_score: np.ndarray        # [N] float64 measured fitness y
    line_numbers: np.ndarray     # [N] int64 file line of each kept variant (for messages)
    sub_variant: np.ndarray      # [M] int64 index into the N variants
    sub_pos: np.ndarray          # [M] int64 0-based position on wt
    sub_from: np.ndarray         # [M] int64 token id of the wild-type base (== wt at sub_pos)
    sub_to: np.ndarray           # [M] int64 token id of the substituted base
    dropped: int = 0             # rows skipped because DMS_score was missing / not finite
    notes: tuple[str, ...] = field(default_factory=tuple)
    wt_rows: int = 0             # wild-type rows (empty mutant): not scored, as RNAGym drops them

    @property
    def n_variants(self) -> int:
        return len(self.mutants)

    @property
    def n_mutations(self) -> np.ndarray:
        """[N] int64 substitutions per variant (0 for the wild-type row)."""
        return np.bincount(self.sub_variant, minlength=self.n_variants).astype(np.int64)

    def wt_ids(self) -> np.ndarray:
        """[L] uint8 token ids of the wild type, no specials.

        ``wt`` is already in U (T -> U at parsing), and the 'rna' tokenizer writes any T as U again, so an
        mRNA-coding wild type is read with the U token (id 9), never T (id 10): one alphabet for every assay
        (module docstring, "U/T").
        """
        return _TOKENIZER.encode(self.wt)


def _parse_mutant(text: str, where: str) -> list[tuple[str, int, str]]:
    """``"U6C,C74U"`` -> [("U", 5, "C"), ("C", 73, "U")] (0-based positions, U alphabet)."""
    subs = []
    for part in text.split(","):
        m = _MUTATION.match(part.strip())
        if not m:
            raise ValueError(f"{where}: cannot parse mutation {part.strip()!r} in mutant {text!r} "
                             "(expected e.g. 'C10A'; multiple mutations are joined by commas)")
        frm, pos, to = _normalise(m.group(1)), int(m.group(2)), _normalise(m.group(3))
        if pos < 1:
            raise ValueError(f"{where}: mutation {part.strip()!r} has position {pos}; positions are 1-based")
        subs.append((frm, pos - 1, to))
    positions = [p for _, p, _ in subs]
    if len(set(positions)) != len(positions):
        raise ValueError(f"{where}: mutant {text!r} lists the same position twice")
    return subs


def _parse_score(raw: str | None) -> float:
    raw = (raw or "").strip()
    if raw.lower() in ("", "nan", "na", "n/a", "none", "null"):
        return math.nan
    return float(raw)


def _reference_mismatch(ref: str, consensus: str, variants) -> str:
    """Explain why the reference construct does not fit the assay's mutations (for Assay.notes)."""
    n_pos = len({p for _, _, subs, _ in variants for _, p, _ in subs})
    bad = {p for _, _, subs, _ in variants for frm, p, _ in subs if p >= len(ref) or ref[p] != frm}
    why = (f"reference RAW_CONSTRUCT_SEQ (length {len(ref)}) disagrees with the assay's mutations "
           f"(variants have length {len(consensus)}; {len(bad)} of {n_pos} mutated positions carry a different "
           f"'from' base in the reference)")
    offset = ref.find(consensus)
    if offset >= 0:
        why += f"; the assay wild type occurs inside the reference at 0-based offset {offset}"
    else:
        rev = consensus.find(ref)
        if rev >= 0:
            why += f"; the reference occurs inside the assay wild type at 0-based offset {rev}"
    return why


def _check_on_wild_type(wt: str, frm: str, p: int, to: str, where: str, source: str):
    """ValueError unless substitution ``frm``(p+1)``to`` lies on ``wt`` and ``wt`` carries ``frm`` there."""
    mut = f"{frm}{p + 1}{to}"
    if p >= len(wt):
        raise ValueError(f"{where}: mutation {mut} is past the end of the wild type (length {len(wt)})")
    if wt[p] != frm:
        raise ValueError(f"{where}: mutation {mut}: wild-type base at position {p + 1} is {wt[p]}, not {frm} "
                         f"({source})")


def _base_ids(sub_from: list, sub_to: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The substitutions' from/to letters as int64 token ids [M]; ValueError for a letter outside the alphabet."""
    ids_from = np.asarray([VOCAB.index(b) if b in VOCAB else -1 for b in sub_from], dtype=np.int64)
    ids_to = np.asarray([VOCAB.index(b) if b in VOCAB else -1 for b in sub_to], dtype=np.int64)
    if (ids_from < NUM_SPECIAL).any() or (ids_to < NUM_SPECIAL).any():
        raise ValueError(f"{where}: a mutation uses a base outside the nucleotide/IUPAC alphabet")
    return ids_from, ids_to


def assay_from_mutants(wt: str, mutants: Iterable[str], dms_id: str = "variants") -> Assay:
    """An :class:`Assay` of mutant strings on the wild type ``wt``, without measurements (``dms_score`` NaN), for
    scoring outside a benchmark file (pipeline.inference): the same spelling (1-based, comma-joined, T read as U,
    ``""`` the wild type itself) and the same checks as :func:`load_assay`'s rows."""
    wt = _normalise(wt)
    try:
        _TOKENIZER.encode(wt)
    except ValueError as e:
        raise ValueError(f"{dms_id}: wild type: {e}") from None
    mutants = [str(m).strip() for m in mutants]
    sub_variant, sub_pos, sub_from, sub_to = [], [], [], []
    for i, text in enumerate(mutants):
        where = f"{dms_id}: mutant {i} ({text!r})"
        for frm, p, to in (_parse_mutant(text, where) if text else []):
            _check_on_wild_type(wt, frm, p, to, where, "the given wild type")
            sub_variant.append(i)
            sub_pos.append(p)
            sub_from.append(frm)
            sub_to.append(to)
    ids_from, ids_to = _base_ids(sub_from, sub_to, dms_id)
    return Assay(dms_id=dms_id, path=Path(dms_id), wt=wt, wt_source="given", mutants=tuple(mutants),
                 dms_score=np.full(len(mutants), np.nan), line_numbers=np.arange(len(mutants), dtype=np.int64),
                 sub_variant=np.asarray(sub_variant, dtype=np.int64), sub_pos=np.asarray(sub_pos, dtype=np.int64),
                 sub_from=ids_from, sub_to=ids_to)


def load_assay(path, sheet: Mapping[str, Mapping] | None = None, dms_id: str | None = None) -> Assay:
    """Parse and validate one RNAGym assay CSV.

    ``dms_id`` defaults to the file stem. Wild type, in order of preference:
      1. the sheet's RAW_CONSTRUCT_SEQ for ``dms_id`` -- used only if it equals the wild type implied by the
         variants (the consensus of every variant with its listed mutations reverted); otherwise it is a
         different construct/frame than the one the mutation positions refer to, so it is not used and the
         reason is recorded in ``notes``;
      2. the sequence of the wild-type row (empty mutant);
      3. the reconstruction from the variants (they must all agree).
    Then every kept row is validated against that wild type: same length, the wild-type base at each listed
    position equals the mutation's ``from`` base, the variant carries the ``to`` base, and the variant equals
    the wild type at every position it does not list. Any violation is a ValueError naming file, line and
    mutation. Rows whose DMS_score is missing/NaN are dropped (counted in ``dropped``) before validation. A wild-type
    row (empty mutant) is never a scored variant (counted in ``wt_rows``, as RNAGym's scorer drops it); its sequence
    serves as a wild-type candidate.
    """
    path = Path(path)
    dms_id = dms_id or path.stem
    rows, _ = _read_csv(path, ASSAY_COLUMNS)
    notes: list[str] = []

    variants = []        # (line, mutant string, [(from, pos0, to)], sequence) for rows with finite scores
    scores = []
    wt_rows: list[tuple[int, str]] = []
    dropped = n_wt = 0
    for line, row in rows:
        where = f"{path}: row {line - 1} (line {line})"
        mutant = (row["mutant"] or "").strip()
        seq = _normalise(row["sequence"] or "")
        try:
            y = _parse_score(row["DMS_score"])
        except ValueError:
            raise ValueError(f"{where}: DMS_score {row['DMS_score']!r} is not a number") from None
        if not mutant:  # the wild-type row: a wild-type candidate, never a scored variant (RNAGym drops it)
            n_wt += 1
            if seq:
                wt_rows.append((line, seq))
            continue
        if not math.isfinite(y):
            dropped += 1
            continue
        if not seq:
            raise ValueError(f"{where}: empty sequence")
        subs = _parse_mutant(mutant, where) if mutant else []
        variants.append((line, ",".join(f"{f}{p + 1}{t}" for f, p, t in subs), subs, seq))
        scores.append(y)
    if dropped:
        notes.append(f"dropped {dropped} row(s) with a missing DMS_score")
    if n_wt:
        notes.append(f"{n_wt} wild-type row(s) (empty mutant) not scored, as RNAGym's scorer drops them")
    if not variants:
        raise ValueError(f"{path}: no variant row (a mutant with a finite DMS_score)")

    # Consensus wild type implied by the variants: the most common "variant with its mutations reverted".
    # A corrupted row is a minority, so it does not move the consensus and validation below names it.
    reverted = Counter()
    for line, _, subs, seq in variants:
        s = list(seq)
        for frm, p, _ in subs:
            if p < len(s):
                s[p] = frm
        reverted["".join(s)] += 1
    consensus = reverted.most_common(1)[0][0]

    ref = None
    if sheet is not None:
        entry = sheet.get(dms_id)
        if entry is None:
            notes.append(f"{dms_id} is not in the reference sheet")
        else:
            ref = entry.get("wt") or None
    if ref is not None and ref == consensus:
        wt, wt_source = ref, "reference"
    else:
        if ref is not None:
            fallback = "the wild-type row" if wt_rows else "the wild type reconstructed from the variants"
            notes.append(_reference_mismatch(ref, consensus, variants) + f"; using {fallback}")
        if wt_rows:
            wt, wt_source = wt_rows[0][1], "wt_row"
            for line, seq in wt_rows[1:]:
                if seq != wt:
                    raise ValueError(f"{path}: wild-type row at line {line} differs from the one at line "
                                     f"{wt_rows[0][0]}")
        else:
            wt, wt_source = consensus, "reconstructed"
            if len(reverted) > 1:
                notes.append("no wild-type row and no usable reference; wild type = consensus of the variants")

    # Validate every kept row against the chosen wild type.
    wt_arr = np.frombuffer(wt.encode("ascii"), dtype=np.uint8)
    sub_variant, sub_pos, sub_from, sub_to = [], [], [], []
    for i, (line, mutant, subs, seq) in enumerate(variants):
        where = f"{path}: row {line - 1} (line {line})"
        if len(seq) != len(wt):
            raise ValueError(f"{where}: variant length {len(seq)} != wild-type length {len(wt)} "
                             f"(mutant {mutant!r}; only substitutions are supported)")
        for frm, p, to in subs:
            _check_on_wild_type(wt, frm, p, to, where, f"wild type from {wt_source}")
            if seq[p] != to:
                raise ValueError(f"{where}: mutation {frm}{p + 1}{to}: variant sequence has {seq[p]} at position "
                                 f"{p + 1}, not {to}")
            sub_variant.append(i)
            sub_pos.append(p)
            sub_from.append(frm)
            sub_to.append(to)
        diff = np.flatnonzero(np.frombuffer(seq.encode("ascii"), dtype=np.uint8) != wt_arr)
        unlisted = sorted(set(diff.tolist()) - {p for _, p, _ in subs})
        if unlisted:
            raise ValueError(f"{where}: variant (mutant {mutant!r}) differs from the wild type at unlisted "
                             f"position(s) {[p + 1 for p in unlisted[:5]]}")
    try:
        _TOKENIZER.encode(wt)
    except ValueError as e:
        raise ValueError(f"{path}: wild type ({wt_source}): {e}") from None
    # Variants equal the wild type outside their listed positions, so checking the `to` bases covers them.
    ids_from, ids_to = _base_ids(sub_from, sub_to, str(path))

    return Assay(dms_id=dms_id, path=path, wt=wt, wt_source=wt_source,
                 mutants=tuple(v[1] for v in variants),
                 dms_score=np.asarray(scores, dtype=np.float64),
                 line_numbers=np.asarray([v[0] for v in variants], dtype=np.int64),
                 sub_variant=np.asarray(sub_variant, dtype=np.int64),
                 sub_pos=np.asarray(sub_pos, dtype=np.int64),
                 sub_from=ids_from, sub_to=ids_to,
                 dropped=dropped, notes=tuple(notes), wt_rows=n_wt)


# ----------------------------------------------------------------------------------------------------------
# Scoring (Eq. A.10)
# ----------------------------------------------------------------------------------------------------------

def score_variants(assay: Assay, position_logprobs: np.ndarray) -> np.ndarray:
    """Wild-type-marginal score F(v; w) = sum_j [log p(v_j | w, j) - log p(w_j | w, j)], Eq. A.10.

    ``position_logprobs``: [L, V] log-probabilities at each wild-type position under the unmasked wild-type
    input (column = token id). Returns [N] float64; the wild-type row (no substitutions) scores 0.
    """
    lp = np.asarray(position_logprobs, dtype=np.float64)
    L = len(assay.wt)
    if lp.ndim != 2 or lp.shape[0] != L:
        raise ValueError(f"{assay.dms_id}: position_logprobs has shape {lp.shape}, expected [{L}, V]")
    if assay.sub_pos.size and max(assay.sub_from.max(), assay.sub_to.max()) >= lp.shape[1]:
        raise ValueError(f"{assay.dms_id}: vocabulary width {lp.shape[1]} is too small for the token ids used")
    per_sub = lp[assay.sub_pos, assay.sub_to] - lp[assay.sub_pos, assay.sub_from]  # [M]
    return np.bincount(assay.sub_variant, weights=per_sub, minlength=assay.n_variants).astype(np.float64)


def window_starts(length: int, body: int) -> np.ndarray:
    """0-based starts of the windows covering ``length`` residues with ``body`` residues each.

    Stride = max(1, body // 2); the last window is shifted left so it ends exactly at ``length``.
    """
    if length <= body:
        return np.zeros(1, dtype=np.int64)
    stride = max(1, body // 2)
    starts = list(range(0, length - body, stride)) + [length - body]
    return np.asarray(sorted(set(starts)), dtype=np.int64)


def wildtype_logprobs(wt_ids: np.ndarray, forward: Callable[[np.ndarray], np.ndarray],
                      context_length: int) -> np.ndarray:
    """Per-position log-probabilities [L, V] of the unmasked wild type, framed ``<cls> wt <eos>``.

    If L + 2 <= context_length the whole sequence is one forward call. Otherwise the wild type is cut into
    overlapping windows of ``body = context_length - 2`` residues (each framed with <cls>/<eos> so every call
    looks like a training input), starts from :func:`window_starts` (stride ~ body/2, last window flush with the
    end). Each position takes its row from the window in which it is most central, i.e. which maximises the
    distance ``min(p - start, start + body - 1 - p)`` to the nearer window edge; ties go to the earlier window.
    With stride <= body/2 every interior position thus sees at least ~body/4 residues of context on both sides;
    only the true sequence ends sit at an edge.
    """
    ids = np.asarray(wt_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"wt_ids must be a non-empty 1-D array, got shape {ids.shape}")
    if (ids < NUM_SPECIAL).any():
        raise ValueError("wt_ids must not contain special tokens; framing is added here")
    body = int(context_length) - 2
    if body < 1:
        raise ValueError(f"context_length {context_length} leaves no room for residues besides <cls>/<eos>")
    L = ids.size

    def call(chunk: np.ndarray) -> np.ndarray:
        framed = np.concatenate([[CLS_ID], chunk, [EOS_ID]]).astype(np.int64)  # [n] = [len(chunk) + 2]
        out = np.asarray(forward(framed), dtype=np.float64)
        if out.ndim != 2 or out.shape[0] != framed.size:
            raise ValueError(f"forward returned shape {out.shape} for an input of length {framed.size}")
        return out[1:-1]  # drop the <cls>/<eos> rows -> [len(chunk), V]

    if L <= body:
        return call(ids)

    out = None
    best = np.full(L, -1, dtype=np.int64)  # centrality of the window each position currently reads from
    pos = np.arange(L)
    for s in window_starts(L, body):
        lp = call(ids[s:s + body])  # [body, V]
        if out is None:
            out = np.empty((L, lp.shape[1]), dtype=np.float64)
        elif lp.shape[1] != out.shape[1]:
            raise ValueError("forward returned different vocabulary widths for different windows")
        p = pos[s:s + body]
        central = np.minimum(p - s, s + body - 1 - p)
        take = central > best[s:s + body]  # strict: an equally central later window does not replace
        out[p[take]] = lp[take]
        best[p[take]] = central[take]
    return out


# ----------------------------------------------------------------------------------------------------------
# Metrics (Eq. A.11) and aggregation (Eq. A.12)
# ----------------------------------------------------------------------------------------------------------

def _one_class(flags: np.ndarray) -> bool:
    return not 0 < int(flags.sum()) < flags.size


def assay_metrics(scores, y) -> dict[str, float]:
    """Orientation-invariant metrics of one assay: |Spearman|, max(AUC, 1 - AUC), |MCC| (Eq. A.11).

    y is binarised strictly above its median (AUC, MCC) and F strictly above its median (MCC).
    Degenerate assays keep their place in the aggregate; what each metric does there:
      * MCC is 0 when binarised y or binarised F has one class (a single variant included): the MCC denominator
        is 0, and 0 is what scikit-learn's ``matthews_corrcoef`` returns then (RNAGym's convention too). The
        assay counts with 0 ("no agreement shown"); it is not skipped.
      * AUC is NaN when binarised y has one class: there is no positive/negative pair to rank (scikit-learn
        returns NaN with an UndefinedMetricWarning). A constant F with two classes is a genuine 0.5.
      * Spearman is NaN when F or y is constant (scipy's result; the rank correlation divides by 0).
    NaN metrics are left out of that metric's means by :func:`aggregate` and counted there (``n_nan``).
    Negating F leaves |Spearman| and the folded AUC exactly unchanged, and |MCC| too unless some score equals the
    median of F (with odd N the median element is "not above" under both signs, so the halves are not mirrored).
    """
    f = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if f.shape != y.shape:
        raise ValueError(f"scores {f.shape} and fitness {y.shape} differ in length")
    if f.size == 0:
        raise ValueError("an assay needs at least one scored variant")
    if not (np.isfinite(f).all() and np.isfinite(y).all()):
        raise ValueError("scores and fitness must be finite")
    out = {m: math.nan for m in METRICS}
    if np.ptp(f) > 0 and np.ptp(y) > 0:  # implies N >= 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConstantInputWarning)
            out["spearman"] = abs(float(spearmanr(f, y).statistic))
    y_bin = y > np.median(y)
    f_bin = f > np.median(f)
    if not _one_class(y_bin):
        auc = float(roc_auc_score(y_bin, f))
        out["auc"] = max(auc, 1.0 - auc)
    # Decided here rather than by calling sklearn, whose one-class path also returns 0 but warns.
    out["mcc"] = 0.0 if _one_class(y_bin) or _one_class(f_bin) else abs(float(matthews_corrcoef(y_bin, f_bin)))
    return out


def one_class_sides(scores, y) -> list[str]:
    """Which median binarisations of one assay have a single class: a sublist of ["fitness", "score"].

    Non-empty means that assay's MCC is 0 by convention (and, with "fitness", its AUC is NaN); reported per assay
    so that a 0 MCC from the convention can be told apart from a measured one.
    """
    f = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    return [name for name, x in (("fitness", y), ("score", f)) if _one_class(x > np.median(x))]


def aggregate(per_assay: Mapping[str, Mapping[str, float]], sheet: Mapping[str, Mapping]) -> dict:
    """Type-balanced aggregate, Eq. A.12: mean over assays within each RNA type, then equal weight per type.

    Each assay's type is its sheet ``rna_type`` mapped by :func:`canonical_rna_type` (an assay missing from the
    sheet or with an unknown type is a ValueError naming it). Only the types that have assays enter the overall
    mean, so with fewer than five types it is not the paper's Q_m: ``types_missing`` says which are absent.
    NaN assay metrics are skipped by the means and counted (``n_nan``). Returns
    ``{"per_type": {type: {metric: mean, "n_assays": k, "n_nan": {metric: c}}},
       "overall": {metric: mean over types, "n_types": t, "n_assays": n, "n_nan": {metric: c},
                   "types": {type: n_assays}, "types_missing": [type, ...]}}``
    with types in the paper's order (:data:`RNA_TYPES`); the overall ``n_nan`` counts types whose mean is NaN
    (all their assays undefined).
    """
    by_type: dict[str, list[str]] = {}
    for dms_id in per_assay:
        if dms_id not in sheet:
            raise ValueError(f"assay {dms_id!r} is not in the reference sheet, so it has no RNA type")
        try:
            rna_type = canonical_rna_type(sheet[dms_id]["rna_type"])
        except ValueError as e:
            raise ValueError(f"assay {dms_id!r}: {e}") from None
        by_type.setdefault(rna_type, []).append(dms_id)
    per_type = {}
    for rna_type in (t for t in RNA_TYPES if t in by_type):
        ids = by_type[rna_type]
        entry: dict = {"n_assays": len(ids), "n_nan": {}}
        for m in METRICS:
            vals = np.array([float(per_assay[i][m]) for i in ids], dtype=np.float64)
            entry["n_nan"][m] = int(np.isnan(vals).sum())
            entry[m] = float(np.mean(vals[~np.isnan(vals)])) if (~np.isnan(vals)).any() else math.nan
        per_type[rna_type] = entry
    overall: dict = {"n_types": len(per_type), "n_assays": len(per_assay), "n_nan": {},
                     "types": {t: e["n_assays"] for t, e in per_type.items()},
                     "types_missing": [t for t in RNA_TYPES if t not in per_type]}
    for m in METRICS:
        vals = np.array([per_type[t][m] for t in per_type], dtype=np.float64)
        overall["n_nan"][m] = int(np.isnan(vals).sum())
        overall[m] = float(np.mean(vals[~np.isnan(vals)])) if (~np.isnan(vals)).any() else math.nan
    return {"per_type": per_type, "overall": overall}


def describe_types(overall: Mapping) -> str:
    """One line for a printed report: the RNA types found with their assay counts, and the missing ones."""
    found = ", ".join(f"{t} {n}" for t, n in overall["types"].items()) or "none"
    line = f"RNA types (assays): {found}"
    if overall["types_missing"]:
        line += (f"; missing {', '.join(overall['types_missing'])}: the aggregate weights the "
                 f"{overall['n_types']} type(s) found equally, so it is not the paper's five-type mean")
    return line


def load_assays(paths: Iterable, sheet: Mapping[str, Mapping]) -> dict[str, Assay]:
    """{DMS_id: Assay} of ``paths`` (file stem = DMS_id, which must be in the reference sheet, once)."""
    assays: dict[str, Assay] = {}
    for path in paths:
        dms_id = Path(path).stem
        if dms_id not in sheet:
            raise ValueError(f"assay {dms_id!r} ({path}) is not in the reference sheet")
        if dms_id in assays:
            raise ValueError(f"assay {dms_id!r} given twice")
        assays[dms_id] = load_assay(path, sheet, dms_id)
    return assays


def score_assays(assays: Mapping[str, Assay], sheet: Mapping[str, Mapping],
                 forward: Callable[[np.ndarray], np.ndarray], context_length: int, desc: str | None = None) -> dict:
    """Score and aggregate loaded assays with one model ``forward`` (see :func:`wildtype_logprobs`).

    Returns ``{"per_assay": {id: {spearman, auc, mcc, rna_type, one_class, score_mean, n_variants, dropped,
    wt_source}}, "per_type": ..., "aggregate": overall numbers (Eq. A.12) with the types found and missing,
    "n_variants": total, "notes": {id: [...]}, "scores": {id: F [N] float64}}`` (see :func:`aggregate`;
    ``one_class`` from :func:`one_class_sides`; ``score_mean`` the mean F over the assay's variants). ``desc``: a
    progress bar over the assays on stderr.
    """
    per_assay: dict[str, dict] = {}
    scores: dict[str, np.ndarray] = {}
    items = assays.items()
    if desc is not None:
        from pipeline.eval.cli import progress

        items = progress(items, total=len(assays), desc=desc, unit="assay")
    for dms_id, assay in items:
        lp = wildtype_logprobs(assay.wt_ids(), forward, context_length)
        f = score_variants(assay, lp)
        per_assay[dms_id] = {**assay_metrics(f, assay.dms_score),
                             "rna_type": canonical_rna_type(sheet[dms_id]["rna_type"]),
                             "one_class": one_class_sides(f, assay.dms_score),
                             # The metrics fold away F's orientation; its mean keeps it (< 0: the model calls the
                             # assay's mutations unfavourable on average), so a report can show which way F points.
                             "score_mean": float(f.mean()),
                             "n_variants": assay.n_variants, "dropped": assay.dropped,
                             "wt_rows": assay.wt_rows, "wt_source": assay.wt_source}
        scores[dms_id] = f
    agg = aggregate(per_assay, sheet)
    return {"per_assay": per_assay, "per_type": agg["per_type"], "aggregate": agg["overall"],
            "n_variants": int(sum(v["n_variants"] for v in per_assay.values())),
            "notes": {dms_id: list(a.notes) for dms_id, a in assays.items()}, "scores": scores}


def evaluate_assays(paths: Iterable, sheet: Mapping[str, Mapping], forward: Callable[[np.ndarray], np.ndarray],
                    context_length: int) -> dict:
    """Load, score and aggregate assays: :func:`load_assays` then :func:`score_assays`."""
    return score_assays(load_assays(paths, sheet), sheet, forward, context_length)
