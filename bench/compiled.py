#!/usr/bin/env python
"""train.compile: blocks on the CPU, where the GPU's two costs of a step can be counted: graphs and host work.

    python bench/compiled.py [--quick] [--steps 100] [--host-steps 12] [--config launchers/configs/eco_rna_80m.yaml]

- COMPILE: the family's compiled regions (Family.compiled: Eco-RNA's core step, prelude and readout) against the
  same model eager, over ``--steps`` real loader steps (forward, loss and backward; the shipped Rfam sample, the
  config's length windows and token buckets at a 2,048-token budget so that 100 steps fit a CPU minute; the SHAPES
  model, d 64), on the padded layout (the CPU's) and on the packed layout (the GPU's, its attention through the
  varlen_sdpa operator here): graphs built, graph breaks, and the largest relative difference of the losses.
  Targets (issue 47): no graph break, graphs within the compile bound (RECOMPILE_LIMIT: never falling back to
  eager), losses equal to fp32 tolerance.
- HOST: the host's work per training step. A step of the host twin (every width shrunk to nothing: d 24 in 12
  heads of 2, SwiGLU width 16, rows of 16 tokens; every count kept: blocks, heads, the depth law, the rows of a
  microbatch, ZeRO-2's parameter tensors) computes next to nothing, so its wall time is what the host does to
  dispatch it: the Python, the dispatcher and, on a GPU, the launches. Measured on a real DeepSpeed engine
  (ZeRO-2, one process), median over ``--host-steps`` steps after warm-up, eager and compiled, at the microbatch
  the 80M config fixed before auto (32 rows, 16,384 tokens) and at the one auto picks on an H200 (256 rows,
  131,072 tokens). HOST.step: the eager step over the compiled one at the same microbatch; HOST.token: host work
  per token trained, the old shipped step (eager, 16,384 tokens) over the new (compiled, the auto microbatch).

Prints ``RESULT <ID> <value> <description>`` lines (bench/run_all.py's format). --quick: 20 COMPILE steps, 8 host
steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import step_proxies as sp  # noqa: E402

# The host twin: widths to nothing, every count of the config kept (module docstring)
HOST_TWIN = ["model.d_model=24", "model.n_heads=12", "model.n_kv_heads=6", "model.d_ff=16", "data.context_length=16",
             "train.grad_accum_steps=1"]
COMPILE_BUDGET = 2048  # tokens a microbatch of the COMPILE census (the config's rules, a CPU-sized budget)


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compile_census(steps: int, layout: str, config: Path = sp.CONFIG, shards: Path | None = None) -> dict:
    """COMPILE over ``steps`` real loader steps on ``layout`` ("padded" or "packed"): {"graphs", "breaks",
    "loss_diff" and "grad_diff" (the largest relative difference of a step's loss, of a parameter's gradient),
    "steps", "shapes" (distinct core inputs), "buckets" (the config's token buckets)}."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from pipeline.config import load_config
    from pipeline.data.loader import make_loader
    from pipeline.parallel.kernels import apply_kernels, compiled_graphs
    from pipeline.train.plan import RunPlan

    torch._dynamo.reset()  # a fresh compile cache: one model per run, as in a training
    with tempfile.TemporaryDirectory(prefix="compiled_") as tmp:
        tmp = Path(tmp)
        shards, model_sets = sp.shape_data(config, tmp, shards)
        sets = model_sets + [f"data.train_shards={shards}", f"run_dir={tmp / 'run'}", "data.num_workers=0",
                             f"train.max_tokens_per_microbatch={COMPILE_BUDGET}", "train.global_batch_tokens=null",
                             "train.grad_accum_steps=1", f"model.unpad={'true' if layout == 'packed' else 'false'}",
                             "model.attn_backend=sdpa"]
        cfg = load_config(config, sets)
        plan = RunPlan(cfg, str(sp.DS_CONFIG), resume="never", world_size=1)
        family = plan.family
        torch.manual_seed(cfg.seed)
        eager = family.build_model(cfg.model)
        compiled = family.build_model(cfg.model)
        compiled.load_state_dict(eager.state_dict())
        for m, mode in ((eager, "none"), (compiled, "blocks")):
            run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=mode))
            apply_kernels(m, run, family.compiled or family.blocks)
        graphs, breaks = compiled_graphs(), sum(counters["graph_break"].values())
        loader = make_loader(plan.build_dataset(0), 0)
        worst, shapes = 0.0, set()
        core = family.proxies.core or family.blocks
        hooks = [m.register_forward_pre_hook(lambda mod, a: shapes.add((*a[0].shape[:-1], torch.is_grad_enabled())))
                 for m in compiled.modules() if isinstance(m, core)]
        worst_grad = 0.0
        try:
            for step in range(steps):
                b = next(loader)
                losses, grads = [], []
                for m in (compiled, eager):
                    m.zero_grad(set_to_none=True)
                    p = family.plan(b, cfg, step=step, stream=b.origin[0], index=b.origin[1])
                    out = family.loss(m, b, cfg, p)
                    out.sum_loss.backward()
                    losses.append(float(out.sum_loss))
                    grads.append([q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q)
                                  for q in m.parameters()])
                worst = max(worst, relative(*losses))
                worst_grad = max(worst_grad, max(float((a - b).norm() / b.norm().clamp_min(1e-12))
                                                 for a, b in zip(*grads)))
        finally:
            for h in hooks:
                h.remove()
    return {"graphs": compiled_graphs() - graphs, "breaks": sum(counters["graph_break"].values()) - breaks,
            "loss_diff": worst, "grad_diff": worst_grad, "steps": steps, "shapes": len(shapes),
            "buckets": getattr(cfg.objective, "token_buckets", 0)}


VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "unsqueeze", "squeeze", "expand", "slice",
         "select", "detach", "alias", "as_strided", "split", "chunk", "unbind", "narrow", "view_as", "lift_fresh",
         "_reshape_alias", "unflatten", "flatten", "split_with_sizes", "_has_compatible_shallow_copy_type"}


def dispatches(prof) -> dict:
    """Top-level host dispatches of a profiled step: every aten or project operator not called by another, and every
    kernel inductor's code runs (its CPU kernels profiled: ``cpp.enable_kernel_profile``) -> {"all", "nonview",
    "kernels"}. On a GPU each non-view one is a launch (or a few); a view costs its dispatch alone."""
    def counted(e):
        return e.name.startswith(("aten::", "bioseq::")) or "cpp_fused" in e.name

    n = {"all": 0, "nonview": 0, "kernels": 0}
    for e in prof.events():
        if not counted(e):
            continue
        p = e.cpu_parent
        while p is not None and not counted(p):
            p = p.cpu_parent
        if p is None:
            n["all"] += 1
            n["kernels"] += "cpp_fused" in e.name
            n["nonview"] += e.name.removeprefix("aten::") not in VIEWS
    return n


def host_step(rows: int, compiled: bool, steps: int, config: Path = sp.CONFIG) -> dict:
    """A host-twin training step (module docstring) with a microbatch of ``rows`` rows: {"ms": median wall ms over
    ``steps`` steps after warm-up, and its dispatches (one more step, profiled)}."""
    import torch
    import torch._dynamo
    import torch._inductor.config
    from torch.profiler import ProfilerActivity, profile

    from pipeline.families import get_family
    from pipeline.train.step import train_step

    torch._inductor.config.cpp.enable_kernel_profile = True  # inductor's kernels as profiler events
    torch._dynamo.reset()  # a fresh compile cache: one model per run, as in a training
    cfg = sp.ops_config(HOST_TWIN + [f"train.micro_batch_size={rows}",
                                     f"train.compile={'blocks' if compiled else 'none'}"], config)
    family = get_family(cfg.family)
    engine = sp.build_engine(cfg)
    L = cfg.data.context_length
    micro = [sp.fixed_batch(cfg, 0, rows=rows, length=L, lengths=[L] * rows)]
    device = torch.device("cpu")
    times = []
    for i in range(steps + 3):  # 3 warm-up steps: the compiles, the optimizer's state
        t = time.perf_counter()
        train_step(engine, family, cfg, micro, sp.OPS_STEP, device)
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(engine, family, cfg, micro, sp.OPS_STEP, device)
    return {"ms": statistics.median(times[3:]) * 1000, **dispatches(prof)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 COMPILE steps, 8 host steps")
    p.add_argument("--steps", type=int, default=None, help="COMPILE loader steps (default 100, --quick 20)")
    p.add_argument("--host-steps", type=int, default=None, help="HOST steps timed (default 12, --quick 8)")
    p.add_argument("--config", type=Path, default=sp.CONFIG, help="run config (default: the Eco-RNA 80M)")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--skip-host", action="store_true")
    args = p.parse_args(argv)
    import torch

    from pipeline.config import load_config
    from pipeline.families import get_family
    from pipeline.parallel.kernels import RECOMPILE_LIMIT
    from pipeline.train.memory import microbatch_on

    torch.set_num_threads(1)  # the host's work, not the cores' share of tiny kernels
    steps = args.steps or (20 if args.quick else 100)
    host_steps = args.host_steps or (8 if args.quick else 12)
    t0 = time.perf_counter()
    if not args.skip_compile:
        for layout in ("padded", "packed"):
            t = time.perf_counter()
            r = compile_census(steps, layout, args.config)
            print(f"COMPILE {layout}: {r['steps']} loader steps of {COMPILE_BUDGET}-token microbatches, "
                  f"{r['shapes']} distinct core inputs ({time.perf_counter() - t:.0f} s)", flush=True)
            print(f"RESULT COMPILE.breaks.{layout} {r['breaks']} graph breaks in the compiled regions (target 0)")
            print(f"RESULT COMPILE.graphs.{layout} {r['graphs']} graphs built for {r['shapes']} distinct core inputs "
                  f"(target <= the {r['buckets']} token buckets; a region stops compiling at {RECOMPILE_LIMIT})")
            print(f"RESULT COMPILE.loss.{layout} {r['loss_diff']:.2e} largest relative difference of the compiled "
                  f"and eager losses (fp32; gradients {r['grad_diff']:.2e})")
    if not args.skip_host:
        cfg = load_config(args.config, [])
        old_rows = 16384 // cfg.data.context_length  # the budget the 80M config fixed before auto
        new_rows = microbatch_on(cfg, get_family(cfg.family)).tokens // cfg.data.context_length
        h = {}
        for rows in sorted({old_rows, new_rows}):
            for compiled in (False, True):
                r = h[(rows, compiled)] = host_step(rows, compiled, host_steps, args.config)
                print(f"HOST {rows} rows, {'compiled' if compiled else 'eager'}: {r['ms']:.1f} ms a step, "
                      f"{r['all']} dispatches ({r['nonview']} not views, {r['kernels']} of them inductor "
                      f"kernels)", flush=True)
        old, same, new = h[(old_rows, False)], h[(old_rows, True)], h[(new_rows, True)]
        print(f"RESULT HOST.step {old['all'] / same['all']:.2f} host dispatches of the eager step / the compiled "
              f"one, at the old shipped microbatch ({old_rows} rows; {old['nonview'] / same['nonview']:.2f} "
              f"without views; wall time {old['ms'] / same['ms']:.2f})")
        per_token = (old["all"] / old_rows) / (new["all"] / new_rows)
        print(f"RESULT HOST.token {per_token:.2f} host dispatches per token trained, today's shipped step (eager, "
              f"{old_rows} rows of 512) / the new one on an H200 (compiled, auto: {new_rows} rows); target >= 4 "
              f"(wall time {(old['ms'] / old_rows) / (new['ms'] / new_rows):.2f})")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    from pipeline.train import exit_process

    exit_process(code)
