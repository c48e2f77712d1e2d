#!/usr/bin/env python
"""Does Eco-RNA's recurrence learn to use depth where depth is needed? The synthetic depth task (docs/depth_task.md).

    python bench/depth_task.py --out runs/depth_task                 # H = 3, S = 5, Q = 3, three training seeds
    python bench/depth_task.py --quick --out runs/depth_task_quick   # the same, one seed
    python bench/depth_task.py --models recurrent --set objective.train_depth=3 --out runs/dt_k3   # a variant

1. Data: ``python -m data_prep synthetic-hops`` writes the training set (pointer counts 0 .. H, a curriculum) and a
   held-out set at exactly H pointers that shares no record with it (``--exclude``), with S values per level and Q
   queries per record: S = 5 makes the record space too large to memorize, and Q = 3 answers per record make every
   training seed begin to read (docs/depth_task.md, "A record space too large to memorize").
2. Train, through the real launcher (``scripts/launch.sh launchers/pretrain.py``, ZeRO-2) with equal data, steps,
   width and batch, each model at its own peak lr (COMMON, *_LR below): the recurrent model
   (launchers/configs/eco_rna_depth_task.yaml: one shared block applied K times) in two stages, first at K = h,
   then (``--init-from`` the first, the last ``stage2`` of the steps) with the depth law of Eq. 12 over K = h .. 8
   (k_min h, k_cap 8, mu_K 6), which teaches it to keep the answer at every deeper K; and two fixed-depth
   controls of the same block (eco_rna_depth_task_control.yaml): one block, and h blocks, each one run of all the
   steps.
   ``--seeds`` are training seeds (initialization, loader order, depth draws).
3. Evaluate every run on the held-out set with ``launchers/evaluate.py``'s reconstruction runner at K = 1..8. The
   masking (``last_segment``) supervises the answer tokens alone, so its loss and accuracy are the answers'. Also
   the best count model: the most frequent training answer among training records with the same token counts.

Writes OUT/depth_task.json and OUT/depth_task.png (answer accuracy and loss against K, one line per model; the
controls are flat in K). The last line is ``depth task: K1 acc A1, Kh acc Ah, control-1 acc C1, control-h acc Ch``
(means over seeds, sd in brackets), with h = H + 1 reads: the answer position reads the query's offset, then one
level per pointer (a reader that fetches the query's target directly needs H). Exit 0 when the recurrent model's
accuracy at K = h is >= 0.9 and at K = 1 <= chance + 0.15, it falls by at most 0.05 from K = h to K = 8, control-1
stays <= chance + 0.15 and control-h (h blocks) reaches >= 0.9 (every figure a mean over seeds); 1 when not; 2 on
bad input or a failed step (the message names its log).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.depth_study import run, sd, train  # noqa: E402

CONFIG = ROOT / "launchers" / "configs" / "eco_rna_depth_task.yaml"
CONTROL = ROOT / "launchers" / "configs" / "eco_rna_depth_task_control.yaml"
DEPTHS = list(range(1, 9))
# (hops, slots, queries, training records, held-out records, steps, of which the recurrent model's second stage,
# seeds) of the full study and of --quick. Every model: width 128 (8 heads of 16) and microbatches of 64 records
# (the config's d = 64 and 32 records are the CI guard's, at H = 2); each at its own peak lr, the best of 5e-4,
# 1e-3 and 2e-3 measured (docs/depth_task.md, "Width and learning rate"): the recurrent model at 2e-3 (its second
# stage at 1e-3), the distinct-block controls at 5e-4 (at 2e-3 the 4-block control stays at chance for 3,500 steps
# on the S = 4 task).
FULL = dict(hops=3, slots=5, queries=3, records=200000, heldout=1000, steps=2000, stage2=500, seeds="0,1,2")
QUICK = dict(hops=3, slots=5, queries=3, records=200000, heldout=500, steps=2000, stage2=500, seeds="0")
COMMON = ["model.d_model=128", "model.n_heads=8", "model.n_kv_heads=4", "model.d_ff=512",
          "train.micro_batch_size=64"]
RECURRENT_LR, CONTROL_LR = "optim.lr=2e-3", "optim.lr=5e-4"
STAGE2_LR = "optim.lr=1e-3"


def make_data(out: Path, hops: int, slots: int, queries: int, records: int, heldout: int) -> tuple[Path, Path]:
    """Training shards (pointer counts 0 .. hops) and held-out shards (exactly hops, none in training), reused by a
    rerun when they hold exactly this task and count, else written again."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    sets = {"train": (0, 0, records, []), "heldout": (hops, 1, heldout, ["--exclude", str(data / "train")])}
    rewritten = False
    for name, (min_hops, seed, n, extra) in sets.items():
        task = {"hops": hops, "min_hops": min_hops, "slots": slots, "queries": queries, "seed": seed}
        if rewritten or not _holds(data / name, task, n):  # a new training set needs a new held-out set
            run([sys.executable, "-m", "data_prep", "synthetic-hops", "--hops", str(hops), "--min-hops",
                 str(min_hops), "--slots", str(slots), "--queries", str(queries), "--records", str(n),
                 "--seed", str(seed), *extra, "--output", str(data / name), "--overwrite"], data / f"{name}.log")
            rewritten = True
    return data / "train", data / "heldout"


def _holds(directory: Path, task: dict, records: int) -> bool:
    from pipeline.data.shards import load_manifest

    if not (directory / "manifest.json").is_file():
        return False
    manifest = load_manifest(directory)
    return manifest.stats.get("task") == task and sum(s.samples for s in manifest.shards) == records


def evaluate(run_dir: str, heldout: Path) -> dict:
    """{"accuracy": {K: acc}, "loss": {K: loss}} of a run's last checkpoint on the held-out answers, through
    ``launchers/evaluate.py --task reconstruction`` (seed 0: the initial-state table)."""
    from launchers.evaluate import run_reconstruction
    from pipeline.checkpoint import load_trained_model

    per_k = run_reconstruction(load_trained_model(run_dir), heldout, DEPTHS, seed=0)["per_depth"]
    return {"accuracy": {k: per_k[str(k)]["accuracy"] for k in DEPTHS},
            "loss": {k: per_k[str(k)]["loss"] for k in DEPTHS}}


def count_model(train_dir: Path, held_dir: Path) -> float:
    """Accuracy on the held-out answers of the best predictor that sees only the token counts of the record: for the
    j-th answer, the most frequent training j-th answer among training records with the same count vector of the
    question (the tokens up to <sep>), else the most frequent j-th answer."""
    from launchers.evaluate import read_sequences
    from pipeline.data.tokenizer import SEP_ID

    def split(tokens):  # [(count vector of the question and j, j-th answer)]
        sep = tokens.tolist().index(SEP_ID)
        question = tuple(sorted(Counter(tokens[:sep + 1].tolist()).items()))
        return [((question, j), int(a)) for j, a in enumerate(tokens[sep + 1:])]

    table, overall = defaultdict(Counter), defaultdict(Counter)
    for tokens in read_sequences(train_dir, "rna"):
        for key, answer in split(tokens):
            table[key][answer] += 1
            overall[key[1]][answer] += 1
    hits = n = 0
    for tokens in read_sequences(held_dir, "rna"):
        for key, answer in split(tokens):
            guess = (table[key] or overall[key[1]]).most_common(1)[0][0]
            hits, n = hits + (guess == answer), n + 1
    return hits / n


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), sd(xs)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.eval.plots import y_limits

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, runs in result["runs"].items():
        for ax, metric in zip(axes, ("accuracy", "loss")):
            per_k = [[r[metric][str(k)] for r in runs] for k in DEPTHS]
            ax.errorbar(DEPTHS, [statistics.mean(v) for v in per_k], yerr=[sd(v) if len(v) > 1 else 0 for v in per_k],
                        marker="o", capsize=3, label=name)
    axes[0].axhline(result["chance"], color="grey", ls=":", label="chance")
    axes[0].axvline(result["depth"], color="grey", ls="--", lw=0.8)
    axes[0].set(xlabel="K (core applications)", ylabel="held-out answer accuracy", ylim=(0, 1.02))
    axes[1].set(xlabel="K (core applications)", ylabel="held-out answer loss (nats)")
    losses = [v for runs in result["runs"].values() for r in runs for v in r["loss"].values()]
    axes[1].set_ylim(*y_limits(losses, bounded=False))  # a flat loss stays flat (pipeline/eval/plots.py)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"synthetic depth task: H = {result['hops']} pointers, h = {result['depth']} reads, "
                 f"S = {result['slots']} values (chance {result['chance']:.2f}), Q = {result['queries']} queries; "
                 f"{result['steps']} steps, {len(result['seeds'])} training seeds (mean, sd)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(result: dict) -> tuple[bool, dict]:
    """The acceptance figures (means over seeds) and whether they all hold."""
    h, chance = result["depth"], result["chance"]
    acc = lambda name, k: mean_sd([r["accuracy"][str(k)] for r in result["runs"][name]])  # noqa: E731
    figures = {"K1": acc("recurrent", 1), "Kh": acc("recurrent", h), "K8": acc("recurrent", 8),
               "control-1": acc("control-1", 1), "control-h": acc("control-h", 1)}
    ok = (figures["Kh"][0] >= 0.9 and figures["K1"][0] <= chance + 0.15
          and figures["Kh"][0] - figures["K8"][0] <= 0.05
          and figures["control-1"][0] <= chance + 0.15 and figures["control-h"][0] >= 0.9)
    return ok, figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="study directory (data, runs, JSON, plot)")
    p.add_argument("--quick", action="store_true", help=f"one training seed: {QUICK}")
    p.add_argument("--hops", type=int, default=None, help=f"pointers of the held-out answers (default {FULL['hops']})")
    p.add_argument("--slots", type=int, default=None,
                   help=f"values and slots per level of the task (default {FULL['slots']}; chance 1 / slots)")
    p.add_argument("--queries", type=int, default=None,
                   help=f"queries (answers) per record (default {FULL['queries']})")
    p.add_argument("--seeds", default=None, help=f"training seeds (default {FULL['seeds']})")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps of every model (default {FULL['steps']})")
    p.add_argument("--stage2-steps", type=int, default=None,
                   help=f"of which the recurrent model's second stage, the depth law (default {FULL['stage2']}; "
                        "0: one stage at K = h)")
    p.add_argument("--records", type=int, default=None, help=f"training records (default {FULL['records']})")
    p.add_argument("--models", default="recurrent,control-1,control-h",
                   help="which of recurrent, control-1, control-h to train")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the recurrent model")
    p.add_argument("--nproc", type=int, default=1)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    hops, slots = args.hops or preset["hops"], args.slots or preset["slots"]
    queries = args.queries or preset["queries"]
    steps, records = args.steps or preset["steps"], args.records or preset["records"]
    stage2 = preset["stage2"] if args.stage2_steps is None else args.stage2_steps
    models = [m for m in args.models.split(",") if m]
    try:
        from data_prep.synthetic import HopsTask
        from pipeline.eval.cli import parse_depths

        seeds = parse_depths(args.seeds or preset["seeds"], "--seeds", maximum=2**31 - 1, minimum=0)
        if hops < 2 or hops > 7:
            raise ValueError(f"--hops must lie in 2 .. 7 (below 2 the record space is small enough to memorize; "
                             f"h = H + 1 reads must be <= 8, the deepest K read out), got {hops}")
        HopsTask(hops, 0, slots, queries)  # the flag that is out of range, named as data_prep names it
        unknown = set(models) - {"recurrent", "control-1", "control-h"}
        if unknown or "recurrent" not in models:
            raise ValueError(f"--models: recurrent plus any of control-1, control-h, got {args.models!r}")
        if steps < 1 or records < 1:
            raise ValueError("--steps and --records must be >= 1")
        if not 0 <= stage2 < steps:
            raise ValueError(f"--stage2-steps must lie in 0 .. --steps - 1 ({steps - 1}), got {stage2}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    depth = hops + 1  # h: the answer reads the query, then one level per pointer
    result = {"hops": hops, "depth": depth, "seeds": seeds, "steps": steps, "stage2_steps": stage2,
              "slots": slots, "queries": queries, "records": records, "chance": 1 / slots, "runs": {}}
    # (config, overrides, steps) of each stage: the recurrent model's second stage starts from its first
    law = ["objective.depth_law=poisson_lognormal", f"objective.k_min={depth}", "objective.k_cap=8",
           "objective.mu_k=6", "objective.sigma_k=0.5", f"objective.backward_window={depth}", STAGE2_LR]
    plan = {"recurrent": [(CONFIG, [*COMMON, RECURRENT_LR, f"objective.train_depth={depth}",
                                    f"objective.backward_window={depth}", *args.sets], steps - stage2)]
            + ([(CONFIG, [*COMMON, *law, *args.sets], stage2)] if stage2 else []),
            "control-1": [(CONTROL, [*COMMON, CONTROL_LR, "model.n_core=1"], steps)],
            "control-h": [(CONTROL, [*COMMON, CONTROL_LR, f"model.n_core={depth}"], steps)]}
    try:
        train_dir, held_dir = make_data(out, hops, slots, queries, records, preset["heldout"])
        result["count_model_accuracy"] = count_model(train_dir, held_dir)
        for name in models:
            result["runs"][name] = []
            for seed in seeds:
                print(f"training {name} seed {seed} ...", flush=True)
                init, seconds = [], 0.0
                for i, (config, sets, n) in enumerate(plan[name]):
                    info = train(f"{name}-seed{seed}" + (f"-stage{i + 1}" if len(plan[name]) > 1 else ""), config,
                                 train_dir, out, n, [f"seed={seed}", *sets, *init], args.nproc)
                    init, seconds = [f"train.init_from={info['run_dir']}"], seconds + info["train_seconds"]
                info.update(evaluate(info["run_dir"], held_dir), seed=seed, train_seconds=seconds,
                            stages=[{"config": str(c), "sets": st, "steps": n} for c, st, n in plan[name]])
                info["accuracy"] = {str(k): v for k, v in info["accuracy"].items()}
                info["loss"] = {str(k): v for k, v in info["loss"].items()}
                result["runs"][name].append(info)
                print(f"  {info['train_seconds']:.0f} s; held-out accuracy by K: "
                      + " ".join(f"{info['accuracy'][str(k)]:.3f}" for k in DEPTHS), flush=True)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(f"held-out: {held_dir} (H = {hops} pointers, h = {depth} reads); chance {1 / slots:.3f}; count model "
          f"{result['count_model_accuracy']:.3f}")
    print(f"{'model':>10} | " + " | ".join(f"{f'K={k}':<13}" for k in DEPTHS))
    for name, runs in result["runs"].items():
        cells = [mean_sd([r["accuracy"][str(k)] for r in runs]) for k in DEPTHS]
        print(f"{name:>10} | " + " | ".join(f"{m:.3f} ({s:.3f})" if s == s else f"{m:<13.3f}" for m, s in cells))
    if set(models) == {"recurrent", "control-1", "control-h"}:
        ok, fig = verdict(result)
    else:
        ok, fig = False, {"K1": mean_sd([r["accuracy"]["1"] for r in result["runs"]["recurrent"]]),
                          "Kh": mean_sd([r["accuracy"][str(depth)] for r in result["runs"]["recurrent"]])}
    result.update(figures=fig, accepted=ok)
    (out / "depth_task.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "depth_task.png")
    f = lambda key: f"{fig[key][0]:.3f} (sd {fig[key][1]:.3f})" if key in fig else "n/a"  # noqa: E731
    print(f"depth task: K1 acc {f('K1')}, Kh acc {f('Kh')}, control-1 acc {f('control-1')}, "
          f"control-h acc {f('control-h')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
