"""The figures of an adapted model's depth sweep (pipeline/eval/task_sweeps.py), drawn beside its JSON: each task
declares its own (``Task.figures``). Every function is called as ``(sweep result, {K: per-sequence entries}, depths,
task config, path, title)`` and returns the path it wrote (atomically, pipeline/eval/plots.py).

- :func:`per_class` (nRC): per-class accuracy against K, one line per class, the overall accuracy bold.
- :func:`structure_metrics` (secondary structure): F1, precision and recall against K on 0 .. 1.
- :func:`structure_cases` (secondary structure, the paper's Figure A1 and Figure 4 as one view): for a few
  sequences, the reference structure and the predictions at the first four K as arc diagrams (correct pairs teal,
  false red, missed dashed orange), and the sequence's own F1 against every K of the sweep.
- :func:`per_probe` (reactivity): AUC, macro-F1 and MAE against K for DMS, 2A3 and their mean.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.eval.plots import _title, save_figure, y_limits

CORRECT, FALSE, MISSED, REFERENCE = "#1b9e9e", "#d62728", "#ff7f0e", "#444444"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def per_class(result: dict, entries: dict, depths: list, tcfg, path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in tcfg.classes:
        ys = [result["per_depth"][k]["per_class"][name]["accuracy"] for k in depths]
        ax.plot(depths, ys, marker=".", lw=1, label=name)
    ax.plot(depths, [result["per_depth"][k]["accuracy"] for k in depths], color="black", lw=2.5, marker="o",
            label="all")
    ax.set_ylim(*y_limits([], True))
    ax.set_xticks(depths)
    ax.set(xlabel="core iterations K", ylabel="accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    _title(fig, title, 1)
    return save_figure(fig, path)


def structure_metrics(result: dict, entries: dict, depths: list, tcfg, path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("f1", "-o"), ("precision", "--s"), ("recall", ":^")):
        ax.plot(depths, [result["per_depth"][k][name] for k in depths], style, label=name)
    ax.set_ylim(*y_limits([], True))
    ax.set_xticks(depths)
    ax.set(xlabel="core iterations K", ylabel="pooled cells (strict, full matrix)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _title(fig, title, 1)
    return save_figure(fig, path)


def _arcs(ax, n: int, pairs: list, color: str, style: str = "-", lw: float = 1.0):
    """Arc diagram of ``pairs`` (0-based (i, j)) over a backbone of n positions: a half circle above the line."""
    t = np.linspace(0, np.pi, 40)
    for i, j in pairs:
        c, r = (i + j) / 2, (j - i) / 2
        ax.plot(c + r * np.cos(t), r * np.sin(t), color=color, ls=style, lw=lw)
    ax.plot([0, n - 1], [0, 0], color="grey", lw=0.8)
    ax.set_xlim(-1, n)
    ax.set_ylim(-1, n / 2 + 1)
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)


def pick_cases(entries: dict, depths: list, n: int = 7) -> list[int]:
    """The sequences whose F1 changes most across K (largest gain from the first K to their best), most first; ties
    by position."""
    from pipeline.tasks.ssp import scores

    f1 = np.array([[scores(e["tp"], e["fp"], e["fn"])["f1"] for e in entries[k]] for k in depths])  # [K, N]
    gain = f1.max(0) - f1[0]
    return [int(i) for i in np.argsort(-gain, kind="stable")[:n]]


def structure_cases(result: dict, entries: dict, depths: list, tcfg, path: Path, title: str,
                    cases: int = 7) -> Path:
    from pipeline.tasks.ssp import scores

    plt = _plt()
    shown = depths[:4]
    rows = pick_cases(entries, depths, cases)
    fig, axes = plt.subplots(len(rows), len(shown) + 2, figsize=(3.1 * (len(shown) + 2), 2.3 * len(rows)),
                             squeeze=False)
    for r, i in enumerate(rows):
        ref = {tuple(p) for p in entries[depths[0]][i]["ref"]}
        n = entries[depths[0]][i]["n"]
        _arcs(axes[r][0], n, sorted(ref), REFERENCE)
        axes[r][0].set_title(f"{result['ids'][i]} ({n} nt)\nreference, {len(ref)} pairs", fontsize=7)
        for c, k in enumerate(shown, 1):
            e = entries[k][i]
            pred = {tuple(p) for p in e["pred"]}
            ax = axes[r][c]
            _arcs(ax, n, sorted(pred & ref), CORRECT)
            _arcs(ax, n, sorted(pred - ref), FALSE)
            _arcs(ax, n, sorted(ref - pred), MISSED, "--", 0.8)
            ax.set_title(f"K={k}: F1 {scores(e['tp'], e['fp'], e['fn'])['f1']:.3f}", fontsize=7)
        ax = axes[r][-1]
        f1 = [scores(entries[k][i]["tp"], entries[k][i]["fp"], entries[k][i]["fn"])["f1"] for k in depths]
        ax.plot(depths, f1, marker="o", color=CORRECT)
        ax.set_ylim(*y_limits(f1, True))
        ax.set_xticks(depths)
        ax.tick_params(labelsize=6)
        ax.set_title("sequence F1 against K", fontsize=7)
        ax.grid(alpha=0.3)
    _title(fig, title + "\nteal: correct pairs, red: false, dashed orange: missed", len(shown) + 2)
    return save_figure(fig, path)


def per_probe(result: dict, entries: dict, depths: list, tcfg, path: Path, title: str) -> Path:
    from pipeline.tasks.reactivity import PROBES

    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric in zip(axes, ("auc", "f1", "mae")):
        shown = []
        for probe in PROBES:
            ys = [result["per_depth"][k]["per_probe"][probe][metric] for k in depths]
            ax.plot(depths, ys, "--.", label=probe)
            shown += ys
        mean = [result["per_depth"][k][metric] for k in depths]
        ax.plot(depths, mean, "-o", color="black", label="mean (equal weight)")
        ax.set_ylim(*y_limits(shown + mean, metric != "mae"))
        ax.set_xticks(depths)
        ax.set(xlabel="core iterations K", ylabel=metric if metric != "f1" else "macro-F1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _title(fig, title, 3)
    return save_figure(fig, path)
