"""Paper 000's own figures and Table 1 from what the project computes (tools/paper_figures.py is the command):

- Figure 1: forward FLOPs of one 512-nt sequence (the config's ``forward_flops``, Eq. A.9, log scale) against the
  type-balanced RNAGym |Spearman| (Eq. A.12) of ``launchers/evaluate.py --task rnagym``: one point per K of a
  recurrent checkpoint joined by a line, the fixed-depth control as a hollow marker, other models' points from a CSV
  the user supplies (``model,gflops,spearman``), and the Pareto frontier (:func:`pareto`) marked.
- Figure 3: per-assay |Spearman|, AUC and |MCC| against K (and the control beside K = 1), one row per assay (by
  default the first assay of each RNA type found) and the type-balanced aggregate as the last row.
- Table 1: held-out reconstruction loss at K = 1, 4, 8 of each checkpoint of a run (the computation of
  ``launchers/evaluate.py --task reconstruction``) and the K = 1 -> 4 reduction.

Numbers come from the JSON files launchers/evaluate.py writes or from the checkpoints themselves, never typed in.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from pipeline.eval.plots import _title, save_figure, y_limits

METRIC_NAMES = {"spearman": "|Spearman|", "auc": "AUC", "mcc": "|MCC|"}


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (lower or equal cost and higher or equal score, one of them
    strictly), by increasing cost: the compute-performance frontier of Figure 1."""
    out = []
    for i, (c, s) in enumerate(points):
        dominated = any((c2 <= c and s2 >= s) and (c2 < c or s2 > s) for j, (c2, s2) in enumerate(points) if j != i)
        if not dominated and not math.isnan(s):
            out.append(i)
    return sorted(out, key=lambda i: (points[i][0], -points[i][1]))


def read_result(path) -> dict:
    """An evaluation JSON of launchers/evaluate.py; ValueError naming the file when it is not one with per_depth."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable evaluation JSON ({e})") from None
    if not isinstance(doc, dict) or "per_depth" not in doc:
        raise ValueError(f"{path}: no per_depth (write it with launchers/evaluate.py --task rnagym)")
    return doc


def model_config(result: dict, source: Path, config: Path | None = None):
    """The RunConfig of the checkpoint an evaluation JSON was computed on (its "checkpoint" key), or ``config``."""
    from pipeline.config import build_config, load_yaml

    path = Path(config) if config is not None else Path(result.get("checkpoint", "")) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{source}: its checkpoint's config {path} is not there; pass --config for its model")
    return build_config(load_yaml(path))


def flops_points(result: dict, cfg, length: int) -> list[dict]:
    """[{"K", "gflops", "spearman", "auc", "mcc"}] of an RNAGym sweep, the FLOPs of one ``length``-token forward."""
    out = []
    for k, v in sorted(result["per_depth"].items(), key=lambda kv: int(kv[0])):
        agg = v["aggregate"]
        out.append({"K": int(k), "gflops": cfg.model.forward_flops(depth=int(k), length=length) / 1e9,
                    **{m: agg[m] for m in METRIC_NAMES}})
    return out


def read_others(path) -> list[dict]:
    """The user's CSV of other models: ``model,gflops,spearman`` (more columns ignored); errors name file:line."""
    path = Path(path)
    out = []
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in ("model", "gflops", "spearman") if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: needs the columns model, gflops, spearman (missing {', '.join(missing)})")
        for row in reader:
            try:
                g, s = float(row["gflops"]), float(row["spearman"])
            except ValueError:
                raise ValueError(f"{path}:{reader.line_num}: gflops and spearman must be numbers") from None
            if not g > 0:
                raise ValueError(f"{path}:{reader.line_num}: gflops must be > 0, got {g}")
            out.append({"model": row["model"], "gflops": g, "spearman": s})
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure1(ours: list[dict], label: str, control: dict | None, others: list[dict], path: Path, title: str) -> dict:
    """Figure 1 (module docstring); returns {"frontier": names of the points on it, "points": all points}."""
    plt = _plt()
    points = [(f"{label} K={p['K']}", p["gflops"], p["spearman"]) for p in ours]
    if control is not None:
        points.append((f"{control['label']} (fixed depth)", control["gflops"], control["spearman"]))
    points += [(o["model"], o["gflops"], o["spearman"]) for o in others]
    front = pareto([(g, s) for _, g, s in points])
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.plot([p["gflops"] for p in ours], [p["spearman"] for p in ours], "-o", color="#1b9e9e", label=label, zorder=3)
    for p in ours:
        ax.annotate(f"K={p['K']}", (p["gflops"], p["spearman"]), textcoords="offset points", xytext=(4, -10),
                    fontsize=7)
    if control is not None:
        ax.scatter([control["gflops"]], [control["spearman"]], s=70, facecolors="none", edgecolors="#1b9e9e",
                   linewidths=1.5, label=f"{control['label']} (fixed-depth control)", zorder=3)
    for o in others:
        ax.scatter([o["gflops"]], [o["spearman"]], color="#666666", zorder=3)
        ax.annotate(o["model"], (o["gflops"], o["spearman"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    fx, fy = [points[i][1] for i in front], [points[i][2] for i in front]
    ax.step(fx, fy, where="post", color="#d62728", ls="--", lw=1, label="Pareto frontier", zorder=2)
    ax.scatter(fx, fy, s=140, facecolors="none", edgecolors="#d62728", zorder=2)
    ax.set_xscale("log")
    ys = [s for _, _, s in points]
    ax.set_ylim(*y_limits(ys, False))
    ax.set(xlabel="forward GFLOPs of one 512-nt sequence (Eq. A.9, log scale)",
           ylabel="RNAGym |Spearman| (type-balanced, Eq. A.12)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    _title(fig, title, 1)
    save_figure(fig, path)
    return {"frontier": [points[i][0] for i in front],
            "points": [{"name": n, "gflops": g, "spearman": s} for n, g, s in points]}


def default_assays(result: dict) -> list[str]:
    """The first assay (by id) of each RNA type the sweep has, in the paper's type order."""
    from pipeline.eval.rnagym import RNA_TYPES

    per_assay = next(iter(result["per_depth"].values()))["per_assay"]
    return [min(a for a, v in per_assay.items() if v["rna_type"] == t) for t in RNA_TYPES
            if any(v["rna_type"] == t for v in per_assay.values())]


def figure3(result: dict, control: dict | None, assays: list[str], path: Path, title: str) -> list[list]:
    """Figure 3 (module docstring): a heat map per metric, rows = ``assays`` + the aggregate, columns = the control
    (when given) and each K. Returns the table drawn: [row name, column name, metric, value]."""
    plt = _plt()
    depths = sorted(result["per_depth"], key=int)
    missing = [a for a in assays if a not in result["per_depth"][depths[0]]["per_assay"]]
    if missing:
        raise ValueError(f"--assays: {', '.join(missing)} not in the sweep (it has "
                         f"{', '.join(sorted(result['per_depth'][depths[0]]['per_assay']))})")
    cols = (["control"] if control is not None else []) + [f"K={k}" for k in depths]
    rows = assays + ["aggregate"]

    def value(src: dict, k: str, row: str, m: str) -> float:
        block = src["per_depth"][k]
        return block["aggregate"][m] if row == "aggregate" else block["per_assay"][row][m]

    table = []
    fig, axes = plt.subplots(1, 3, figsize=(4 + 1.1 * len(cols) * 3, 1.0 + 0.5 * len(rows)), squeeze=False)
    for ax, m in zip(axes[0], METRIC_NAMES):
        grid = []
        for row in rows:
            line = []
            if control is not None:
                ck = next(iter(control["per_depth"]))
                line.append(value(control, ck, row, m) if row == "aggregate" or row in control["per_depth"][ck][
                    "per_assay"] else math.nan)
            line += [value(result, k, row, m) for k in depths]
            grid.append(line)
            table += [[row, c, m, v] for c, v in zip(cols, line)]
        ax.imshow(grid, cmap="viridis", aspect="auto", vmin=0, vmax=max(0.05, max(
            (v for line in grid for v in line if not math.isnan(v)), default=1)))
        for r, line in enumerate(grid):
            for c, v in enumerate(line):
                ax.text(c, r, "n/a" if math.isnan(v) else f"{v:.3f}", ha="center", va="center", fontsize=7,
                        color="white")
        ax.set_xticks(range(len(cols)), cols, fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_title(METRIC_NAMES[m], fontsize=9)
    _title(fig, title, 3)
    save_figure(fig, path)
    return table


def table1_rows(sweeps: list[tuple[int, dict]], depths: list[int]) -> list[list]:
    """[[step, loss at each K of ``depths``..., loss(K=1) - loss(K=4)]] of reconstruction sweeps by checkpoint."""
    out = []
    for step, per_k in sweeps:
        row = [step, *(per_k[k]["loss"] for k in depths)]
        row.append(per_k[1]["loss"] - per_k[4]["loss"] if 1 in per_k and 4 in per_k else math.nan)
        out.append(row)
    return out


def table1_plot(sweeps: list[tuple[int, dict]], depths: list[int], path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ys = []
    for step, per_k in sweeps:
        line = [per_k[k]["loss"] for k in depths]
        ax.plot(depths, line, "-o", label=f"step {step:,}")
        ys += line
    ax.set_xticks(depths)
    ax.set_ylim(*y_limits(ys, False))
    ax.set(xlabel="core iterations K", ylabel="held-out reconstruction loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _title(fig, title, 1)
    return save_figure(fig, path)
