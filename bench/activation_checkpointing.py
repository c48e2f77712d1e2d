#!/usr/bin/env python
"""Benchmark: what train.activation_checkpointing: blocks saves and costs on the Eco-RNA 80M config, in one run.

    python bench/activation_checkpointing.py [--quick] [--context 1024] [--rows 2] [--steps 3]

Each mode (none, blocks) runs in a fresh process: the shipped eco_rna_80m.yaml (its backward window of 4 core
applications and its depth law) at ``--context`` positions (default 1024), one microbatch of ``--rows`` real Rfam
sequences from the shipped sample (masked by the config's own transform, depths drawn by the family's own plan, the
same draws in both modes), forward + backward + AdamW ``--steps`` times. Reported per mode: the peak resident memory
above the process's footprint after the model and optimizer were built (ru_maxrss: activations, gradients, the
optimizer's state and allocator slack), and the median step time. The ratios blocks / none are the RESULT lines
(AC.memory, AC.step) bench/run_all.py collects; exit 1 when the two modes' losses differ.
``--quick`` (bench/run_all.py): 1 row, context 512, 2 steps.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SAMPLE = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def one_mode(mode: str, context: int, rows: int, steps: int) -> dict:
    import numpy as np
    import torch

    from data_prep.fasta import iter_fasta
    from pipeline.config import load_config
    from pipeline.data.batch import collate
    from pipeline.families import get_family
    from pipeline.parallel.checkpointing import apply_activation_checkpointing

    cfg = load_config(REPO / "launchers" / "configs" / "eco_rna_80m.yaml",
                      [f"data.context_length={context}", f"train.activation_checkpointing={mode}"])
    fam = get_family(cfg.family)
    torch.manual_seed(0)
    model = fam.build_model(cfg.model)
    if mode == "blocks":
        apply_activation_checkpointing(model, fam.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    transform = fam.make_transform(cfg)
    from pipeline.data.tokenizer import NucleotideTokenizer

    tok = NucleotideTokenizer("rna")
    long = sorted((tok.encode(r.seq) for r in iter_fasta(SAMPLE)), key=len, reverse=True)[:rows]
    samples = [transform(np.tile(s, context // len(s) + 1)[:context - 2], np.random.default_rng(i))
               for i, s in enumerate(long)]  # the longest records, repeated to fill the context
    batch = collate([{**s, "sample_id": str(i)} for i, s in enumerate(samples)], pad_id=fam.pad_id)
    base = peak_mb()
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        out = fam.loss(model, batch, cfg, fam.plan(batch, cfg, step=0, stream=0, index=0))
        (out.sum_loss / out.num_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"mode": mode, "peak_mb_above_model": peak_mb() - base, "step_s": statistics.median(times),
            "loss": float(out.sum_loss / out.num_tokens), "rows": rows, "context": context,
            "tokens": int(batch.attention_mask.sum())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", choices=("none", "blocks"), help=argparse.SUPPRESS)  # a child process's one mode
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.rows, args.steps = 512, 1, 2
    if args.mode:
        print(json.dumps(one_mode(args.mode, args.context, args.rows, args.steps)))
        return 0
    results = {}
    for mode in ("none", "blocks"):
        r = subprocess.run([sys.executable, __file__, "--mode", mode, "--context", str(args.context), "--rows",
                            str(args.rows), "--steps", str(args.steps)], capture_output=True, text=True, cwd=REPO)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        results[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        res = results[mode]
        print(f"{mode:6s}: peak memory above the model {res['peak_mb_above_model']:8.0f} MB, step "
              f"{res['step_s']:6.2f} s, loss {res['loss']:.4f} ({res['rows']} x {res['context']} positions)")
    a, b = results["none"], results["blocks"]
    mem, step = b["peak_mb_above_model"] / a["peak_mb_above_model"], b["step_s"] / a["step_s"]
    where = f"eco_rna_80m, {a['rows']} x {a['context']} positions"
    print(f"RESULT AC.memory {mem:.3f} peak memory above the model, blocks / none ({where})")
    print(f"RESULT AC.step {step:.3f} step time, blocks / none ({where})")
    return 0 if abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) else 1


if __name__ == "__main__":
    sys.exit(main())
