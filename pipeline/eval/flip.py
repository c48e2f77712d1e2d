"""FLIP (Dallago et al. 2021) fitness landscapes: GB1, AAV, Meltome, through both protocols a user needs.

Data. A landscape is a folder of FLIP split CSVs (``splits.zip`` of ``J-SNACKKB/FLIP/splits/<landscape>``:
GB1's ``one_vs_rest.csv``, ``three_vs_rest.csv``, ...; AAV's ``des_mut.csv``, ``low_vs_high.csv``, ...; Meltome's
``mixed_split.csv``, ``human.csv``, ``human_cell.csv``) and, for the mutational landscapes, the wild type as the one
FASTA FLIP ships beside them (GB1 ``5LDE_1.fasta``, AAV ``P03135.fasta``; ``--flip-wild-type`` names another). Each
CSV has the columns ``sequence,target,set[,validation]``: ``set`` is ``train`` or ``test``; ``validation`` marks the
training rows FLIP sets aside for model selection (``True``; GB1 leaves the others empty, Meltome writes ``False``);
a ``validation`` row that is not a ``train`` row is an error. Every error names the file and line.

Protocols (``--flip-protocol``, both by default):

* ``zeroshot``: masked marginals relative to the wild type, ProteinGym's scoring (pipeline/eval/proteingym.py): a
  variant of the wild type's length is the set of positions where it differs; its score is the sum over them of
  log p(mt) - log p(wt), each position masked alone in the wild type (the optimal window of ``--window`` tokens
  around it). A variant of another length (AAV's insertions and deletions) has no substitution list and is not
  scored by this protocol: it is counted (``n_indel``) and left out. Needs a wild type (not Meltome). Nothing is
  fitted, so ``set`` only says where Spearman is taken: on the ``test`` rows, as FLIP's zero-shot baselines
  (``baselines/carp_masked_zeroshot.py``) report it; over all rows too.
* ``probe``: FLIP's supervised baseline on frozen embeddings (``baselines/embeddings/embeddings.py``: ESM's
  ``extract.py --include mean --truncate``): the mean over a sequence's residues of the representation the model's
  LM head reads (ESM's last-layer ``representations``, after the final LayerNorm), sequences cut to ``--window`` - 2
  residues, then a ridge regression (scikit-learn ``Ridge``) fitted on the ``train`` rows that are not
  ``validation`` rows; the ridge penalty is chosen among ``--flip-alphas`` by Spearman on the ``validation`` rows
  (none: FLIP's default alpha 1.0, said in the result), and Spearman is reported on ``test``. Validation rows never
  enter the fit. FLIP's own ESM probes put two dense layers on these features; a ridge is the linear version of
  the same protocol and needs no seed.

Which the paper means: paper 002 reports GB1, AAV and Meltome "using the same scoring protocol for internally
evaluated models". Meltome holds unrelated proteins with no wild type, so masked marginals cannot score it; the
one protocol that gives all three landscapes a number, and the one FLIP's published reference rows (the paper's
double-dagger rows) use, is the supervised probe on frozen embeddings: docs/evaluation.md ("FLIP") says so and
why, and reports both on GB1.
"""
from __future__ import annotations

import csv
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.stats import ConstantInputWarning, spearmanr

from pipeline.data.protein_tokenizer import RESIDUES, VOCAB
from pipeline.eval.benchmark import Benchmark
from pipeline.eval.plots import save_figure

COLUMNS = ("sequence", "target", "set")
PROTOCOLS = ("both", "zeroshot", "probe")
DEFAULT_ALPHAS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)
FLIP_ALPHA = 1.0  # FLIP's ridge default (baselines/README.md: --alpha 1.0), used when a split has no validation rows
_TRUE, _FALSE = {"true", "1"}, {"false", "0", ""}
_TOKEN = {t: VOCAB.index(t) for t in RESIDUES}


@dataclass
class Split:
    """One FLIP split CSV."""

    name: str  # the file stem (one_vs_rest, mixed_split, ...)
    path: Path
    sequences: list[str]
    target: np.ndarray  # float64 [n]
    is_test: np.ndarray  # bool [n]: set == test
    validation: np.ndarray  # bool [n]: a train row set aside for model selection
    lines: list[int] = field(default_factory=list)  # file line of each row

    @property
    def fit_rows(self) -> np.ndarray:
        """The rows a supervised probe is fitted on: train, not validation."""
        return ~self.is_test & ~self.validation


def read_split(path) -> Split:
    """A FLIP split CSV (module docstring); ValueError naming ``file:line`` for a missing column, a bad set or
    validation flag, a non-finite target, a sequence with a letter outside the ESM-2 alphabet or a validation row in
    ``test``."""
    path = Path(path)
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in reader.fieldnames or []]
        reader.fieldnames = header
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: required column {missing[0]!r} is missing (header: {header}); a FLIP split has "
                             "sequence,target,set[,validation]")
        seqs, target, test, val, lines = [], [], [], [], []
        for row in reader:
            where = f"{path}:{reader.line_num}"
            seq = (row["sequence"] or "").strip()
            bad = next((c for c in seq if c not in _TOKEN), None)
            if not seq:
                raise ValueError(f"{where}: empty sequence")
            if bad is not None:
                raise ValueError(f"{where}: sequence has {bad!r}, not an amino-acid token of the ESM-2 alphabet")
            try:
                y = float(row["target"])
            except (TypeError, ValueError):
                y = math.nan
            if not math.isfinite(y):
                raise ValueError(f"{where}: target {row['target']!r} is not a finite number")
            kind = (row["set"] or "").strip()
            if kind not in ("train", "test"):
                raise ValueError(f"{where}: set {row['set']!r} is neither train nor test")
            flag = (row.get("validation") or "").strip().lower()
            if flag not in _TRUE | _FALSE:
                raise ValueError(f"{where}: validation {row.get('validation')!r} is neither True, False nor empty")
            if flag in _TRUE and kind != "train":
                raise ValueError(f"{where}: a validation row must be a train row (set is {kind!r})")
            seqs.append(seq)
            target.append(y)
            test.append(kind == "test")
            val.append(flag in _TRUE)
            lines.append(reader.line_num)
    if not seqs:
        raise ValueError(f"{path}: no rows")
    if not any(test):
        raise ValueError(f"{path}: no test row (set == test): nothing to report a score on")
    return Split(path.stem, path, seqs, np.asarray(target), np.asarray(test), np.asarray(val), lines)


def read_wild_type(path) -> str:
    """The one sequence of a FASTA file (FLIP's 5LDE_1.fasta, P03135.fasta); ValueError naming the file otherwise."""
    from data_prep.fasta import iter_fasta

    records = list(iter_fasta(Path(path)))
    if len(records) != 1:
        raise ValueError(f"{path}: a wild-type FASTA holds one sequence, found {len(records)}")
    seq = records[0].seq.decode().upper()
    bad = next((c for c in seq if c not in _TOKEN), None)
    if bad is not None:
        raise ValueError(f"{path}: the wild type has {bad!r}, not an amino-acid token of the ESM-2 alphabet")
    return seq


def read_landscape(data, wild_type=None) -> tuple[list[Split], str | None, Path | None]:
    """(every split, the wild type or None, its file) of ``data``: a folder of split CSVs or one CSV; the wild
    type is ``wild_type`` or else the one FASTA (``*.fasta``, ``*.fa``) beside the CSVs (two are an error)."""
    data = Path(data)
    folder = data if data.is_dir() else data.parent
    csvs = sorted(data.glob("*.csv")) if data.is_dir() else [data]
    if not csvs:
        raise ValueError(f"{data}: no FLIP split CSV in it (sequence,target,set,validation)")
    if wild_type is None:
        fastas = sorted(p for ext in ("*.fasta", "*.fa") for p in folder.glob(ext))
        if len(fastas) > 1:
            raise ValueError(f"{folder}: {len(fastas)} FASTA files ({', '.join(p.name for p in fastas)}); name the wild "
                             "type with --flip-wild-type")
        wild_type = fastas[0] if fastas else None
    return [read_split(p) for p in csvs], (read_wild_type(wild_type) if wild_type else None), wild_type


# ---- zero-shot: masked marginals relative to the wild type ------------------------------------------------------
def substitutions(seq: str, wt: str) -> list[tuple[int, str, str]] | None:
    """[(1-based position, wt letter, mutant letter)] where ``seq`` differs from ``wt``; None for another length."""
    if len(seq) != len(wt):
        return None
    return [(i + 1, a, b) for i, (a, b) in enumerate(zip(wt, seq)) if a != b]


def zero_shot(splits: list[Split], wt: str, logits_fn, window: int, batch_size: int) -> dict:
    """{split name: report} of the masked-marginal scores (module docstring); every variant of the wild type's
    length is scored, the others counted."""
    from pipeline.eval.proteingym import masked_marginals

    subs = {s: substitutions(s, wt) for split in splits for s in split.sequences}
    positions = {p for one in subs.values() if one for p, _, _ in one}
    lp, _ = masked_marginals(wt, positions, logits_fn, window=window, batch_size=batch_size,
                             desc="flip zero-shot") if positions else ({}, {})
    score = {s: (math.nan if one is None else sum(lp[p][_TOKEN[m]] - lp[p][_TOKEN[w]] for p, w, m in one))
             for s, one in subs.items()}
    out = {}
    for split in splits:
        pred = np.array([score[s] for s in split.sequences])
        scored = np.isfinite(pred)
        test = split.is_test & scored
        out[split.name] = {"spearman_test": spearman(split.target[test], pred[test]),
                           "spearman_all": spearman(split.target[scored], pred[scored]),
                           "n_test": int(test.sum()), "n_scored": int(scored.sum()), "n_indel": int((~scored).sum()),
                           "positions": sorted(positions), "scores": [None if not np.isfinite(v) else float(v)
                                                                       for v in pred]}
    return out


# ---- the supervised probe on frozen embeddings ------------------------------------------------------------------
def mean_embeddings(model, cfg, sequences: list[str], window: int, max_tokens: int = 16384,
                    desc: str | None = None) -> np.ndarray:
    """float64 [n, d]: the mean over each sequence's residues (its first ``window`` - 2, ESM's --truncate) of the
    representation the model's LM head reads, from the family's inference forward (pipeline/families: ProtLingo's
    final LayerNorm output, ESM's last-layer representations). Sequences are batched by length, at most
    ``max_tokens`` padded tokens a forward."""
    import torch

    from pipeline.data.protein_tokenizer import CLS_ID, EOS_ID, PAD_ID
    from pipeline.families import get_family

    hooks = get_family(cfg.family).inference
    prepared = hooks.prepare(cfg, 0)
    device = next(model.parameters()).device
    framed = [np.array([CLS_ID, *(_TOKEN[c] for c in s[:window - 2]), EOS_ID]) for s in sequences]
    order = sorted(range(len(framed)), key=lambda i: -len(framed[i]))
    batches, batch = [], []
    for i in order:
        if batch and (len(batch) + 1) * len(framed[batch[0]]) > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    if desc is not None:
        from pipeline.eval.cli import progress

        batches = progress(batches, desc=desc, unit="batch")
    out = np.zeros((len(framed), cfg.model.d_model))
    for idx in batches:
        width = len(framed[idx[0]])
        tokens = torch.full((len(idx), width), PAD_ID, dtype=torch.long)
        for r, j in enumerate(idx):
            tokens[r, :len(framed[j])] = torch.from_numpy(framed[j])
        mask = tokens != PAD_ID
        with torch.no_grad():
            _, hidden, _, _ = hooks.forward(model, cfg, prepared, tokens.to(device), mask.to(device), None)
        hidden = hidden.float().cpu()
        for r, j in enumerate(idx):
            out[j] = hidden[r, 1:len(framed[j]) - 1].double().mean(0).numpy()  # residues: no <cls>, <eos>, padding
    return out


def fit_probe(x: np.ndarray, split: Split, alphas=DEFAULT_ALPHAS) -> dict:
    """FLIP's probe on features ``x`` [n, d] of ``split``'s rows: a ridge for each alpha fitted on the fit rows
    (train, not validation) alone, the alpha with the best validation Spearman kept (FLIP_ALPHA without validation
    rows), and its test predictions. Returns the report and ``predictions`` [n] of every row."""
    from sklearn.linear_model import Ridge

    fit, val, test = split.fit_rows, split.validation, split.is_test
    if fit.sum() < 2:
        raise ValueError(f"{split.path}: {int(fit.sum())} training rows outside validation: a probe needs at least 2")
    tried = {}
    for a in tuple(alphas) if val.any() else ():
        model = Ridge(alpha=a).fit(x[fit], split.target[fit])
        tried[a] = (spearman(split.target[val], model.predict(x[val])), model)
    finite = [a for a in tried if np.isfinite(tried[a][0])]
    if finite:
        best = max(finite, key=lambda a: (tried[a][0], -list(tried).index(a)))  # ties: the first alpha listed
        selection = "validation Spearman"
    else:  # no validation rows, or too few / constant for a Spearman: FLIP's default penalty
        best = FLIP_ALPHA
        selection = (f"none ({'no' if not val.any() else 'undefined Spearman on the'} validation rows): FLIP's "
                     f"default alpha {FLIP_ALPHA}")
        if best not in tried:
            tried[best] = (math.nan, Ridge(alpha=best).fit(x[fit], split.target[fit]))
    pred = tried[best][1].predict(x)
    return {"spearman_test": spearman(split.target[test], pred[test]), "spearman_validation": tried[best][0],
            "alpha": best, "selection": selection, "validation_spearman_by_alpha": {str(a): v[0] for a, v in
                                                                                   tried.items()},
            "n_fit": int(fit.sum()), "n_validation": int(val.sum()), "n_test": int(test.sum()),
            "predictions": pred.tolist()}


def spearman(a, b) -> float:
    """scipy's Spearman rho; NaN for fewer than 2 rows or a constant input."""
    if len(a) < 2:
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConstantInputWarning)
        return float(spearmanr(a, b)[0])


# ---- the benchmark --------------------------------------------------------------------------------------------
def options(p) -> None:
    p.add_argument("--flip-protocol", choices=PROTOCOLS, default="both", help="flip: zeroshot (masked marginals "
                   "relative to the wild type), probe (ridge on frozen mean embeddings) or both (default)")
    p.add_argument("--flip-wild-type", type=Path, default=None, help="flip: the wild type's FASTA (default: the one "
                   "FASTA beside the split CSVs, FLIP's 5LDE_1.fasta / P03135.fasta)")
    p.add_argument("--flip-alphas", default=",".join(map(str, DEFAULT_ALPHAS)), help="flip: ridge penalties tried, "
                   "chosen by Spearman on the validation rows (default %(default)s)")


def run(trained, data, runs, args) -> dict:
    """--task flip (module docstring): every split of ``data``, each protocol asked for."""
    import torch

    from pipeline.eval.proteingym import masked_lm_logits_fn

    protocol = getattr(args, "flip_protocol", "both")
    window = getattr(args, "window", None) or 1024
    batch = getattr(args, "batch_size", None) or 32
    try:
        alphas = tuple(float(a) for a in str(getattr(args, "flip_alphas", "1.0")).split(","))
    except ValueError:
        raise ValueError(f"--flip-alphas {args.flip_alphas!r}: comma-separated numbers") from None
    if not alphas or min(alphas) <= 0 or not all(map(math.isfinite, alphas)):
        raise ValueError(f"--flip-alphas {args.flip_alphas!r}: ridge penalties must be positive and finite")
    wt_arg = getattr(args, "flip_wild_type", None)
    if wt_arg is not None and not Path(wt_arg).is_file():
        raise FileNotFoundError(f"{wt_arg}: --flip-wild-type: no such file")
    splits, wt, wt_path = read_landscape(data, wt_arg)
    if protocol == "zeroshot" and wt is None:
        raise ValueError(f"{data}: --flip-protocol zeroshot needs the wild type (a FASTA beside the splits or "
                         "--flip-wild-type); a landscape without one (Meltome) has the probe only")
    model = trained.model.cuda() if torch.cuda.is_available() else trained.model
    result = {"splits": [s.name for s in splits], "wild_type": str(wt_path) if wt_path else None,
              "wild_type_length": len(wt) if wt else None, "protocol": protocol, "window": window,
              "per_split": {s.name: {"n": len(s.sequences), "n_train": int((~s.is_test).sum()),
                                     "n_validation": int(s.validation.sum()), "n_test": int(s.is_test.sum()),
                                     "target": s.target.tolist(), "set": ["test" if t else "train" for t in s.is_test],
                                     "validation": s.validation.tolist()} for s in splits}, "caveats": []}
    if protocol in ("both", "zeroshot"):
        if wt is None:
            result["caveats"].append("zero-shot not run: no wild type (a landscape of unrelated proteins, e.g. Meltome)")
        else:
            for name, rep in zero_shot(splits, wt, masked_lm_logits_fn(model), window, batch).items():
                result["per_split"][name]["zeroshot"] = rep
                if rep["n_indel"]:
                    result["caveats"].append(f"{name}: {rep['n_indel']} variants of another length than the wild type "
                                           "(insertions/deletions) are not scored by masked marginals")
    if protocol in ("both", "probe"):
        unique = sorted({s for split in splits for s in split.sequences})
        emb = mean_embeddings(model, trained.cfg, unique, window, desc="flip embeddings")
        row = {s: i for i, s in enumerate(unique)}
        longer = sum(len(s) > window - 2 for s in unique)
        if longer:
            result["caveats"].append(f"{longer} sequences longer than {window - 2} residues were cut to their first "
                                   f"{window - 2} (ESM's extract.py --truncate)")
        for split in splits:
            x = emb[[row[s] for s in split.sequences]]
            result["per_split"][split.name]["probe"] = fit_probe(x, split, alphas)
    get = lambda s, p, k: result["per_split"][s].get(p, {}).get(k, math.nan)  # noqa: E731
    result["columns"] = ("split", "zeroshot_spearman", "probe_spearman", "probe_val_spearman")
    result["table"] = [(s.name, get(s.name, "zeroshot", "spearman_test"), get(s.name, "probe", "spearman_test"),
                        get(s.name, "probe", "spearman_validation")) for s in splits]
    return result


def plot(result: dict, out: Path, title: str) -> Path:
    """OUT_STEM.png: per split, the test rows' target against the zero-shot score and against the probe's
    prediction, each titled with its Spearman rho."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = result["splits"]
    kinds = [k for k in ("zeroshot", "probe") if any(k in result["per_split"][s] for s in splits)]
    fig, axes = plt.subplots(len(splits), max(1, len(kinds)), figsize=(4.2 * max(1, len(kinds)), 3.4 * len(splits)),
                             squeeze=False)
    for r, name in enumerate(splits):
        rep = result["per_split"][name]
        test = np.array(rep["set"]) == "test"
        y = np.array(rep["target"])
        for c, kind in enumerate(kinds):
            ax = axes[r, c]
            if kind not in rep:
                ax.axis("off")
                continue
            pred = np.array(rep[kind]["scores" if kind == "zeroshot" else "predictions"], dtype=float)
            ok = test & np.isfinite(pred)
            ax.scatter(pred[ok], y[ok], s=4, alpha=0.5)
            ax.set_title(f"{name}: {kind}, test rho {rep[kind]['spearman_test']:.3f} (n={int(ok.sum())})", fontsize=8)
            ax.set_xlabel("masked-marginal score" if kind == "zeroshot" else "ridge prediction", fontsize=7)
            ax.set_ylabel("target", fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out.with_name(f"{out.stem}.png"), dpi=100)


BENCHMARK = Benchmark(name="flip", help="FLIP landscapes (GB1, AAV, Meltome): a folder of split CSVs (+ the wild "
                      "type's FASTA), zero-shot masked marginals and the ridge probe on frozen embeddings",
                      scorer="masked_marginals+trained_head", metrics=("probe_spearman", "zeroshot_spearman"), run=run,
                      options=options, model="protein", depth_axis=False, plot=plot)
