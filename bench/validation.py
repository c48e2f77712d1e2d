#!/usr/bin/env python
"""Benchmark: what validation on a cadence costs a training run (docs/training.md, "Validation during training").

    python bench/validation.py [--quick] [--steps 100] [--every 50] [--nproc 1]

One launch of the demo Eco-RNA (launchers/configs/eco_rna_demo.yaml: d 128, context 128, 8 rows x 2 microbatches
per step, ZeRO-2) on the shipped Rfam sample split by ``data_prep --val-fraction 0.1`` (1,899 training and 208
held-out sequences), with the shipped validation settings (eval.max_samples 1000, so all 208; batch 16; K = 1, 2,
4, 8) every ``--every`` steps. Both sides come from the run's own clock: the run logs each evaluation's seconds
(val/seconds) and its cumulative share of the run's time (val/time_share), and this script reads the last one from
metrics.jsonl. Prints ``RESULT VAL.overhead <share>`` (validation seconds / (training + validation seconds)) and
``RESULT VAL.per_eval <ratio>`` (one evaluation / one median training step). --quick: 40 steps, every 20.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.engine import free_port  # noqa: E402

SAMPLE_FASTA = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"
CONFIG = REPO / "launchers" / "configs" / "eco_rna_demo.yaml"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40 steps, validation every 20")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 100)")
    p.add_argument("--every", type=int, default=None, help="eval.every (default 50)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (default 1)")
    args = p.parse_args(argv)
    steps = args.steps or (40 if args.quick else 100)
    every = args.every or (20 if args.quick else 50)
    if steps < every or every < 1 or args.nproc < 1:
        p.error("need --steps >= --every >= 1 and --nproc >= 1")
    with tempfile.TemporaryDirectory(prefix="bench_validation_") as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                        str(tmp / "rna"), "--shard-size", "300", "--val-fraction", "0.1", "--progress", "off"],
                       cwd=REPO, check=True, capture_output=True)
        run = tmp / "run"
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.nproc), "--master_port",
               str(free_port()), str(REPO / "launchers" / "pretrain.py"), "--ds_config",
               str(REPO / "ds_configs" / "zero2.json"), "--config", str(CONFIG)]
        for o in (f"data.train_shards={tmp / 'rna' / 'train'}", f"run_dir={run}", f"train.max_steps={steps}",
                  f"eval.every={every}", f"checkpoint.every_steps={steps}", "tracking.enabled=false"):
            cmd += ["--set", o]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]), file=sys.stderr)
            print(f"error: the training exited with {proc.returncode}", file=sys.stderr)
            return 1
        records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]
    evals = [r for r in records if "val/seconds" in r]
    step_time = statistics.median(r["step_time"] for r in records[2:])
    per_eval = statistics.median(r["val/seconds"] for r in evals)
    share = evals[-1]["val/time_share"]
    print(f"{len(records)} steps, {len(evals)} validations of the 208 held-out sequences "
          f"at K = 1, 2, 4, 8; median step {step_time * 1000:.0f} ms, median validation {per_eval:.2f} s")
    print(f"RESULT VAL.overhead {share:.4f} validation share of the run's time (every {every} steps, {args.nproc} "
          "rank(s), demo Eco-RNA)")
    print(f"RESULT VAL.per_eval {per_eval / step_time:.2f} one validation (208 sequences, K = 1, 2, 4, 8) / one "
          "median training step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
