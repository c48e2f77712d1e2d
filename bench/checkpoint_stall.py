#!/usr/bin/env python
"""Benchmark: how long a checkpoint save stalls the training step, written in the background
(checkpoint.background: true, pipeline/checkpoint/background.py) against synchronously (false), in one run.

    python bench/checkpoint_stall.py [--quick] [--ranks 1,2] [--steps 10] [--every 3] [--config eco_rna_80m]

For each rank count, two launches of the same training (torchrun, ZeRO-2, the shipped Rfam sample, the config's real
widths with a small batch: micro_batch_size 2 x context 128, no token budget, no loader workers) that differ only in
checkpoint.background, each saving every ``--every`` steps and keeping 2 (rotation included). The stall of a save is
what the run itself prints for it (pipeline/checkpoint/io.py): the seconds the step waited in Checkpointer.save
(synchronous: the whole save; background: the state copied to host memory, and the previous save if it was still
being written). Prints, per rank count R:

    RESULT CKPT.stall<R> <median background stall / median synchronous stall>
    RESULT CKPT.loss<R> <largest |loss difference| of a step between the two runs>   (0: bit for bit)

and each save's seconds, the background writes' seconds and both runs' median step times (the writer thread shares
the cores with the step). --quick: 2 ranks only, 5 steps, a save every 2 (3 saves a run); --config eco_rna_demo
runs the tiny demo model (what the test suite smoke-tests: its saves are too small for the ratio to mean much).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.engine import free_port  # noqa: E402

SAMPLE_FASTA = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"
SYNC = re.compile(r"^checkpoint (step\d+): written in ([0-9.]+) s")
BACKGROUND = re.compile(r"^checkpoint (step\d+): the step waited ([0-9.]+) s .* in the background in ([0-9.]+) s")


def launch(ranks: int, run_dir: Path, shards: Path, config: str, steps: int, every: int, background: bool) -> dict:
    """One training; its saves {tag: (stall seconds, background seconds or None)} and losses {step: loss}."""
    small = [] if config == "eco_rna_demo" else [
        "train.max_tokens_per_microbatch=null", "train.global_batch_tokens=null", "train.micro_batch_size=2",
        "train.grad_accum_steps=1", "data.context_length=128", "data.length_window=0", "data.shuffle_buffer=0"]
    overrides = [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}",
                 f"checkpoint.every_steps={every}", "checkpoint.keep_last=2", "data.num_workers=0",
                 "tracking.enabled=false", "train.log_every=1", f"checkpoint.background={str(background).lower()}",
                 *small]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), str(REPO / "launchers" / "pretrain.py"), "--ds_config",
           str(REPO / "ds_configs" / "zero2.json"), "--config", config, *[a for o in overrides for a in ("--set", o)]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]), file=sys.stderr)
        raise SystemExit(f"error: the training ({ranks} ranks, background {background}) exited {proc.returncode}")
    saves = {}
    for line in proc.stdout.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[rank") else line
        if m := SYNC.match(line):
            saves[m[1]] = (float(m[2]), None)
        elif m := BACKGROUND.match(line):
            saves[m[1]] = (float(m[2]), float(m[3]))
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    want = len(range(every, steps + 1, every)) + (steps % every != 0)
    if len(saves) != want:
        raise SystemExit(f"error: {len(saves)} save lines in the output of the run, expected {want}")
    return {"saves": saves, "losses": {r["step"]: r["loss"] for r in records},
            "step_time": statistics.median(r["step_time"] for r in records[1:])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 ranks, 5 steps, a save every 2")
    p.add_argument("--ranks", default=None, help="rank counts, comma-separated (default 1,2; --quick: 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per training (default 10)")
    p.add_argument("--every", type=int, default=None, help="checkpoint.every_steps (default 3)")
    p.add_argument("--config", default="eco_rna_80m", help="run config (default eco_rna_80m)")
    args = p.parse_args(argv)
    config = args.config
    steps, every = args.steps or (5 if args.quick else 10), args.every or (2 if args.quick else 3)
    ranks = [int(r) for r in (args.ranks or ("2" if args.quick else "1,2")).split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        tmp = Path(tmp)
        shards = tmp / "rfam"
        subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                        str(shards), "--shard-size", "300", "--progress", "off"], cwd=REPO, check=True,
                       capture_output=True)
        for r in ranks:
            runs = {}
            for background in (False, True):
                # the same run_dir for both (renamed after the first): their checkpoints' config is the same too
                run_dir = tmp / "run"
                runs[background] = launch(r, run_dir, shards, config, steps, every, background)
                run_dir.rename(tmp / f"run-{r}-{'background' if background else 'sync'}")
            sync, bg = runs[False], runs[True]
            for name, run in (("synchronous", sync), ("background", bg)):
                shown = ", ".join(f"{t} {s:.2f} s" + (f" (written in {w:.2f} s)" if w is not None else "")
                                  for t, (s, w) in run["saves"].items())
                print(f"{r} rank(s), {config}, {name}: the step waited {shown}; median step {run['step_time']:.2f} s")
            stall_sync = statistics.median(s for s, _ in sync["saves"].values())
            stall_bg = statistics.median(s for s, _ in bg["saves"].values())
            diff = max(abs(sync["losses"][k] - bg["losses"][k]) for k in sync["losses"])
            if sync["losses"].keys() != bg["losses"].keys():
                raise SystemExit("error: the two runs logged different steps")
            print(f"RESULT CKPT.stall{r} {stall_bg / stall_sync:.4f} median stall of a background save / of a "
                  f"synchronous one ({stall_bg:.3f} s / {stall_sync:.3f} s; {config}, ZeRO-2, {r} rank(s))")
            print(f"RESULT CKPT.loss{r} {diff:.3g} largest |loss difference| of a step, background against "
                  f"synchronous saves ({len(sync['losses'])} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
