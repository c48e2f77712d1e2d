#!/usr/bin/env python
"""FLOPs a training step executes against the FLOPs its MFU counts, per family (docs/performance.md, "FLOPs executed
against accounted").

    python bench/flops_check.py [--quick] [--config launchers/configs/protlingo_150m.yaml ...] [--set KEY=VALUE ...]
                                [--full-width]

MFU (pipeline/train/callbacks.py, Throughput) divides the "flops" total each objective reports for its microbatch
(pipeline/objectives: Eco-RNA's ``train_flops`` of the drawn depths, ProtLingo's ``train_flops`` of its padded and
real tokens, the causal LMs' 3 x forward) by the step time. This script runs, per config (CONFIGS by default: Eco-RNA
80M and its fixed-depth control, ProtLingo 150M with MoE and memory, RecursiveGPT 100M, the standard GPT baseline),
the family's training step on one microbatch, ``family.plan`` then ``family.loss`` then the backward of its loss, on
the bare model (no DeepSpeed engine: ZeRO adds no multiply to the model's), under torch.utils.flop_counter's
FlopCounterMode, and prints executed / accounted as ``RESULT FLOPS.<config> <ratio>`` (target <= 1.10, and exact
today: tests/bench/test_flops_check.py).

The microbatch is bench/step_proxies.py's counted one (step_batch: 4 rows x 128 tokens, 128/117/96/70 real, so
padding and attention both matter; the family's own sample transform and batching, data.pack included; the plans of
step OPS_STEP, Eco-RNA's depths [4, 3, 2, 9]: K_max 9 > the backward window 4, the anchor readout), on the config's
narrow twin (Proxies.narrow: widths shrunk, every block, head, expert and layer kept, so every term of the count
is met; --full-width: the real widths, the same ratio).

Counting rules (CPU_RULES) where FlopCounterMode as shipped with torch 2.13 does not count what a step executes:

* ``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its backward), the kernel every attention of every
  family calls on the CPU, has no formula: attention would count zero. Counted with torch's SDPA formula: forward
  QK^T and PV, 4 B H Lq Lk hd; backward their four gradient products, 8 B H Lq Lk hd (twice the forward, as for
  every matmul). torch's formula for the CUDA kernels' backward adds a fifth product, the scores the flash backward
  recomputes (10 B H Lq Lk hd): hardware FLOPs, which MFU leaves out as it leaves out the recompute of activation
  checkpointing (the step here runs without it).
* ``aten::convolution_backward``'s weight gradient ignores ``groups``: ProtLingo's depthwise memory convolution
  (groups = d) was counted d times over. Counted as the forward convolution's multiplies once for the input
  gradient and once for the weight gradient, whatever the groups.
* FlopCounterMode's module tracker hooks the backward of every module input and fails on Eco-RNA's wavefront (core
  calls without grad outside the backward window, on inputs that require it); the count here is global (GLOBAL).

Elementwise work (norms, softmax, activations, the MoE dispatch, the memory's lookup) counts in neither total.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import step_proxies as sp  # noqa: E402

CONFIGS = ("eco_rna_80m", "eco_rna_control_stage_a", "protlingo_150m", "recursive_gpt_100m", "standard_h384")
TARGET = 1.10  # executed / accounted, at most (and at least 1 / TARGET: tests/bench/test_flops_check.py)


def _sdpa_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """QK^T and PV: 2 x 2 B H Lq Lk hd (query [B, H, Lq, hd], key/value [B, Hkv, Lk, hd]: grouped heads broadcast)."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def _sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q: twice the forward (no recompute of the scores: MFU's
    model FLOPs, module docstring)."""
    return 2 * _sdpa_forward(query, key, value)


def _conv_backward(grad_out, x, w, bias, stride, padding, dilation, transposed, output_padding, groups, output_mask,
                   out_shape=None, **kwargs) -> int:
    """The input gradient and the weight gradient each multiply as often as the forward convolution did (grouped or
    not): x [B, C_in, L], w [C_out, C_in / groups, k], grad_out [B, C_out, L_out]."""
    from torch.utils.flop_counter import conv_flop_count

    return conv_flop_count(x, w, grad_out, transposed) * (int(output_mask[0]) + int(output_mask[1]))


def cpu_rules() -> dict:
    """FlopCounterMode ``custom_mapping`` of the rules in the module docstring (op overload packet -> formula over
    the argument shapes)."""
    import torch

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
            aten.convolution_backward: _conv_backward}


class GLOBAL:
    """Stands in for FlopCounterMode's module tracker: every FLOP counted under "Global" only."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def counting():
    """A FlopCounterMode with the CPU rules and a global count: ``with counting() as c: ...; c.get_total_flops()``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=cpu_rules())
    counter.mod_tracker = GLOBAL()  # module docstring: the tracker's backward hooks fail on no-grad core calls
    with counter:
        yield counter


def check(config, overrides=(), *, full_width: bool = False, index: int = 0, batch: dict | None = None) -> dict:
    """One microbatch's training step under counting() -> {"executed", "accounted", "ratio", "by_op" {aten op:
    FLOPs}, "params", "shape" (rows, length), "real_tokens"}. ``config``: a path or a name in launchers/configs;
    ``overrides`` after the bench's own (step_proxies.OPS_RUN, the narrow twin); ``batch``: step_batch's rows,
    length, lengths."""
    import torch

    from pipeline.families import get_family

    path = Path(config) if Path(config).suffix else REPO / "launchers" / "configs" / f"{config}.yaml"
    cfg = sp.ops_config(overrides, path)
    if not full_width:
        cfg = sp.ops_config(sp.width_twin(cfg) + list(overrides), path)
    family = get_family(cfg.family)
    torch.manual_seed(cfg.seed)
    model = family.build_model(cfg.model)
    b = sp.step_batch(cfg, family, index, **(batch or {}))
    plan = family.plan(b, cfg, step=sp.OPS_STEP, stream=b.origin[0], index=b.origin[1])
    with counting() as counter:
        out = family.loss(model, b, cfg, plan)
        out.sum_loss.backward()
    executed, accounted = counter.get_total_flops(), int(out.totals["flops"])
    return {"executed": executed, "accounted": accounted, "ratio": executed / accounted,
            "by_op": {str(k): v for k, v in counter.get_flop_counts()["Global"].items()},
            "params": sum(p.numel() for p in model.parameters()), "shape": tuple(b.input_ids.shape),
            "real_tokens": int(b.attention_mask.sum()), "family": cfg.family}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="accepted for bench/run_all.py (the run is seconds anyway)")
    p.add_argument("--config", action="append", default=None,
                   help=f"a config file or name (repeatable; default: {', '.join(CONFIGS)})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override after the bench's own, for every config (repeatable)")
    p.add_argument("--full-width", action="store_true", help="the configs' own widths instead of their narrow twins")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    worst = 0.0
    for config in args.config or CONFIGS:
        t = time.perf_counter()
        r = check(config, args.set, full_width=args.full_width)
        name = Path(config).stem
        ops = ", ".join(f"{k.removeprefix('aten.')} {v / r['executed']:.1%}" for k, v in
                        sorted(r["by_op"].items(), key=lambda kv: -kv[1]))
        print(f"{name} ({r['family']}, {r['params'] / 1e6:.2f}M parameters{'' if args.full_width else ', narrow twin'}"
              f", {r['shape'][0]} x {r['shape'][1]}, {r['real_tokens']} real tokens): executed {r['executed']:,} "
              f"accounted {r['accounted']:,} FLOPs ({ops}; {time.perf_counter() - t:.1f} s)", flush=True)
        print(f"RESULT FLOPS.{name} {r['ratio']:.4f} FLOPs one training microbatch executes (FlopCounterMode, CPU, "
              f"forward + backward) / the FLOPs its objective reports for MFU; target <= {TARGET}")
        worst = max(worst, r["ratio"], 1 / r["ratio"])
    print(f"worst executed/accounted (or its inverse) {worst:.4f}; total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
