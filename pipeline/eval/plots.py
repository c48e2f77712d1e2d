"""The figures a researcher keeps: metric against recurrent depth K (``launchers/evaluate.py``, every depth sweep,
with or without MLflow) and a run's validation curves (``RUN_DIR/validation.png``, pipeline/validation.py).

The y-range rule is a pure function, :func:`y_limits`, so it is tested without pixels: a metric bounded in [0, 1]
(accuracy, AUC, |MCC|, |Spearman|, pass@k, F1, precision, recall) is drawn on 0 .. 1, so a gain reads at its true
size; any other (a loss) spans at least ``MIN_SPAN_REL`` of its level and ``MIN_SPAN_ABS``, so the 0.0003 nats
between K = 1 and K = 8 of a model that does not use depth stays a flat line instead of a cliff across the whole
panel.

Chance (:func:`chance_levels`) is what a guess that ignores the input reaches on the same supervised tokens: the
most frequent target (accuracy) and the entropy of the targets' frequencies (loss, nats). On the synthetic depth task
its answers are uniform over the S values, so chance is about 1/S and ln S.
"""
from __future__ import annotations

import math
import textwrap
from collections import Counter
from pathlib import Path

MIN_SPAN_ABS = 0.05  # nats: below this a loss panel is widened around its data
MIN_SPAN_REL = 0.1  # of the panel's level (|middle|): 0.14 nats at a loss of 1.4
PAD = 0.05  # of the span, above and below the data
BOUNDED = ("accuracy", "auc", "mcc", "spearman", "pass@", "f1", "precision", "recall")


def is_bounded(name: str) -> bool:
    """Whether a metric name is one of the [0, 1] kind (accuracy, AUC, |MCC|, |Spearman|, pass@k, F1, precision,
    recall)."""
    return any(b in name.lower() for b in BOUNDED)


def y_limits(values, bounded: bool, reference: float | None = None) -> tuple[float, float]:
    """(bottom, top) of a panel holding ``values`` and the line ``reference`` (chance), per the module's rule."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if reference is not None and math.isfinite(reference):
        vals.append(float(reference))
    if bounded:  # 0 .. 1, widened only if a value lies outside (a signed correlation)
        lo, hi = min([0.0, *vals]), max([1.0, *vals])
        return lo - 0.02 * (hi - lo), hi + 0.02 * (hi - lo)
    if not vals:
        return 0.0, 1.0
    lo, hi = min(vals), max(vals)
    mid = (lo + hi) / 2
    span = max(hi - lo, MIN_SPAN_ABS, MIN_SPAN_REL * abs(mid))
    lo, hi = min(lo, mid - span / 2), max(hi, mid + span / 2)
    return lo - PAD * span, hi + PAD * span


def chance_levels(labels) -> dict:
    """{"accuracy": frequency of the commonest target, "loss": entropy of the targets (nats)} of an iterable of
    supervised target ids; {} when there is none."""
    counts = Counter(int(t) for t in labels)
    n = sum(counts.values())
    if not n:
        return {}
    return {"accuracy": max(counts.values()) / n,
            "loss": -sum(c / n * math.log(c / n) for c in counts.values())}


def depth_panels(columns) -> list[str]:
    """The metric columns a depth figure draws: the first bounded metric, then the loss (either may be absent;
    with neither, the first metric). The rest (BLiMP's per-phenomenon accuracies) stay in the JSON."""
    metrics = list(columns[1:])
    bounded = [c for c in metrics if is_bounded(c)][:1]
    loss = [c for c in metrics if c == "loss"]
    return bounded + loss or metrics[:1]


def plot_depth(columns, rows, title: str, path: Path, chance: dict | None = None) -> Path:
    """Metric against K, one panel per :func:`depth_panels` column side by side, the K axis at integers and
    ``chance`` ({"accuracy": a, "loss": l}) drawn as a dotted line where it applies. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chance = chance or {}
    names = depth_panels(columns)
    ks = [int(r[0]) for r in rows]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        j = list(columns).index(name)
        ys = [float(r[j]) for r in rows]
        ref = chance.get("accuracy" if is_bounded(name) else "loss" if name == "loss" else None)
        ax.plot(ks, ys, marker="o")
        if ref is not None:
            ax.axhline(ref, color="grey", ls=":", label=f"chance {ref:.3f}")
            ax.legend(fontsize=8)
        ax.set_ylim(*y_limits(ys, is_bounded(name), ref))
        ax.set_xticks(ks)
        ax.set(xlabel="core iterations K", ylabel=name + (" (nats)" if name == "loss" else ""))
        ax.grid(alpha=0.3)
    _title(fig, title, len(names))
    return save_figure(fig, path)


def plot_validation(history: list[dict], train: list[tuple[int, float]], path: Path,
                    chance: dict | None = None, title: str = "validation") -> Path | None:
    """validation.png: the training loss and every val/loss* curve (Eco-RNA: one per K) against the step, beside
    every val/accuracy* curve when the family logs accuracy; chance dotted in both. None without a val/loss."""
    def keys(prefix):
        return sorted({k for rec in history for k in rec if k.startswith(prefix)},
                      key=lambda k: (len(k), k))  # val/loss_K2 before val/loss_K16
    losses, accs = keys("val/loss"), keys("val/accuracy") or keys("val/f1")  # a structure task's F1
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chance = chance or {}
    fig, axes = plt.subplots(1, 2 if accs else 1, figsize=(11 if accs else 6, 4), squeeze=False)
    panels = [(axes[0][0], losses, "loss", "loss (nats per supervised token)", False)]
    if accs:
        panels.append((axes[0][1], accs, "accuracy", "held-out accuracy", True))
    for ax, names, kind, ylabel, bounded in panels:
        shown = []
        if kind == "loss" and train:
            ax.plot([s for s, _ in train], [v for _, v in train], color="lightgrey", lw=1, label="training loss")
            shown += [v for _, v in train]
        for k in names:
            pts = [(rec["step"], rec[k]) for rec in history if k in rec]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                    label="held-out " + k.removeprefix("val/"))
            shown += [p[1] for p in pts]
        ref = chance.get(kind)
        if ref is not None:
            ax.axhline(ref, color="grey", ls=":", label=f"chance {ref:.3f}")
        ax.set_ylim(*y_limits(shown, bounded, ref))
        ax.set(xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _title(fig, title, len(panels))
    return save_figure(fig, path)


def _title(fig, title: str, panels: int) -> None:
    """A title wrapped to the figure's width (a long checkpoint path would run off a one-panel figure)."""
    lines = [textwrap.fill(part, 75 * panels) for part in title.split("\n")]
    fig.suptitle("\n".join(lines), fontsize=9)
    fig.tight_layout()


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Write ``fig`` as the PNG ``path`` whole (a reader, MLflow or a browser, never sees half a PNG) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_curves(columns, rows, title: str, path: Path) -> Path:
    """A learning-curve figure: every metric column against the first (words seen), one panel each, words on a log
    axis (the milestones are spaced 1M, 10M, 100M apart), bounded metrics on 0 .. 1 (the y-range rule above).
    Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(columns[1:])
    xs = [float(r[0]) for r in rows]
    cols = min(3, len(names))
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.5 * nrows), squeeze=False)
    for i, name in enumerate(names):
        ax = axes[i // cols][i % cols]
        ys = [float(r[i + 1]) for r in rows]
        ax.plot(xs, ys, marker="o")
        if len(set(xs)) > 1 and min(xs) > 0:
            ax.set_xscale("log")
        # accuracies and correlations (a task folder's headline) live in [-1, 1]: drawn on 0 .. 1, widened below 0
        ax.set_ylim(*y_limits(ys, all(-1 <= y <= 1 for y in ys), None))
        ax.set(xlabel=str(columns[0]) + " seen" if columns[0] == "words" else str(columns[0]), ylabel=name)
        ax.grid(alpha=0.3)
    for j in range(len(names), nrows * cols):
        axes[j // cols][j % cols].axis("off")
    _title(fig, title, cols)
    return save_figure(fig, path)
