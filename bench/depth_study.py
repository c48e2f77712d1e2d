#!/usr/bin/env python
"""Paper 000's central result on real RNA: does held-out reconstruction improve with recurrent depth?

    python bench/depth_study.py --out runs/depth_study                      # the Eco-RNA demo config
    python bench/depth_study.py --out runs/ds_nofp --set objective.lambda_fp=0 --steps 1500

1. Split. Without ``--data``, the shipped pair data/samples/rfam_nrc_{train,heldout}_sample.fasta.gz (disjoint
   records of one nRC Rfam file; a fresh clone has them). ``--data`` FASTA(.gz) is split by record index: record i
   is held out when i % --heldout-every == 0, byte-exact, so the two files share no record; with ``--heldout`` as
   well, --data is used whole for training and --heldout is the held-out file.
2. Train. The training file is sharded with ``data_prep rnacentral`` and trained by the real launcher
   (``scripts/launch.sh launchers/pretrain.py --ds_config ds_configs/zero2.json``, --nproc processes) with
   --config (the Eco-RNA demo) and beside it the fixed-depth control --control-config: same data, steps, batch,
   optimizer and schedule (``--set`` overrides go to both; ``--set-eco`` / ``--set-control`` to one).
3. Evaluate. Every evaluation seed gives new crops, masks and initial-state table (launchers/evaluate.py
   --task reconstruction --seed S); each seed's sweep runs one trajectory read out at every K in --depths.

With ``--checkpoint RUN`` (a run dir, checkpoint or export; and ``--control-checkpoint RUN``) nothing is trained:
step 3 runs on those and ``--heldout`` (default: the shipped held-out sample, which the quickstart's training on the
shipped train sample never saw), e.g. after ``bash scripts/quickstart.sh``. A DeepSpeed checkpoint given this
way follows launchers/evaluate.py's pickle rule: read when its files hold only tensors and DeepSpeed's own classes,
else only with --trust-checkpoint.

Reported: the held-out loss per K (mean and standard deviation over the seeds), the control's loss, and the
K=1 -> K=4 difference d = L(1) - L(4) with its spread: the largest of the seed standard deviations of L(1), of L(4)
and of the paired per-seed difference (the first two are the larger: a seed's masks move every depth's loss
together). The effect is shown when d > 3 x spread. Writes OUT/depth_study.json; exit 0
when shown, 1 when not, 2 on bad input or a failed training (the message names its log).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.eval.cli import TRUST_FLAG, TRUST_HELP  # noqa: E402

SAMPLE_TRAIN = ROOT / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"
SAMPLE_HELDOUT = ROOT / "data" / "samples" / "rfam_nrc_heldout_sample.fasta.gz"
DEMO = ROOT / "launchers" / "configs" / "eco_rna_demo.yaml"
CONTROL_DEMO = ROOT / "launchers" / "configs" / "eco_rna_control_demo.yaml"


def split_fasta(src: Path, every: int, train: Path, heldout: Path) -> tuple[int, int]:
    """Write record i of ``src`` to ``heldout`` when i % every == 0, else to ``train``, byte-exact (line endings
    kept); (train records, held-out records). Text before the first header is an error naming the line."""
    import gzip

    opener = gzip.open if src.suffix == ".gz" else open
    counts = [0, 0]
    with opener(src, "rb") as f, open(train, "wb") as ft, open(heldout, "wb") as fh:
        out, index = None, -1
        for n, line in enumerate(f, 1):
            if line.startswith(b">"):
                index += 1
                side = index % every == 0
                out = fh if side else ft
                counts[side] += 1
            elif out is None:
                if line.strip():
                    raise ValueError(f"{src}:{n}: sequence text before the first '>' header")
                continue
            out.write(line)
    if counts[1] == 0 or counts[0] == 0:
        raise ValueError(f"{src}: {counts[0]} training and {counts[1]} held-out records with --heldout-every "
                         f"{every}; both must be non-empty")
    return counts[0], counts[1]


def run(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run ``cmd`` (no shell) with stdout+stderr to ``log``; its wall seconds. A failure names the log."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {rc}; see {log}")
    return time.perf_counter() - t0


def train(name: str, config: Path, shards: Path, out: Path, steps: int | None, sets: list[str], nproc: int) -> dict:
    run_dir = out / name
    cmd = ["bash", "scripts/launch.sh", "launchers/pretrain.py", "--ds_config", "ds_configs/zero2.json",
           "--config", str(config), "--set", f"run_dir={run_dir}", "--set", f"data.train_shards={shards}",
           "--set", "tracking.enabled=false", "--resume", "never"]
    if steps is not None:
        cmd += ["--set", f"train.max_steps={steps}", "--set", f"checkpoint.every_steps={steps}"]
    for s in sets:
        cmd += ["--set", s]
    # scripts/launch.sh reads both: PY, so the runner and its workers use this interpreter (a CUDA image has no .venv)
    seconds = run(cmd, out / f"{name}.log", env={**os.environ, "NPROC": str(nproc), "PY": sys.executable})
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return {"run_dir": str(run_dir), "train_seconds": round(seconds, 1), "steps": last["step"],
            "train_loss": last["mlm_loss"], "tokens": last["total/tokens"], "flops": last["total/flops"]}


def evaluate(run_dir: str, heldout: Path, depths: list[int], seeds: list[int],
             trusted: bool = False) -> dict[int, list[float]]:
    """{K: [held-out loss per seed]} of a run's last checkpoint (or a checkpoint, or an export): per seed,
    ``launchers/evaluate.py --task reconstruction --seed S``'s sweep."""
    from launchers.evaluate import run_reconstruction
    from pipeline.checkpoint import load_trained_model

    trained = load_trained_model(run_dir, trusted)
    per_seed = [run_reconstruction(trained, heldout, depths, seed)["per_depth"] for seed in seeds]
    return {k: [r[str(k)]["loss"] for r in per_seed] for k in depths}


def parse_seeds(text: str) -> list[int]:
    """``"0-4"``, ``"0,7,9"`` -> sorted unique non-negative ints."""
    from pipeline.eval.cli import parse_depths

    return parse_depths(text, "--seeds", maximum=2**32 - 1, minimum=0)


def sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="study directory (data, shards, runs, JSON)")
    p.add_argument("--data", type=Path, default=None, help="FASTA(.gz) to split (default: the shipped train and "
                   "held-out samples, unsplit)")
    p.add_argument("--heldout", type=Path, default=None, help="held-out FASTA(.gz): --data is then not split")
    p.add_argument("--heldout-every", type=int, default=10)
    p.add_argument("--config", type=Path, default=DEMO)
    p.add_argument("--control-config", type=Path, default=CONTROL_DEMO)
    p.add_argument("--no-control", action="store_true", help="train and evaluate only the recurrent model")
    p.add_argument("--steps", type=int, default=None, help="train.max_steps of both runs (default: the config's)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="both runs")
    p.add_argument("--set-eco", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--set-control", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seeds", default="0-4", help="evaluation seeds, e.g. 0-4 or 0,7,9")
    p.add_argument("--depths", default="1-8")
    p.add_argument("--checkpoint", type=Path, default=None, help="evaluate this Eco-RNA run; train nothing")
    p.add_argument("--control-checkpoint", type=Path, default=None, help="with --checkpoint: the control's run")
    p.add_argument(TRUST_FLAG, action="store_true", help=TRUST_HELP)
    args = p.parse_args(argv)
    try:
        from pipeline.checkpoint import resolve_tag_dir
        from pipeline.eval.cli import parse_depths, require_trust

        depths = parse_depths(args.depths)
        seeds = parse_seeds(args.seeds)
        if not {1, 4} <= set(depths):
            raise ValueError("--depths must include 1 and 4 (the reported difference)")
        if len(seeds) < 2:
            raise ValueError("--seeds: at least two evaluation seeds (the spread needs them)")
        if args.heldout_every < 2:
            raise ValueError(f"--heldout-every must be >= 2, got {args.heldout_every}")
        if args.data is None:
            data, args.heldout = SAMPLE_TRAIN, args.heldout or SAMPLE_HELDOUT
        else:
            data = args.data
        files = [args.heldout] if args.checkpoint else [data, args.heldout, args.config,
                                                        None if args.no_control else args.control_config]
        for path in files:
            if path is not None and not path.is_file():
                raise FileNotFoundError(f"{path}: no such file")
        for path in (args.checkpoint, args.control_checkpoint):
            if path is not None:
                if not path.is_dir():
                    raise FileNotFoundError(f"{path}: no such run directory")
                require_trust(resolve_tag_dir(path), args.trust_checkpoint)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = {"seeds": seeds, "depths": depths, "runs": {}}
    if args.checkpoint is not None:
        heldout = args.heldout
        runs = {"eco_rna": {"run_dir": str(args.checkpoint)}}
        if args.control_checkpoint is not None:
            runs["control"] = {"run_dir": str(args.control_checkpoint)}
    else:
        if args.heldout is None:
            (out / "data").mkdir(exist_ok=True)
            train_fa, heldout = out / "data" / "train.fasta", out / "data" / "heldout.fasta"
            result["train_records"], result["heldout_records"] = split_fasta(data, args.heldout_every, train_fa,
                                                                             heldout)
        else:
            train_fa, heldout = data, args.heldout
        result["data"] = str(data)
        shards = out / "shards"
        plan = {"eco_rna": (args.config, args.sets + args.set_eco)}
        if not args.no_control:
            plan["control"] = (args.control_config, args.sets + args.set_control)
        runs = {}
        try:  # a failed step raises RuntimeError naming its log
            if not (shards / "manifest.json").is_file():
                run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(train_fa), "--output",
                     str(shards), "--shard-size", "500"], out / "data_prep.log")
            for name, (config, sets) in plan.items():
                print(f"training {name} ({config.name}) ...", flush=True)
                runs[name] = train(name, config, shards, out, args.steps, sets, args.nproc)
                runs[name].update(config=str(config), sets=sets)
                print(f"  {runs[name]['steps']} steps in {runs[name]['train_seconds']:.0f} s, final training "
                      f"loss {runs[name]['train_loss']:.4f}", flush=True)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    result["heldout"] = str(heldout)
    for name, info in runs.items():
        losses = evaluate(info["run_dir"], heldout, depths if name == "eco_rna" else [1], seeds,
                          args.trust_checkpoint)
        info["heldout_loss"] = {str(k): v for k, v in losses.items()}
        result["runs"][name] = info

    eco = {int(k): v for k, v in result["runs"]["eco_rna"]["heldout_loss"].items()}
    diffs = [a - b for a, b in zip(eco[1], eco[4])]
    diff = statistics.mean(diffs)
    spread = max(sd(eco[1]), sd(eco[4]), sd(diffs))
    shown = diff > 3 * spread
    result.update({"diff_k1_k4": diff, "diff_per_seed": diffs, "spread": spread, "shown": shown})

    print(f"held-out: {heldout} ({len(seeds)} evaluation seeds {seeds})")
    print(f"{'K':>3} | {'loss mean':>9} | {'seed sd':>8}")
    for k in depths:
        print(f"{k:>3} | {statistics.mean(eco[k]):9.4f} | {sd(eco[k]):8.5f}")
    if "control" in result["runs"]:
        c = result["runs"]["control"]["heldout_loss"]["1"]
        print(f"control (fixed depth, same budget): {statistics.mean(c):.4f} (seed sd {sd(c):.5f})")
    print(f"K=1 -> K=4: {diff:+.4f} (per seed {', '.join(f'{d:+.4f}' for d in diffs)}; their sd {sd(diffs):.5f}); "
          f"spread {spread:.5f}; {'shown' if shown else 'not shown'} (needs > 3 x spread = {3 * spread:.5f})")
    (out / "depth_study.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if shown else 1


if __name__ == "__main__":
    sys.exit(main())
