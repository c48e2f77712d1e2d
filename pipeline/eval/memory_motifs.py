"""ProtLingo's latent N-gram memory against sequence motifs: paper 002's Fig. 4c analyses (``--task memory_motifs``).

Inputs: ``--data`` the proteins (FASTA) and ``--motifs`` a table of motif occurrences: a tab-separated file with the
header ``protein family start end`` (1-based, inclusive; ScanProsite's hits, or any motif scan, written that way),
one occurrence a line; a bad line is an error naming it. Families with fewer than ``--min-residues`` occurrences are
left out. The memory layer read is ``--memory-layer`` (default: the last one; the paper analyses layer 21, the last of
the 150M config's three). At a residue, the memory's *residual* is what the layer adds to the hidden state,
alpha * delta [d], and its *address* the R table rows it reads (its route symbols' windows).

(i)   ``cosine``: per occurrence, the mean residual over its positions; the mean cosine similarity of pairs of
      occurrences of one family (within) and of different families (between). Paper, layer 21: 0.968 within,
      0.756 between.
(ii)  ``agreement``: per family, route and offset inside the motif (up to the family's shortest occurrence), the share
      of its occurrences reading the commonest table row; averaged over routes, offsets and families. The same over
      composition-matched control windows: for each occurrence, the window of the same length in the same protein,
      overlapping no occurrence, whose amino-acid counts are closest (L1; ties: the nearest start). Paper: 54.2 %
      for motifs, 23.4 % for controls.
(iii) ``substitution``: at every motif position (an anchor), a conservative substitution (the amino acid of highest
      BLOSUM62 score with the wild type, ties alphabetical) and a non-conservative one (lowest score); the residual
      change is the mean over the window of the memory (positions i - s .. i + s) of the L2 distance between the
      wild-type and mutant residuals. Control: the identical substitution (same wild-type and mutant amino acid) at a
      residue of the same protein outside every occurrence (the nearest such residue). Reported: non-conservative
      over conservative change, and motif over outside change, minus one (the paper: 17.6-21.1 % and 16.8-22.8 %).

Only the blocks before the memory layer run for (iii)'s mutants: the forward stops at the layer.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.eval.benchmark import Benchmark
from pipeline.eval.plots import save_figure

AMINO = "ACDEFGHIKLMNPQRSTVWY"
# BLOSUM62 (Henikoff and Henikoff 1992), rows and columns in AMINO order
_B62 = """4 0 -2 -1 -2 0 -2 -1 -1 -1 -1 -2 -1 -1 -1 1 0 0 -3 -2
0 9 -3 -4 -2 -3 -3 -1 -3 -1 -1 -3 -3 -3 -3 -1 -1 -1 -2 -2
-2 -3 6 2 -3 -1 -1 -3 -1 -4 -3 1 -1 0 -2 0 -1 -3 -4 -3
-1 -4 2 5 -3 -2 0 -3 1 -3 -2 0 -1 2 0 0 -1 -2 -3 -2
-2 -2 -3 -3 6 -3 -1 0 -3 0 0 -3 -4 -3 -3 -2 -2 -1 1 3
0 -3 -1 -2 -3 6 -2 -4 -2 -4 -3 0 -2 -2 -2 0 -2 -3 -2 -3
-2 -3 -1 0 -1 -2 8 -3 -1 -3 -2 1 -2 0 0 -1 -2 -3 -2 2
-1 -1 -3 -3 0 -4 -3 4 -3 2 1 -3 -3 -3 -3 -2 -1 3 -3 -1
-1 -3 -1 1 -3 -2 -1 -3 5 -2 -1 0 -1 1 2 0 -1 -2 -3 -2
-1 -1 -4 -3 0 -4 -3 2 -2 4 2 -3 -3 -2 -2 -2 -1 1 -2 -1
-1 -1 -3 -2 0 -3 -2 1 -1 2 5 -2 -2 0 -1 -1 -1 1 -1 -1
-2 -3 1 0 -3 0 1 -3 0 -3 -2 6 -2 0 0 1 0 -3 -4 -2
-1 -3 -1 -1 -4 -2 -2 -3 -1 -3 -2 -2 7 -1 -2 -1 -1 -2 -4 -3
-1 -3 0 2 -3 -2 0 -3 1 -2 0 0 -1 5 1 0 -1 -2 -2 -1
-1 -3 -2 0 -3 -2 0 -3 2 -2 -1 0 -2 1 5 -1 -1 -3 -3 -2
1 -1 0 0 -2 0 -1 -2 0 -2 -1 1 -1 0 -1 4 1 -2 -3 -2
0 -1 -1 -1 -2 -2 -2 -1 -1 -1 -1 0 -1 -1 -1 1 5 0 -2 -2
0 -1 -3 -2 -1 -3 -3 3 -2 1 1 -3 -2 -2 -3 -2 0 4 -3 -1
-3 -2 -4 -3 1 -2 -2 -3 -3 -2 -1 -4 -4 -2 -3 -3 -2 -3 11 2
-2 -2 -3 -2 3 -3 2 -1 -2 -1 -1 -2 -3 -1 -2 -2 -2 -1 2 7"""
BLOSUM62 = {(a, b): int(v) for a, row in zip(AMINO, _B62.splitlines()) for b, v in zip(AMINO, row.split())}


@dataclass(frozen=True)
class Occurrence:
    protein: str
    family: str
    start: int  # 0-based, inclusive
    end: int  # 0-based, exclusive
    line: int


def read_motifs(path, sequences: dict[str, str], aliases: dict[str, str]) -> list[Occurrence]:
    """The motif table (module docstring); ValueError naming ``file:line``."""
    path = Path(path)
    out = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        missing = [c for c in ("protein", "family", "start", "end") if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: column {missing[0]!r} is missing; a motif table has the tab-separated header "
                             "protein, family, start, end")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            name = (row["protein"] or "").strip()
            if name not in aliases:
                raise ValueError(f"{where}: protein {name!r} is not in --data")
            protein = aliases[name]
            try:
                a, b = int(row["start"]), int(row["end"])
            except (TypeError, ValueError):
                raise ValueError(f"{where}: start / end {row['start']!r}, {row['end']!r} are not integers") from None
            if not 1 <= a <= b <= len(sequences[protein]):
                raise ValueError(f"{where}: {a}-{b} is outside the {len(sequences[protein])} residues of {protein}")
            out.append(Occurrence(protein, (row["family"] or "").strip(), a - 1, b, reader.line_num))
    if not out:
        raise ValueError(f"{path}: no motif occurrence")
    return out


def conservative_pair(aa: str) -> tuple[str, str]:
    """(conservative, non-conservative) substitutes of ``aa``: highest and lowest BLOSUM62 score, ties alphabetical."""
    others = [b for b in AMINO if b != aa]
    return (max(others, key=lambda b: (BLOSUM62[aa, b], -ord(b))), min(others, key=lambda b: (BLOSUM62[aa, b], b)))


def control_window(occ: Occurrence, seq: str, covered: np.ndarray) -> int | None:
    """The start of the composition-matched control of ``occ`` (module docstring, ii), or None when the protein has
    no window of its length clear of every occurrence."""
    n = occ.end - occ.start
    want = np.array([seq[occ.start:occ.end].count(a) for a in AMINO])
    best = None
    for s in range(0, len(seq) - n + 1):
        if covered[s:s + n].any():
            continue
        diff = int(np.abs(np.array([seq[s:s + n].count(a) for a in AMINO]) - want).sum())
        key = (diff, abs(s - occ.start), s)
        best = key if best is None or key < best else best
    return None if best is None else best[2]


def outside_control(seq: str, i: int, covered: np.ndarray) -> int | None:
    """The residue nearest ``i`` with the same amino acid and outside every occurrence (identical-substitution
    control, module docstring iii), or None."""
    same = [j for j, c in enumerate(seq) if c == seq[i] and not covered[j]]
    return min(same, key=lambda j: (abs(j - i), j)) if same else None


class _Stop(Exception):
    pass


def memory_readout(model, layer: int, seq: str) -> tuple[np.ndarray, np.ndarray]:
    """(residual alpha * delta [L, d], table rows [L, R]) of one chain at the memory before block ``layer``."""
    residual, rows = memory_readouts(model, layer, [seq])
    return residual[0], rows[0]


def memory_readouts(model, layer: int, seqs: list[str], batch: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(residuals [n, L, d], rows [n, L, R]) of chains of one length at the memory before block ``layer``, batched,
    each forward stopped at that layer (the blocks after it cannot change what it reads)."""
    from pipeline.data.protein_tokenizer import CLS_ID, EOS_ID, VOCAB

    mem = model.memory[str(layer)]
    device = next(model.parameters()).device
    got = {}

    def hook(module, args, output):
        h, residue, _ = args
        got["rows"] = module.addresses(module.norm(h), residue)[0]
        got["residual"] = output[0] - h
        raise _Stop

    residuals, rows = [], []
    handle = mem.register_forward_hook(hook)
    try:
        for k in range(0, len(seqs), batch):
            ids = torch.tensor([[CLS_ID, *(VOCAB.index(c) for c in s), EOS_ID] for s in seqs[k:k + batch]],
                               device=device)
            try:
                with torch.no_grad():
                    model(ids, torch.ones_like(ids, dtype=torch.bool))
            except _Stop:
                pass
            residuals.append(got["residual"][:, 1:-1].double().cpu().numpy())
            rows.append(got["rows"][:, 1:-1].cpu().numpy())
    finally:
        handle.remove()
    return np.concatenate(residuals), np.concatenate(rows)


def agreement(addresses: list[np.ndarray]) -> float:
    """Mean over routes and offsets of the share of windows reading the commonest row: [n, offsets, R] stacked."""
    a = np.stack(addresses)  # [n, offsets, R]
    shares = []
    for o in range(a.shape[1]):
        for r in range(a.shape[2]):
            _, counts = np.unique(a[:, o, r], return_counts=True)
            shares.append(counts.max() / a.shape[0])
    return float(np.mean(shares))


def options(p) -> None:
    p.add_argument("--motifs", type=Path, default=None, help="memory_motifs: the motif occurrences, a TSV with "
                   "columns protein, family, start, end (1-based, inclusive)")
    p.add_argument("--memory-layer", type=int, default=None, help="memory_motifs: the memory (the block it precedes) "
                   "to read (default: the last)")


def run(trained, data, runs, args) -> dict:
    """--task memory_motifs (module docstring)."""
    from pipeline.eval.annotations import read_proteins
    from pipeline.eval.cli import progress

    model = trained.model
    layers = sorted(int(k) for k in model.memory) if hasattr(model, "memory") else []
    if not layers:
        raise ValueError("the model has no latent N-gram memory (model.memory_layers is empty)")
    layer = layers[-1] if args.memory_layer is None else args.memory_layer
    if layer not in layers:
        raise ValueError(f"--memory-layer {layer}: the memory sits before blocks {layers}")
    if args.motifs is None or not Path(args.motifs).is_file():
        raise FileNotFoundError(f"{args.motifs}: --motifs: the motif table is needed (protein, family, start, end)")
    sequences, aliases = read_proteins(data)
    occ = read_motifs(args.motifs, sequences, aliases)
    counts = {f: sum(o.family == f for o in occ) for f in sorted({o.family for o in occ})}
    kept = {f for f, n in counts.items() if n >= args.min_residues}
    occ = [o for o in occ if o.family in kept]
    if len(kept) < 2:
        raise ValueError(f"{args.motifs}: the analyses compare families; {len(kept)} has at least --min-residues "
                         f"{args.min_residues} occurrences")
    covered = {p: np.zeros(len(s), dtype=bool) for p, s in sequences.items()}
    for o in occ:
        covered[o.protein][o.start:o.end] = True
    wt = {p: memory_readout(model, layer, sequences[p]) for p in progress(sorted({o.protein for o in occ}),
                                                                           desc="memory_motifs", unit="protein")}
    # (i) residual similarity within and between families
    vec = np.stack([wt[o.protein][0][o.start:o.end].mean(0) for o in occ])
    unit = vec / np.maximum(np.linalg.norm(vec, axis=1, keepdims=True), 1e-12)
    cos = unit @ unit.T
    fam = np.array([o.family for o in occ])
    iu = np.triu_indices(len(occ), 1)
    same = fam[iu[0]] == fam[iu[1]]
    cosine = {"within": float(cos[iu][same].mean()), "between": float(cos[iu][~same].mean())}
    # (ii) address agreement, motifs against composition-matched windows
    motif_agree, control_agree, controls = {}, {}, []
    for f in sorted(kept):
        mine = [o for o in occ if o.family == f]
        n = min(o.end - o.start for o in mine)
        motif_agree[f] = agreement([wt[o.protein][1][o.start:o.start + n] for o in mine])
        ctrl = []
        for o in mine:
            s = control_window(o, sequences[o.protein], covered[o.protein])
            if s is not None:
                controls.append({"line": o.line, "protein": o.protein, "start": s, "length": o.end - o.start})
                ctrl.append(wt[o.protein][1][s:s + n])
        control_agree[f] = agreement(ctrl) if len(ctrl) >= 2 else math.nan
    # (iii) residual change under substitutions: every mutant of a protein read in batches
    s_mem = model.cfg.memory_radius
    jobs = []  # (kind, protein, position, mutant sequence); "motif" and "outside" rows come in pairs
    for o in occ:
        seq = sequences[o.protein]
        for i in range(o.start, o.end):
            if seq[i] not in AMINO:
                continue
            cons, non = conservative_pair(seq[i])
            jobs += [("conservative", o.protein, i, seq[:i] + cons + seq[i + 1:]),
                     ("non_conservative", o.protein, i, seq[:i] + non + seq[i + 1:])]
            j = outside_control(seq, i, covered[o.protein])
            if j is not None:
                jobs += [("motif", o.protein, i, seq[:i] + non + seq[i + 1:]),
                         ("outside", o.protein, j, seq[:j] + non + seq[j + 1:])]
    readout = {}
    for p in progress(sorted({job[1] for job in jobs}), desc="memory_motifs substitutions", unit="protein"):
        mutants = sorted({job[3] for job in jobs if job[1] == p})
        res, _ = memory_readouts(model, layer, mutants)
        readout.update({(p, m): r for m, r in zip(mutants, res)})
    change = {"conservative": [], "non_conservative": [], "motif": [], "outside": []}
    for kind, p, i, mutant in jobs:
        lo, hi = max(0, i - s_mem), min(len(mutant), i + s_mem + 1)
        diff = readout[p, mutant][lo:hi] - wt[p][0][lo:hi]
        change[kind].append(float(np.linalg.norm(diff, axis=1).mean()))
    mean = {k: float(np.mean(v)) if v else math.nan for k, v in change.items()}
    result = {"memory_layer": layer, "families": counts, "kept": sorted(kept), "occurrences": len(occ),
              "cosine": cosine, "agreement": {"motif": float(np.mean(list(motif_agree.values()))),
                                              "control": float(np.nanmean(list(control_agree.values()))),
                                              "motif_by_family": motif_agree, "control_by_family": control_agree},
              "controls": controls, "substitution": {**mean, "n": {k: len(v) for k, v in change.items()},
                                                     "non_conservative_over_conservative": mean["non_conservative"] /
                                                     mean["conservative"] - 1, "motif_over_outside":
                                                     mean["motif"] / mean["outside"] - 1}}
    result["columns"] = ("analysis", "motif", "control")
    result["table"] = [("cosine_within_vs_between", cosine["within"], cosine["between"]),
                       ("address_agreement", result["agreement"]["motif"], result["agreement"]["control"]),
                       ("change_nonconservative_vs_conservative", mean["non_conservative"], mean["conservative"]),
                       ("change_motif_vs_outside", mean["motif"], mean["outside"])]
    return result


def plot(result: dict, out: Path, title: str) -> Path:
    """OUT_STEM.png: the three analyses, motif (or within-family) bars beside their controls."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    panels = ((("within family", "between families"), (result["cosine"]["within"], result["cosine"]["between"]),
               "residual cosine similarity"),
              (("motifs", "matched windows"), (result["agreement"]["motif"], result["agreement"]["control"]),
               "address agreement"),
              (("non-conservative", "conservative", "motif", "outside"),
               tuple(result["substitution"][k] for k in ("non_conservative", "conservative", "motif", "outside")),
               "local residual change (L2)"))
    for ax, (labels, values, ylabel) in zip(axes, panels):
        ax.bar(range(len(values)), values, color=["C3", "C7", "C3", "C7"][:len(values)])
        ax.set_xticks(range(len(values)), labels, fontsize=7, rotation=20)
        ax.set_ylabel(ylabel, fontsize=8)
    fig.suptitle(f"memory before block {result['memory_layer']}: {title}", fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out.with_name(f"{out.stem}.png"), dpi=100)


BENCHMARK = Benchmark(name="memory_motifs", help="latent N-gram memory against motif occurrences (--motifs TSV; "
                      "--data the proteins' FASTA): residual similarity within vs between families, address agreement "
                      "of motifs vs composition-matched windows, residual change under substitutions (Fig. 4c)",
                      scorer="memory", metrics=("motif", "control"), run=run, options=options, model="protein",
                      depth_axis=False, plot=plot)
