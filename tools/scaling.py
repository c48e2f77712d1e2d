#!/usr/bin/env python
"""Scaling model: per-GPU communication, memory and step time of a run on N GPUs, from its config and ds_config.

    python tools/scaling.py --config eco_rna_80m --gpus 8,64,1024 --ds_config ds_configs/zero2.json
    python tools/scaling.py --config protlingo_150m --gpus 64 --ds_config ds_configs/zero2.json --ep 8 --json

Nothing is built but a parameter-shape skeleton on PyTorch's meta device (no memory, no weights), so it runs on a
laptop for a 1,024-GPU plan. --config is a file or a name in launchers/configs; --set overrides as in pretrain.py.

Scaling is weak (the per-GPU batch of the config, micro_batch_size x grad_accum_steps sequences, on every GPU), unless
the config pins train.global_batch_size: then each GPU takes global / N sequences (N must divide it).

Communication: bytes ONE GPU sends per optimizer step under the bandwidth-optimal algorithm of each collective on p
ranks (ring / NCCL): all-reduce 2 (p-1)/p n, reduce-scatter, all-gather and reduce (p-1)/p n of the full buffer,
all-to-all the bytes that leave the rank. What DeepSpeed 0.19.8 issues, as counted in real runs
(bench/comm_volume.py; docs/scaling.md):

* ZeRO-1: one all-reduce of every gradient per step, at the accumulation boundary; an all-gather of the updated
  parameters after the step.
* ZeRO-2: the same all-reduce once per MICROBATCH (gradients are reduced in every backward, into the partitions), then
  the all-gather after the step. ``use_multi_rank_bucket_allreduce: false`` replaces each bucket's all-reduce by one
  reduce per owning rank: half the bytes, p times the calls.
* ZeRO-3: per microbatch a reduce-scatter of the gradients, and an all-gather of a module's partitioned parameters at
  every call of that module, forward and backward (tensors at or below stage3_param_persistence_threshold stay
  whole: gathered once after each step). Eco-RNA's shared core is called K_max times in the forward and min(K_max, W)
  times in the backward of every microbatch, K_max being the maximum depth over every row of the microbatch on
  every rank (the ranks must call the core equally often), which grows with the number of GPUs. DeepSpeed's module
  trace lets it keep some parameters between calls when the call sequence repeats (stage3_max_reuse_distance), which
  a per-step random K_max mostly prevents: the figure here is the re-gather-every-call volume, exact with
  stage3_max_reuse_distance 0, an upper bound otherwise (docs/scaling.md gives the measured reuse).
* Expert parallelism (EP e): per MoE layer and microbatch four all-to-alls of the routed tokens (dispatch and
  combine, forward and backward), (e-1)/e of them leaving the rank under balanced routing; expert gradients reduce
  over the p / e ranks holding the same experts.
The engine's own per-step collectives (token counts, K_max, metrics; about 1 KB) are left out.

Memory per GPU: the training's memory model (pipeline/train/memory.py): weights, gradients, fp32 master weights and
the two AdamW moments, partitioned as the ZeRO stage does; the gradient bucket (ZeRO-2: reduce_bucket_size
elements); ZeRO-3's gathered parameters; and the activations autograd keeps at the configured microbatch, counted
per family from what its code saves (Eco-RNA differentiates its prelude, coda and the last W core iterations only;
with train.activation_checkpointing: blocks each differentiated block keeps only its input), plus one block's worth
for the backward's transient. Checked on the CPU against measured peaks within 10 % (tests/pipeline/
test_memory_model.py); on a GPU the kernels' own saves differ somewhat (bench/gpu.sh prints both).

Step time: compute = training FLOPs of the GPU's batch (the configs' own train-FLOP counts; Eco-RNA over its depth
law) / (--peak-tflops x --mfu), taken for the slowest rank (Eco-RNA's per-sequence depths make ranks unequal: the
expected maximum over N ranks of their sum of rows, per synchronization, normal approximation); communication = bytes / bandwidth + calls x latency, with NVLink inside a node
and InfiniBand between nodes (the per-GPU NIC bandwidth binds a ring that spans nodes); serial sum when the ds_config
has overlap_comm false (the shipped ones), max(compute, comm) when it is true. Efficiency = mean compute / step time.
H200 defaults: 790 TFLOP/s dense bf16 (what large GEMMs reach of the 989 TFLOP/s spec), MFU 0.4 of it, NVLink 4 at
360 GB/s per GPU per direction as NCCL bus bandwidth (of 450 GB/s), one 400 Gb/s NDR NIC per GPU at 45 GB/s
(of 50), and a collective latency of 10 us + 5 us x log2(p).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.train.memory import state_bytes  # noqa: E402

GB = 1e9
DS_DEFAULT_PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
DS_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)


@dataclass
class Hardware:
    peak_tflops: float = 790.0  # dense bf16 per GPU
    mfu: float = 0.4  # fraction of peak_tflops the model's kernels reach
    gpus_per_node: int = 8
    nvlink_gbs: float = 360.0  # GB/s per GPU per direction inside a node (NCCL bus bandwidth)
    ib_gbs: float = 45.0  # GB/s per GPU per direction between nodes (one NDR NIC per GPU)
    latency_us: float = 10.0  # per collective call ...
    latency_log_us: float = 5.0  # ... plus this per doubling of the group

    def bandwidth(self, group: int, spans_nodes: bool) -> float:
        return (self.ib_gbs if spans_nodes else self.nvlink_gbs) * GB if group > 1 else float("inf")

    def latency(self, group: int) -> float:
        return (self.latency_us + self.latency_log_us * math.log2(group)) * 1e-6 if group > 1 else 0.0


@dataclass
class Collective:
    """One kind of traffic of a step: bytes one GPU sends, the calls it takes, on a group of ``group`` ranks."""

    name: str
    phase: str  # when in a step: forward, backward (of each microbatch) or step (after the optimizer step)
    bytes: float
    calls: float
    group: int
    spans_nodes: bool

    def seconds(self, hw: Hardware) -> float:
        return self.bytes / hw.bandwidth(self.group, self.spans_nodes) + self.calls * hw.latency(self.group)


@dataclass
class Plan:
    family: str
    gpus: int
    nodes: int
    zero_stage: int
    ep: int
    micro_batch_size: int
    grad_accum_steps: int
    length: int
    k_max: float | None  # Eco-RNA: the expected K_max of a microbatch over every rank's rows
    params: int
    traffic: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    flops_per_gpu: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    step_s: float = 0.0
    efficiency: float = 0.0
    tokens_per_s: float = 0.0
    note: str = ""

    def comm_bytes(self) -> float:
        return sum(c.bytes for c in self.traffic)


# --------------------------------------------------------------------------------------------------------------------
# What the model is made of, and how often each part is called per microbatch
# --------------------------------------------------------------------------------------------------------------------
def param_shapes(cfg) -> list[tuple[str, int]]:
    """(name, numel) of every parameter, from a meta-device skeleton of the model (no memory, no initialization cost
    beyond the modules' constructors)."""
    import torch

    from pipeline.families import get_family

    with torch.device("meta"):
        model = get_family(cfg.family).build_model(cfg.model)
    return [(n, p.numel()) for n, p in model.named_parameters()]


def module_calls(cfg, k_max: int) -> dict[str, tuple[int, int]]:
    """{top-level parameter prefix: (forward calls, backward calls)} of one microbatch; prefixes not named: (1, 1).
    The family's ``Scaling.module_calls`` (e.g. Eco-RNA's core runs K_max wavefront steps of which the last W are
    differentiated; RecursiveGPT's shared block runs R times; tied heads are a second use of the embedding).
    tests/tools/test_scaling.py counts the real calls with module hooks and checks these."""
    return _scaling(cfg).module_calls(cfg, k_max)


def _scaling(cfg):
    from pipeline.families import get_family

    return get_family(cfg.family).scaling


def _calls(calls: dict, name: str) -> tuple[int, int]:
    return calls.get(name.split(".")[0], (1, 1))


def depth_law(cfg, rows: int) -> tuple[float, list[tuple[int, float]]]:
    """(E[K_max] over ``rows`` iid depth draws, [(K, P(K))]): the family's ``Scaling.depth_law`` (Eco-RNA's training
    law, Eq. 12 and its cap; the trained recurrence R for RecursiveGPT; one depth otherwise)."""
    return _scaling(cfg).depth_law(cfg, rows)


# --------------------------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------------------------
def _is_expert(name: str) -> bool:
    return ".deepspeed_experts." in name


def _activation_bytes(cfg, tokens: int, k_max: float, act_bytes: int) -> float:
    """Activations autograd keeps for one microbatch of ``tokens`` positions, bytes: the family's memory model
    (pipeline/train/memory.py, with the backward's transient)."""
    from pipeline.train.memory import StepMemory

    acts = _scaling(cfg).activations(cfg, act_bytes, k_max)
    return StepMemory({}, acts, cfg.train.activation_checkpointing == "blocks").per_token * tokens


def _train_flops_per_sequence(cfg, pmf: list) -> tuple[float, float]:
    """(mean, variance) of the training FLOPs of one sequence (forward + backward), from the config's own counts
    (the family's ``Scaling.train_flops``; Eco-RNA's vary with the sequence's drawn depth K)."""
    return _scaling(cfg).train_flops(cfg, pmf)


def expected_max_normal(n: int) -> float:
    """E[max of n iid standard normals] (0 for n = 1), by integrating x d(Phi(x)^n) on a fine grid."""
    if n <= 1:
        return 0.0
    import numpy as np
    from scipy.special import ndtr

    x = np.linspace(-8.0, 8.0, 16001)
    cdf_n = ndtr(x) ** n
    return float(np.sum((x[1:] + x[:-1]) / 2 * np.diff(cdf_n)))


def zero3_keeps_gathered(cfg, zero: dict, partitioned: int) -> bool:
    """Whether DeepSpeed ZeRO-3 keeps every gathered parameter until the microbatch's backward is done (measured in
    bench/comm_volume.py): only while its module trace is valid, i.e. the modules are called in the same sequence
    in every microbatch, and stage3_max_reuse_distance and stage3_max_live_parameters (DeepSpeed default 1e9 each)
    cover the partitioned parameters. Eco-RNA's per-step K_max breaks the sequence unless objective.fixed_wavefront
    (or a fixed depth) holds the core's call count; then each parameter is gathered once per microbatch. Otherwise
    every call gathers again (exact with stage3_max_reuse_distance 0; an upper bound in between)."""
    stable = not _scaling(cfg).per_step_depth(cfg)
    window = min(float(zero.get("stage3_max_reuse_distance", 1e9)), float(zero.get("stage3_max_live_parameters", 1e9)))
    return stable and window >= partitioned


def plan(cfg, ds_config: dict, gpus: int, hw: Hardware = Hardware(), ep: int | None = None,
         k_max: list | None = None) -> Plan:
    """The scaling model of ``cfg`` under the resolved ``ds_config`` on ``gpus`` GPUs (module docstring).

    ``k_max``: the K_max of each microbatch of the step, when known (a measured run); default its expectation."""
    t, z = cfg.train, ds_config.get("zero_optimization", {})
    stage = int(z.get("stage", 0))
    ep = ep or t.expert_parallel_size
    nodes = max(1, math.ceil(gpus / hw.gpus_per_node))
    spans = nodes > 1
    micro, ga = t.micro_batch_size, t.grad_accum_steps
    note = ""
    if t.global_batch_size is not None:  # pinned global batch: each GPU takes global / N sequences
        per_gpu = t.global_batch_size / gpus
        if per_gpu < 1 or per_gpu != int(per_gpu):
            note = (f"train.global_batch_size {t.global_batch_size} does not divide among {gpus} GPUs: "
                    "this global batch cannot run here")
            per_gpu = max(1, int(per_gpu))
        micro = min(int(per_gpu), t.micro_batch_size)
        ga = max(1, int(per_gpu) // micro)
    L = cfg.data.context_length
    tokens = micro * L
    exp_k_max, pmf = depth_law(cfg, micro * gpus)
    scaling = _scaling(cfg)
    wavefront = scaling.wavefront_depth(cfg)
    if wavefront is not None:  # a fixed wavefront: the same number of core steps in every microbatch
        exp_k_max = wavefront
    k_list = [float(k) for k in k_max] if k_max else [exp_k_max] * ga
    bf16 = ds_config.get("bf16", {}).get("enabled", False)
    w_bytes = 2 if bf16 else 4
    comm = ds_config.get("communication_data_type")
    g_bytes = {"fp32": 4, "fp16": 2, "bf16": 2}.get(comm, w_bytes)

    shapes = param_shapes(cfg)
    total = sum(n for _, n in shapes)
    experts = sum(n for name, n in shapes if _is_expert(name))
    dense = total - experts
    local_experts = experts / ep  # EP: each rank holds num_experts / ep of them
    expert_dp = gpus // ep
    traffic: list[Collective] = []

    def ring(n, p):
        return (p - 1) / p * n if p > 1 else 0.0

    # Gradients of the dense parameters over all ranks; of the experts over the ranks holding the same experts.
    multi_rank = z.get("use_multi_rank_bucket_allreduce", True)
    bucket = float(z.get("reduce_bucket_size", DS_DEFAULT_BUCKET))
    groups = [("dense", dense, gpus)] + ([("experts", local_experts, expert_dp)] if experts else [])
    for label, n, p in groups:
        if n == 0:
            continue
        calls = max(1.0, math.ceil(n / bucket))
        if stage == 3:
            traffic.append(Collective(f"gradient reduce-scatter ({label})", "backward", ga * ring(n * g_bytes, p), ga * calls, p,
                                      spans and p > hw.gpus_per_node))
            continue
        per_reduce = ga if stage == 2 else 1  # ZeRO-2 reduces in every backward, ZeRO-0/1 at the boundary
        if stage >= 1 and z.get("reduce_scatter", True) and not multi_rank:
            sent, calls = ring(n * g_bytes, p), calls * p  # one reduce per owning rank and bucket
            kind = "reduce"
        else:
            sent, kind = 2 * ring(n * g_bytes, p), "all-reduce"
        traffic.append(Collective(f"gradient {kind} ({label})", "backward", per_reduce * sent, per_reduce * calls, p,
                                  spans and p > hw.gpus_per_node))
        if stage in (1, 2):
            traffic.append(Collective(f"parameter all-gather after the step ({label})", "step", ring(n * w_bytes, p),
                                      max(1.0, math.ceil(n / float(z.get("allgather_bucket_size", 5e8)))), p,
                                      spans and p > hw.gpus_per_node))
    if stage == 3:
        threshold = int(z.get("stage3_param_persistence_threshold", DS_DEFAULT_PERSISTENCE))
        persistent = sum(n for _, n in shapes if n <= threshold)
        partitioned = total - persistent
        keep = zero3_keeps_gathered(cfg, z, partitioned)
        fwd = bwd = calls_fwd = calls_bwd = core = 0.0
        for name, n in shapes:
            if n <= threshold:
                continue
            for k in k_list:  # one microbatch at a time: the calls depend on its K_max
                f, b = (1, 0) if keep else _calls(module_calls(cfg, int(round(k))), name)
                fwd += f * n
                bwd += b * n
                calls_fwd += f
                calls_bwd += b
                if name.split(".")[0] in ("core", "block"):
                    core += (f + b) * n
        traffic.append(Collective("parameter all-gather, forward", "forward", ring(fwd * w_bytes, gpus), calls_fwd,
                                  gpus, spans))
        if bwd:
            traffic.append(Collective("parameter all-gather, backward", "backward", ring(bwd * w_bytes, gpus),
                                      calls_bwd, gpus, spans))
        traffic.append(Collective("persistent parameters after the step", "step", ring(persistent * w_bytes, gpus),
                                  1, gpus, spans))
        mode = ("kept gathered for the whole microbatch (a call sequence that repeats, reuse distance covering the "
                "partitioned parameters)" if keep else "re-gathered at every module call (an upper bound when "
                "stage3_max_reuse_distance > 0: measured 0.74 of it with a per-step K_max, docs/scaling.md; "
                "objective.fixed_wavefront keeps the core gathered)" if scaling.drawn_depth else
                "re-gathered at every module call")
        share = f"; the shared block's re-gathers are {core / (fwd + bwd):.0%} of them" if core and not keep else ""
        note = (note + "; " if note else "") + f"ZeRO-3 parameters {mode}{share}"
    if experts and ep > 1:
        moe_layers = len(cfg.model.moe_layers)
        # per MoE layer and microbatch: dispatch and combine in the forward, their gradients in the backward
        sent = 2 * moe_layers * ring(tokens * cfg.model.d_model * w_bytes, ep) * ga
        for phase in ("forward", "backward"):
            traffic.append(Collective(f"MoE all-to-all, {phase} (tokens to experts and back)", phase, sent,
                                      2 * moe_layers * ga, ep, ep > hw.gpus_per_node))

    # Memory per GPU: the states as the training's memory model counts them (pipeline/train/memory.py), the ZeRO-3
    # parameters gathered while in use, the activations
    states = state_bytes(shapes, zero_stage=stage, world=gpus, ep=ep, bf16=bf16, grad_bytes=g_bytes,
                         reduce_bucket=bucket, persistence=int(z.get("stage3_param_persistence_threshold",
                                                                    DS_DEFAULT_PERSISTENCE)))
    gathered = 0.0
    if stage == 3:  # whole copies while in use: every partitioned parameter when kept, else about a prefetch bucket
        gathered = w_bytes * (partitioned if keep else min(partitioned, float(z.get("stage3_prefetch_bucket_size",
                                                                                     5e7))))
    acts = _activation_bytes(cfg, tokens, max(k_list), w_bytes)
    n_rank = dense + local_experts  # parameters this rank trains
    memory = {"weights": states["weights"], "gathered weights (ZeRO-3, in use)": gathered,
              "gradients": states["gradients"], "optimizer (fp32 master + AdamW moments)":
              states["optimizer (fp32 master + AdamW moments)"], "gradient bucket": states["gradient bucket"],
              "activations (estimate)": acts}

    # Time
    # Compute: a synchronous step waits for the slowest rank. With a per-sequence depth (Eco-RNA) a rank's work is
    # the sum over its rows; ZeRO-2/3 synchronize every microbatch (gradient reduction in each backward), ZeRO-0/1
    # once per step, so the slowest of N ranks is taken per microbatch or per step (normal approximation).
    mean_seq, var_seq = _train_flops_per_sequence(cfg, pmf)
    flops = mean_seq * micro * ga
    rate = hw.peak_tflops * 1e12 * hw.mfu
    per_sync, syncs = (micro, ga) if stage >= 2 else (micro * ga, 1)
    slowest = syncs * (mean_seq * per_sync + math.sqrt(var_seq * per_sync) * expected_max_normal(gpus))
    compute = flops / rate
    comm_s = sum(c.seconds(hw) for c in traffic)
    busy = slowest / rate  # the slowest rank's compute: what the step waits for
    step = max(busy, comm_s) if z.get("overlap_comm", stage == 3) else busy + comm_s
    if slowest > flops * 1.01:
        note = (note + "; " if note else "") + (
            f"the slowest of {gpus} ranks computes {slowest / flops - 1:.0%} more than the mean (per-sequence depths)")
    return Plan(cfg.family, gpus, nodes, stage, ep, micro, ga, L,
                exp_k_max if scaling.drawn_depth else None, int(n_rank), traffic, memory, flops, compute, comm_s, step,
                compute / step if step else 1.0, gpus * micro * ga * L / step if step else 0.0, note)


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / GB:.3f} GB"


def render(pl: Plan, hw: Hardware) -> str:
    lines = [f"{pl.family} on {pl.gpus} GPUs ({pl.nodes} node{'s' if pl.nodes > 1 else ''} x {hw.gpus_per_node}), "
             f"ZeRO-{pl.zero_stage}, EP {pl.ep}: {pl.params:,} parameters per GPU's model replica; per GPU "
             f"{pl.micro_batch_size} x {pl.grad_accum_steps} sequences of {pl.length} per step"
             + (f"; expected K_max {pl.k_max:.2f}" if pl.k_max is not None else "")]
    lines.append("communication per GPU and step (bytes sent, ring-optimal):")
    for c in pl.traffic:
        where = "InfiniBand" if c.spans_nodes else "NVLink"
        lines.append(f"  {c.name}: {_gb(c.bytes)} in {c.calls:g} calls over {c.group} ranks ({where}), "
                     f"{c.seconds(hw) * 1e3:.2f} ms")
    lines.append(f"  total: {_gb(pl.comm_bytes())}, {pl.comm_s * 1e3:.2f} ms")
    lines.append("memory per GPU:")
    for k, v in pl.memory.items():
        lines.append(f"  {k}: {_gb(v)}")
    lines.append(f"  total: {_gb(sum(pl.memory.values()))}")
    lines.append(f"step: compute {pl.compute_s * 1e3:.2f} ms ({pl.flops_per_gpu / 1e12:.2f} TFLOPs at "
                 f"{hw.peak_tflops:g} TFLOP/s x MFU {hw.mfu:g}), communication {pl.comm_s * 1e3:.2f} ms, "
                 f"step {pl.step_s * 1e3:.2f} ms; efficiency {pl.efficiency:.0%}; {pl.tokens_per_s:,.0f} tokens/s "
                 "on all GPUs")
    if pl.note:
        lines.append(f"note: {pl.note}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a config file, or a name in launchers/configs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.d_model=512 (repeatable)")
    p.add_argument("--gpus", required=True, help="number of GPUs, or a comma list (e.g. 8,64,1024)")
    p.add_argument("--ds_config", required=True, help="DeepSpeed JSON config (ds_configs/zero{1,2,3}.json)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: train.expert_parallel_size)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="training precision of the GPUs planned for (train.precision auto resolves to bf16 on CUDA)")
    defaults = Hardware()
    for name in ("peak_tflops", "mfu", "gpus_per_node", "nvlink_gbs", "ib_gbs", "latency_us", "latency_log_us"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=type(getattr(defaults, name)),
                       default=getattr(defaults, name), help=f"default {getattr(defaults, name)}")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    return p


def main(argv=None) -> int:
    p = build_parser()
    defaults = Hardware()
    args = p.parse_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.ds_config import load_ds_config, resolve_ds_config
    from pipeline.config_files import resolve_config
    from pipeline.parallel import check_expert_parallel

    hw = Hardware(**{k: getattr(args, k) for k in asdict(defaults)})
    try:
        try:
            counts = [int(x) for x in args.gpus.split(",")]
        except ValueError:
            raise ConfigError(f"--gpus {args.gpus}: expected a number of GPUs or a comma list of them") from None
        if any(n < 1 for n in counts):
            raise ConfigError(f"--gpus {args.gpus}: GPU counts must be >= 1")
        if hw.gpus_per_node < 1 or hw.mfu <= 0 or hw.peak_tflops <= 0:
            raise ConfigError("--gpus-per-node, --mfu and --peak-tflops must be positive")
        cfg = load_config(resolve_config(args.config), [*args.overrides, f"train.precision={args.precision}"])
        raw = load_ds_config(args.ds_config)
        plans = []
        for n in counts:
            ep = args.ep or cfg.train.expert_parallel_size
            if n % ep:
                raise ConfigError(f"--ep {ep}: does not divide {n} GPUs")
            # the engine's own checks: EP against the experts and the ZeRO stage
            check_expert_parallel(cfg.model, ep, n, int(raw.get("zero_optimization", {}).get("stage", 0)))
            ds = resolve_ds_config(raw, cfg, n, args.ds_config, cuda=True)  # a pinned global batch: plan() deals it
            plans.append(plan(cfg, ds, n, hw, ep=ep))
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(pl) for pl in plans], indent=1))
    else:
        print("\n\n".join(render(pl, hw) for pl in plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
