#!/usr/bin/env python
"""Benchmark P1: the right-aligned depth wavefront against its own limit, as ratios measured in one run.

    python bench/wavefront.py [--quick] [--d-model 256 --batch 16 --length 256 --mu-k 4 --repeats 5]

Depths are drawn from the paper's Poisson-lognormal law (Eq. 12) for a batch of B rows; the first draw (seeds
1, 2, ...) whose sum is a multiple of B is used, so that a batch of uniform depth K_u = sum K_i / B executes exactly
as many core row-iterations. Printed, from one run:

- P1.waste: core row-iterations executed beyond sum K_i (must be 0: no padded row is ever computed);
- P1: forward + backward time of the sampled-depth batch / the uniform-depth batch with the same row-iterations,
  full backpropagation in both so that the backward work is equal too (target <= 1.10). What is left above 1 is
  the wavefront's bookkeeping: fewer rows per core call at the ragged start, and gathering the active rows;
- P1.gather: the share of the sampled-depth step's CPU time spent gathering and reordering rows (aten::cat, index,
  index_put, index_copy, argsort, from torch.profiler; target < 0.10);
- P1.vs_padded: time of the wavefront / the same batch run with every row to K_max (Parcae-style padding, which
  computes sum (K_max - K_i) row-iterations more), for scale;
- the same sampled/uniform ratio with the training backward window (truncated backprop), for information: there
  the two batches differentiate different numbers of iterations (sum min(K_i, W) vs B min(K_u, W)).

Times are medians over ``--repeats`` rounds, the setups interleaved within each round so that a slow spell of the
machine hits all of them alike. ``--quick`` (bench/run_all.py) uses shorter rows and takes about a minute.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state  # noqa: E402
from pipeline.objectives.eco_rna import EcoRNAObjectiveConfig, sample_depths  # noqa: E402

GATHER_OPS = {"aten::cat", "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_copy",
              "aten::index_copy_", "aten::argsort", "aten::sort"}


def depths_with_uniform_twin(batch: int, mu_k: float) -> torch.Tensor:
    """Depths [B] from the paper's law whose sum is a multiple of B (the first such seed), and not all equal."""
    law = EcoRNAObjectiveConfig(mu_k=mu_k)
    for seed in range(1, 10_000):
        depths = sample_depths(batch, law, torch.Generator().manual_seed(seed))
        if int(depths.sum()) % batch == 0 and int(depths.max()) > int(depths.min()):
            return depths
    raise SystemExit("bench/wavefront.py: no depth draw with a sum divisible by the batch size")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter rows, fewer repeats: about a minute")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--mu-k", type=float, default=4.0)
    p.add_argument("--window", type=int, default=4, help="training backward window, for the information line")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: a multi-threaded step stalls whenever another process takes a "
                        "core, which decides a ratio more than the schedule does)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:  # d 256 keeps the one-row core calls of the ragged start as efficient as on real model sizes
        args.length, args.repeats = 128, 3
    torch.manual_seed(0)
    cfg = EcoRNAConfig(d_model=args.d_model, n_heads=args.d_model // 64, n_kv_heads=max(1, args.d_model // 128),
                       d_ff=4 * args.d_model, n_prelude=1, n_core=2, n_coda=1, attn_backend="sdpa", unpad=False)
    model = EcoRNA(cfg)
    B = args.batch
    depths = depths_with_uniform_twin(B, args.mu_k)
    k_max, uniform_k = int(depths.max()), int(depths.sum()) // B
    uniform = torch.full_like(depths, uniform_k)
    padded = torch.full_like(depths, k_max)
    tokens = torch.randint(6, 12, (B, args.length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    s0 = initial_state(cfg, mask, torch.Generator().manual_seed(2))

    def step(ds, window=None):
        model.zero_grad(set_to_none=True)
        out = model(tokens, mask, ds, s0, backward_window=window)
        out.logits.float().logsumexp(-1).mean().backward()
        return out.row_iterations

    setups = {"sampled": lambda: step(depths), "uniform": lambda: step(uniform), "padded": lambda: step(padded),
              "sampled_w": lambda: step(depths, args.window), "uniform_w": lambda: step(uniform, args.window)}
    iterations = {name: fn() for name, fn in setups.items()}  # also the warm-up
    times = {name: [] for name in setups}
    for _ in range(args.repeats):
        for name, fn in setups.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(depths)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gather = sum(e.self_cpu_time_total for e in events if e.key in GATHER_OPS)

    waste = iterations["sampled"] - int(depths.sum())
    print(f"model: d {cfg.d_model}, 1 prelude + 2 core + 1 coda blocks, {B} rows x {args.length} tokens, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} interleaved rounds")
    print(f"depths {sorted(depths.tolist())} (sum {int(depths.sum())}, K_max {k_max}); uniform twin: every row at "
          f"K = {uniform_k}")
    print(f"row-iterations: wavefront {iterations['sampled']}, uniform {iterations['uniform']}, "
          f"padded to K_max {iterations['padded']}")
    for name in setups:
        print(f"  {name:<10} {med[name] * 1e3:8.1f} ms")
    print(f"RESULT P1.waste {waste} core row-iterations executed beyond sum K_i (target 0)")
    print(f"RESULT P1 {med['sampled'] / med['uniform']:.3f} wavefront fwd+bwd time / uniform-depth time at equal "
          "row-iterations, full backprop (target <= 1.10)")
    print(f"RESULT P1.gather {gather / total:.3f} share of the wavefront step's CPU time gathering/reordering rows "
          "(cat, index, argsort; target < 0.10)")
    print(f"RESULT P1.vs_padded {med['sampled'] / med['padded']:.3f} wavefront time / every row run to K_max "
          f"(row-iteration ratio {iterations['sampled'] / iterations['padded']:.3f})")
    print(f"info: with backward window {args.window}: sampled / uniform time "
          f"{med['sampled_w'] / med['uniform_w']:.3f} (unequal backward work)")
    if waste != 0:
        sys.exit("bench/wavefront.py: the wavefront computed padded row-iterations")


if __name__ == "__main__":
    main()
