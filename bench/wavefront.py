#!/usr/bin/env python
"""Benchmark: right-aligned wavefront (active rows only) vs running every row to K_max (Parcae-style padding).

    python bench/wavefront.py [--d-model 256 --batch 16 --length 256 --mu-k 4 --repeats 3]

Prints, from one run: executed row-iterations of both schedules (the wavefront's equals sum K_i), their ratio, and
the measured forward+backward time ratio. Depths come from the paper's Poisson-lognormal law.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state  # noqa: E402
from pipeline.objectives.eco_rna import EcoRNAObjectiveConfig, sample_depths  # noqa: E402


def timed(fn, repeats):
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--mu-k", type=float, default=4.0)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = EcoRNAConfig(d_model=args.d_model, n_heads=args.d_model // 64, n_kv_heads=max(1, args.d_model // 128),
                       d_ff=4 * args.d_model, n_prelude=1, n_core=2, n_coda=1)
    model = EcoRNA(cfg)
    depths = sample_depths(args.batch, EcoRNAObjectiveConfig(mu_k=args.mu_k), torch.Generator().manual_seed(1))
    k_max = int(depths.max())
    tokens = torch.randint(6, 12, (args.batch, args.length))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    s0 = initial_state(cfg, mask, torch.Generator().manual_seed(2))

    def step(ds):
        model.zero_grad(set_to_none=True)
        out = model(tokens, mask, ds, s0, k_max=k_max, backward_window=args.window)
        out.logits.float().logsumexp(-1).mean().backward()
        return out.row_iterations

    wave_iters = step(depths)
    padded_iters = step(torch.full_like(depths, k_max))  # every row computed for K_max steps
    t_wave = timed(lambda: step(depths), args.repeats)
    t_pad = timed(lambda: step(torch.full_like(depths, k_max)), args.repeats)
    print(f"depths {sorted(depths.tolist())}  (sum {int(depths.sum())}, K_max {k_max})")
    print(f"row-iterations: wavefront {wave_iters} (= sum K_i: {wave_iters == int(depths.sum())}), "
          f"padded {padded_iters}, ratio {wave_iters / padded_iters:.3f}")
    print(f"fwd+bwd time:   wavefront {t_wave * 1e3:.1f} ms, padded {t_pad * 1e3:.1f} ms, ratio {t_wave / t_pad:.3f}")


if __name__ == "__main__":
    main()
