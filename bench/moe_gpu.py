#!/usr/bin/env python
"""Benchmark (CUDA): one ProtLingo MoE layer on the reference path against MegaBlocks' grouped GEMM, forward+backward.

    python bench/moe_gpu.py [--tokens 16384 --d-model 640 --d-ff 2560 --experts 4 --repeats 20 --rounds 3]

Default: ESM2-150M's MoE layer (d = 640, d_ff = 2560 split into a shared expert of 1280 units and 4 routed experts of
1280, top-1), 16 rows x 1024 = 16384 real tokens, bf16. "layer" is UpcycledMoE.forward as training runs it (fp32
router, straight-through weight, shared expert, losses) plus the backward to its input and every parameter;
"experts" is compute_experts alone on the same routing, forward+backward. Paths, each where it can run here:

    torch        the reference: one fc1/fc2 pair per expert on its own tokens (model.moe_backend: torch)
    megablocks   MegaBlocks' grouped GEMM (grouped_gemm's kernel, as mlp_impl='grouped'): model.moe_backend: megablocks
    grouped_mm   torch.nn.functional.grouped_mm in the same grouped path, for comparison
    loop         the same grouped path with one torch.mm per expert segment (the kernel the CPU tests use)

Prints, from one run: ms per layer and per expert block (median over --rounds, each the mean of --repeats timed
calls after warm-up, paths interleaved within a round), the speed ratio reference / path per MoE layer, and the
largest output difference from the reference in bf16. Exits with one line where torch sees no CUDA device;
``--dry-run`` runs every step on the CPU in fp32 with a tiny layer (DRY_RUN) and times it with the CPU clock: it
checks the script (tests/bench/test_bench_quick.py), measures nothing, and exits 1 when a path that ran is not within
1e-4 of the reference.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.models.protlingo import ProtLingoConfig, UpcycledMoE  # noqa: E402
from pipeline.parallel import megablocks as mb  # noqa: E402


# The full run's sizes (ESM2-150M's layer) and --dry-run's (a CPU smoke run of seconds).
FULL = dict(tokens=16384, d_model=640, d_ff=2560, experts=4, repeats=20, rounds=3)
DRY_RUN = dict(tokens=1024, d_model=32, d_ff=64, experts=4, repeats=1, rounds=1)


def timed_ms(fn, repeats: int, cuda: bool = True) -> float:
    """Mean ms of ``fn`` over ``repeats`` calls, between CUDA events (the CPU clock when not ``cuda``), after one
    untimed call."""
    fn()
    if not cuda:  # --dry-run
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) * 1e3 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults None: a flag given wins, else FULL's value or, with --dry-run, DRY_RUN's.
    p.add_argument("--tokens", type=int, default=None, help="real tokens per layer call (rows of 1024; default 16384)")
    p.add_argument("--d-model", type=int, default=None, help="default 640")
    p.add_argument("--d-ff", type=int, default=None, help="dense FFN width; half of it is the shared expert (2560)")
    p.add_argument("--experts", type=int, default=None, help="default 4")
    p.add_argument("--repeats", type=int, default=None, help="default 20")
    p.add_argument("--rounds", type=int, default=None, help="default 3")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, fp32, a tiny layer: checks the script, measures nothing")
    args = p.parse_args(argv)
    for k, v in (DRY_RUN if args.dry_run else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("bench/moe_gpu.py: needs a CUDA device (torch sees none); --dry-run checks the script on the CPU")
    if args.tokens % 1024 or args.tokens < 1024:
        sys.exit(f"bench/moe_gpu.py: --tokens must be a positive multiple of 1024, got {args.tokens}")
    if min(args.d_model, args.d_ff, args.experts, args.repeats, args.rounds) < 1 or args.d_ff % 2:
        sys.exit("bench/moe_gpu.py: --d-model, --experts, --repeats and --rounds must be >= 1 and --d-ff a positive "
                 "even number")
    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)

    cfg = ProtLingoConfig(d_model=args.d_model, n_heads=1, n_layers=1, d_ff=args.d_ff,
                          moe_layers=[0], num_experts=args.experts)
    torch.manual_seed(0)
    reference = UpcycledMoE(cfg).to(device, dtype)
    with torch.no_grad():  # ProtLingo's init (N(0, 0.02) weights and router), with non-zero biases as after training
        for name, t in reference.named_parameters():
            t.normal_(0.0, cfg.router_init_std if name.startswith("router") else cfg.init_std)
    paths = {"torch": reference}
    skipped = {}
    for name, kernel in (("megablocks", "grouped_gemm"), ("grouped_mm", "torch"), ("loop", "loop")):
        try:
            paths[name] = mb.apply_megablocks(copy.deepcopy(reference), kernel)
        except (mb.MegaBlocksUnavailable, RuntimeError) as e:
            skipped[name] = str(e)

    rows = args.tokens // 1024
    x = torch.randn(rows, 1024, args.d_model, device=device, dtype=dtype)  # LayerNorm-like input
    mask = torch.ones(rows, 1024, dtype=torch.bool, device=device)
    g = torch.randn_like(x)  # the gradient arriving from above
    with torch.no_grad():
        expert, _, info = reference.route(x[mask])
    flat = x[mask].detach()

    def layer_step(moe):
        def step():
            moe.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_()
            y, info = moe(xi, mask)
            ((y * g).sum().float() + info.aux + info.z).backward()
        return step

    def expert_step(moe):
        def step():
            moe.zero_grad(set_to_none=True)
            xi = flat.detach().requires_grad_()
            (moe.compute_experts(xi, expert) * g[mask]).sum().backward()
        return step

    with torch.no_grad():
        y_ref = reference(x, mask)[0].float()
        diffs = {n: (m(x, mask)[0].float() - y_ref).abs().max().item() for n, m in paths.items()}
    times = {n: {"layer": [], "experts": []} for n in paths}
    for _ in range(args.rounds):
        for n, m in paths.items():
            times[n]["layer"].append(timed_ms(layer_step(m), args.repeats, device == "cuda"))
            times[n]["experts"].append(timed_ms(expert_step(m), args.repeats, device == "cuda"))
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}

    counts = info.counts.long().tolist()
    if args.dry_run:
        print(f"dry run: CPU, torch {torch.__version__}; fp32, times meaningless")
    else:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; bf16")
    print(f"MoE layer: d {args.d_model}, shared {cfg.shared_hidden} + {args.experts} routed x "
          f"{args.d_ff - cfg.shared_hidden} hidden, top-1, {args.tokens} tokens (per expert {counts}); "
          f"forward+backward, median of {args.rounds} rounds x {args.repeats} calls")
    ref = med["torch"]
    print(f"{'path':<12}{'layer ms':>10}{'ratio':>8}{'experts ms':>12}{'ratio':>8}{'max |dy|':>11}")
    for n in paths:
        print(f"{n:<12}{med[n]['layer']:>10.3f}{ref['layer'] / med[n]['layer']:>8.2f}{med[n]['experts']:>12.3f}"
              f"{ref['experts'] / med[n]['experts']:>8.2f}{diffs[n]:>11.2e}")
    print(f"ratio = reference ms / path ms per MoE layer (> 1: faster than the reference); max |y_ref| "
          f"{y_ref.abs().max().item():.3f}")
    for n, why in skipped.items():
        print(f"{n}: not run ({why})")
    if args.dry_run:  # fp32: every path computes the reference's sums in another order, nothing more
        bad = [n for n, d in diffs.items() if not d <= 1e-4]
        if bad:
            print(f"dry run: FAIL: {', '.join(bad)} differ from the reference by more than 1e-4")
            return 1
        print(f"dry run: ok ({', '.join(paths)} ran; within 1e-4 of the reference)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
