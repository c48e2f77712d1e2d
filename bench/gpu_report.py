#!/usr/bin/env python
"""The figures of bench/gpu.sh's trainings, its A/B plan, its summary and the packing of its results
(docs/gpu_check.md).

    python bench/gpu_report.py family --name "Eco-RNA 80M" --run RUN_DIR [--util UTIL.csv] [--log TRAIN.log]
                                      [--launched UNIX_TIME] [--json OUT.json]
    python bench/gpu_report.py sample-util --out UTIL.csv [--interval-ms 200] [--fake]
    python bench/gpu_report.py plan --runs RUNS.tsv --out PLAN.tsv
    python bench/gpu_report.py summary --work WORK
    python bench/gpu_report.py pack --work WORK --out OUT [--max-files 8]
    python bench/gpu_report.py cut-trace IN OUT [--max-bytes N]

``family`` reads RUN_DIR/metrics.jsonl (one record a step), RUN_DIR/profile/trace_steps_S-*.json (train.profile),
the utilization samples and the training's log, and prints:

* end-to-end tokens/s (real tokens, the trainer's ``tokens_per_s``) and MFU (``mfu``: model FLOPs of the executed
  schedule over train.peak_flops_per_device), medians over the measured steps: every step after the warm-up (the
  first fifth of the steps, at least 5) except the profiled steps and the step after them (the profiler's overhead
  and the trace's export land there);
* step time p50, p90, max and max / median over the same steps (a max far above the median: stalls, e.g. the
  loader or a recompile);
* the first step: its own time (compilation lands there) and, with --launched, when it ended after the launch;
* peak GPU memory: the largest ``peak_mem_gib`` (torch.cuda.max_memory_allocated of rank 0) of the run;
* GPU utilization: nvidia-smi's utilization.gpu sampled every 200 ms by ``sample-util``, over the measured window;
* the profiled step: the time of each kernel class (below) and idle (no kernel, copy or memset on the device), the
  kernels launched and the host time per step (see kernel_breakdown); a trace without device events (a CPU run) is
  broken down by the CPU operators' self time instead;
* the training's ``resolved:`` line (layout, attention kernel, norm, MoE backend, compile mode, microbatch, as the
  trainer resolved them) when it printed one, and the compiler's recompiles and graph breaks counted in the log.

``plan`` reads bench/gpu.sh's table of trainings (families and A/B variants), checks each one's overrides against
the real config code (pipeline.config.load_config) and writes which run: an override this tree does not know is
skipped with the config's own error, an optional override (``?key=value``) is dropped where refused, and a variant
whose config equals its base's is skipped (it would measure nothing).

``summary`` writes the check's closing table (stages, families against their targets, each A/B variant against its
base, where each profiled step goes) from what WORK holds; ``pack`` leaves at most --max-files files in OUT (the
summary, a tar of the small results, the traces cut to fit), each written under a temporary name first, so that OUT
never holds more at any moment, also when the check is killed mid-way; ``cut-trace`` fits one Chrome trace into a
byte budget, gzipped, dropping the least needed events first.

``sample-util`` runs ``nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200`` and writes
``unix_time,percent`` a line until it is terminated; ``--fake`` writes 0 % samples without nvidia-smi (the dry run).
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Kernel classes by the source of the kernel: a Triton kernel inductor generated (torch.compile) is classed by what
# inductor says it is (its names: triton_red_/triton_per_ = a reduction, looped or in one pass; triton_poi_ =
# pointwise; triton_tem_ = a template, the matrix products), whatever it fused; the rest by the library or aten
# kernel that ran.
CLASSES = ("gemm", "attention", "norm", "triton_reduction", "triton_pointwise", "reduction", "elementwise",
           "optimizer", "communication", "copy", "other")
SHORT = {"gemm": "gemm", "attention": "attn", "norm": "norm", "triton_reduction": "tri_red",
         "triton_pointwise": "tri_poi", "reduction": "reduce", "elementwise": "elemw", "optimizer": "optim",
         "communication": "comm", "copy": "copy", "other": "other"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# First match wins, so the specific classes come before the broad ones: an NCCL kernel holds "reduce", a Triton
# kernel's name holds the aten ops it fused (triton_per_fused_rms_norm_0), a cuDNN attention kernel "gemm"-like
# parts, a copy kernel "elementwise". Names are CUDA kernel names or, for a CPU trace, aten/custom operators.
RULES = [
    ("communication", r"nccl|c10d|gloo|all_?reduce|all_?gather|reduce_?scatter|all_to_all|alltoall"),
    ("triton_reduction", r"^triton_(?:red|per)_"),
    ("triton_pointwise", r"^triton_poi_"),
    ("gemm", r"^triton_tem_"),
    ("copy", r"memcpy|memset|copy_kernel|CatArrayBatchedCopy|aten::copy_|aten::_to_copy|aten::to$|aten::contiguous"
             r"|aten::clone|aten::cat$"),
    ("optimizer", r"optimizer|adam|multi_tensor_apply|lamb\b|aten::_foreach_|sgd"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|cudnn::fusion|varlen_attn"),
    # torch's layer_norm_kernel.cu (layer norm and, with its rms_norm flag, RMSNorm: the fused kernels of
    # pipeline/models/norm_op.py) and apex-style names; "norm" alone would take linalg_vector_norm and normal_
    ("norm", r"rms_?norm|layer_?norm|LayerNorm|RowwiseMoments|GammaBeta|cuComputeGradGammaBeta|cuComputePartGrad"
             r"|cuComputeGradInput|cuApply(?:Layer|RMS)Norm|ComputeInternalGradients|group_?norm|batch_?norm"),
    ("gemm", r"gemm|gemv|cutlass|xmma|cublas|matmul|nvjet|wgmma|grouped_mm|aten::(?:mm|addmm|bmm|baddbmm|linear"
             r"|_grouped_mm)$|sm\d\d_|ampere_|hopper_|volta_|turing_"),
    ("reduction", r"reduce|softmax|aten::(?:sum|mean|max|min|amax|amin|argmax|var|std|cumsum|topk|sort|norm"
                  r"|linalg_vector_norm)$|cross_entropy|nll_loss|cub::|scan|radix"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|aten::|index|gather|scatter|fill|where|"
                    r"embedding|dropout|normal|random|silu|gelu|exp|pow|rsqrt|mul|add|div"),
]
_RULES = [(c, re.compile(p, re.IGNORECASE)) for c, p in RULES]
# Host-side runtime calls that block until the device has caught up (the host waits instead of queueing work), and
# those that launch work (with CUDA graphs, one launch call runs many kernels).
BLOCKING = re.compile(r"^(?:cuda(?:Stream|Device|Event)Synchronize|cu(?:Stream|Ctx|Event)Synchronize|cudaMemcpy"
                      r"(?:2D|3D)?$|cuMemcpy(?:DtoH|HtoD|DtoD)?(?:_v2)?$)")
LAUNCH = re.compile(r"^(?:cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|cudaLaunchCooperative"
                    r"Kernel|cudaGraphLaunch|cuGraphLaunch)")
HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver"}

# The acceptance figures of the families (issue 47): MFU after warm-up with auto microbatches.
TARGET_MFU = {"rna": 0.25, "protlingo": 0.20, "gpt": 0.45}
MAX_OVER_MEDIAN = 2.0  # no step slower than twice the median after warm-up
FIRST_STEP_S = 30.0  # a compiled run's first step (compilation included)

MIB = 1 << 20
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what the device returns from $OUT
TMP_NAME = ".pack.tmp"  # pack's one temporary file in OUT


def kernel_class(name: str) -> str:
    """The class of one CUDA kernel (or, in a CPU trace, one operator) by its name; "other" when no rule
    matches."""
    for cls, pattern in _RULES:
        if pattern.search(name):
            return cls
    return "other"


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) of xs, linear between the closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def load_metrics(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl (validation-only lines, without step_time, are left out)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"gpu_report: cannot read {path}: {e.strerror}")
    recs = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
        except ValueError:
            if i == len(lines):  # a run killed while writing its last line: the complete lines still count
                break
            raise SystemExit(f"gpu_report: {path}, line {i}: not JSON")
        if "step_time" in rec and "step" in rec:
            recs.append(rec)
    if not recs:
        raise SystemExit(f"gpu_report: {path} holds no step record (a run that never finished a step)")
    return recs


def measured_steps(recs: list[dict], profiled: set[int] = frozenset()) -> tuple[list[dict], int]:
    """(the records the medians and percentiles use, the number of warm-up steps left out): after the first fifth
    of the steps (at least 5; start-up, compilation, the loader's first fills and the lr warm-up's first steps),
    without the profiled steps and the step after each. A run too short for that keeps its last step."""
    warm = max(5, len(recs) // 5)
    skip = set(profiled) | {s + 1 for s in profiled}
    kept = [r for r in recs[warm:] if r["step"] not in skip]
    return (kept or recs[-1:]), min(warm, len(recs) - 1)


def step_stats(recs: list[dict], profiled: set[int] = frozenset()) -> dict:
    kept, warm = measured_steps(recs, profiled)
    times = [r["step_time"] for r in kept]
    p50 = percentile(times, 50)
    mfu = [r["mfu"] for r in kept if "mfu" in r]
    peaks = [r["peak_mem_gib"] for r in recs if "peak_mem_gib" in r]
    return {"steps": len(recs), "measured": len(kept), "warmup": warm,
            "first_measured": kept[0]["step"], "last_measured": kept[-1]["step"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in kept),
            "mfu": statistics.median(mfu) if mfu else None,
            "step_ms": {"p50": p50 * 1e3, "p90": percentile(times, 90) * 1e3, "max": max(times) * 1e3,
                        "max_over_median": max(times) / p50 if p50 > 0 else math.nan},
            "peak_mem_gib": max(peaks) if peaks else None,
            # the memory model's prediction the trainer records beside it (pipeline/train/memory.py)
            "predicted_mem_gib": next((r["predicted_mem_gib"] for r in recs if "predicted_mem_gib" in r), None),
            "loss_first": recs[0].get("loss"), "loss_last": recs[-1].get("loss"),
            # the first step whole: start-up work the trainer does inside it (torch.compile's first graphs, the
            # allocator's first blocks, kernel selection) shows here and not in the medians
            "first_step": {"step": recs[0]["step"], "s": recs[0]["step_time"], "end": recs[0].get("time")},
            # the wall-clock window of the measured steps: a record's "time" is its step's end
            "window": (kept[0]["time"] - kept[0]["step_time"], kept[-1]["time"]) if "time" in kept[0] else None}


def load_util(path: Path) -> list[tuple[float, float]]:
    """(unix time, percent) samples of ``sample-util``; lines that are not two numbers (an nvidia-smi message such
    as "[N/A]") are skipped."""
    out = []
    for ln in Path(path).read_text().splitlines():
        try:
            t, u = ln.split(",", 1)
            out.append((float(t), float(u)))
        except ValueError:
            continue
    return out


def util_stats(samples: list[tuple[float, float]], window: tuple[float, float] | None) -> dict | None:
    """Mean and median utilization of the samples inside ``window`` (all samples without one), and the share of
    samples at 0 % (the device idle for a whole sampling period)."""
    inside = [u for t, u in samples if window is None or window[0] <= t <= window[1]]
    if not inside:
        return None
    return {"n": len(inside), "mean": statistics.fmean(inside), "median": statistics.median(inside),
            "zero_share": sum(u == 0 for u in inside) / len(inside)}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def read_trace_json(path: Path) -> dict | list:
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (OSError, ValueError, EOFError) as e:
        raise SystemExit(f"gpu_report: cannot read the trace {path}: {e}")


def load_trace(path: Path) -> list[dict]:
    data = read_trace_json(path)
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def kernel_breakdown(events: list[dict]) -> dict:
    """The figures of one profiled window: {"device": "cuda"|"cpu", "wall_ms", "idle_ms", "ms": {class: ms},
    "kernels", "copies", "launch_calls", "host_ms", "wait_ms", "syncs"}.

    The window is the span of every complete event in the trace (the profiler runs from just before the step to
    just after it). With device events (kernels, memcpys, memsets): each class's summed durations (streams that
    overlap count twice, so the classes can add up to more than busy time) and idle = window - the union of the
    device intervals. Without (a CPU run): the self time (duration less the nested operators on the same thread) of
    each CPU operator, and idle = window - the union of the outermost operators.

    Counts: ``kernels`` the device kernels that ran (memcpys and memsets apart, in ``copies``), ``launch_calls`` the
    host's launch API calls (cudaLaunchKernel, cuLaunchKernel for Triton's kernels, cudaGraphLaunch: one per CUDA
    graph, whatever it runs). Host time: ``host_ms`` is the wall time during which some host thread ran an operator
    or a CUDA runtime/driver call (the union over threads of cpu_op, cuda_runtime and cuda_driver events), less
    ``wait_ms``, the union of the calls that block until the device catches up (stream/device/event synchronize,
    synchronous cudaMemcpy); ``syncs`` counts those calls. A step whose host_ms is near its wall time is host-bound:
    the GPU waits for the host to queue work. A CPU trace: host_ms = the outermost operators' union, no waits."""
    if not events:
        raise SystemExit("gpu_report: the trace holds no complete event")
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    ms = dict.fromkeys(CLASSES, 0.0)
    device = [e for e in events if str(e.get("cat", "")).lower() in DEVICE_CATS]
    counts = {"kernels": 0, "copies": 0, "launch_calls": 0, "host_ms": 0.0, "wait_ms": 0.0, "syncs": 0}
    if device:
        for e in device:
            cat = str(e.get("cat", "")).lower()
            cls = "copy" if cat in ("gpu_memcpy", "gpu_memset") else kernel_class(str(e.get("name", "")))
            ms[cls] += e["dur"] / 1e3
            counts["kernels" if cat == "kernel" else "copies"] += 1
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
        host = [e for e in events if str(e.get("cat", "")).lower() in HOST_CATS]
        runtime = [e for e in host if str(e.get("cat", "")).lower() != "cpu_op"]
        blocking = [(e["ts"], e["ts"] + e["dur"]) for e in runtime if BLOCKING.match(str(e.get("name", "")))]
        counts["launch_calls"] = sum(bool(LAUNCH.match(str(e.get("name", "")))) for e in runtime)
        counts["syncs"] = len(blocking)
        wait = _union(blocking)
        counts["wait_ms"] = wait / 1e3
        counts["host_ms"] = max(_union([(e["ts"], e["ts"] + e["dur"]) for e in host]) - wait, 0.0) / 1e3
        kind = "cuda"
    else:
        ops = [e for e in events if str(e.get("cat", "")).lower() == "cpu_op"]
        if not ops:
            raise SystemExit("gpu_report: the trace holds neither device events nor CPU operators")
        # the operators inside an optimizer's step annotation (Optimizer.step#AdamW.step) are the optimizer's, whatever
        # they are (a CPU AdamW runs plain add_/mul_/addcdiv_ per parameter)
        opt = [(e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("cat", "")).lower() == "user_annotation"
               and str(e.get("name", "")).startswith("Optimizer.step")]

        def cls_of(ev):
            if any(a <= ev["ts"] < b for a, b in opt):
                return "optimizer"
            return kernel_class(str(ev.get("name", "")))

        by_thread: dict = {}
        for e in ops:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        outer = []
        for thread_ops in by_thread.values():
            thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
            stack: list[list] = []  # [end, event, children's time]
            for e in thread_ops + [None]:
                while stack and (e is None or e["ts"] >= stack[-1][0]):
                    end, ev, child = stack.pop()
                    ms[cls_of(ev)] += max(ev["dur"] - child, 0) / 1e3
                    if stack:
                        stack[-1][2] += ev["dur"]
                    else:
                        outer.append((ev["ts"], end))
                if e is not None:
                    stack.append([e["ts"] + e["dur"], e, 0.0])
        busy = _union(outer)
        counts["host_ms"] = busy / 1e3
        kind = "cpu"
    wall = (t1 - t0) / 1e3
    return {"device": kind, "wall_ms": wall, "idle_ms": max(wall - busy / 1e3, 0.0), "ms": ms, **counts}


def find_trace(run: Path) -> tuple[Path | None, set[int]]:
    """The run's profile trace and the steps it covers (from its name, trace_steps_S-E.json)."""
    for p in sorted((run / "profile").glob("trace_steps_*.json*")):
        m = re.match(r"trace_steps_(\d+)-(\d+|end)\.json", p.name)
        if m:
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) != "end" else start
            return p, set(range(start, end + 1))
    return None, set()


# "resolved: layout=packed attention=torch_varlen norm=fused ..." as the trainer prints it among its first lines;
# a launcher may put a "[rank0]:" or similar tag before it.
RESOLVED = re.compile(r"^(?:\[[^\]]*\]:?\s*|rank\s*\d+:\s*)*resolved:\s*(.*)$")


def parse_resolved(text: str) -> dict | None:
    """The key=value pairs of the first ``resolved:`` line of a training log; None when it has none."""
    for line in text.splitlines():
        m = RESOLVED.match(line.strip())
        if m:
            return dict(p.split("=", 1) for p in m.group(1).split() if "=" in p)
    return None


def compile_notes(text: str) -> dict:
    """What torch.compile said in a training log (bench/gpu.sh runs compiled trainings with
    TORCH_LOGS=recompiles,graph_breaks): recompiles, graph breaks, and whether a cache-size limit was hit (torch then
    runs that frame eagerly)."""
    return {"recompiles": len(re.findall(r"Recompiling function", text)),
            "graph_breaks": len(re.findall(r"Graph break", text, re.IGNORECASE)),
            "limit_hit": bool(re.search(r"cache_size_limit|recompile_limit", text))}


def family_report(name: str, run: Path, util: Path | None = None, log: Path | None = None,
                  launched: float | None = None) -> tuple[dict, list[str]]:
    """(the figures, the printed lines) of one training's run."""
    trace, profiled = find_trace(run)
    st = step_stats(load_metrics(run / "metrics.jsonl"), profiled)
    rep = {"family": name, "run": str(run), **st}
    lines = [f"== {name}: {st['steps']} steps; measured {st['measured']} (steps {st['first_measured']}-"
             f"{st['last_measured']}: the first {st['warmup']} are warm-up"
             + (f", profiled step(s) {min(profiled)}-{max(profiled)} and the step after left out)" if profiled
                else ")")]
    mfu = "n/a (no train.peak_flops_per_device)" if st["mfu"] is None else f"{st['mfu']:.1%}"
    mem = ("n/a (no peak_mem_gib in metrics.jsonl: a CPU run)" if st["peak_mem_gib"] is None
           else f"{st['peak_mem_gib']:.2f} GiB" + (f" (memory model {st['predicted_mem_gib']:.2f} GiB)"
                                                   if st.get("predicted_mem_gib") else ""))
    lines.append(f"  tokens/s (median) {st['tokens_per_s']:.0f} | MFU (median) {mfu} | peak GPU memory {mem} | "
                 f"loss {st['loss_first']:.3f} -> {st['loss_last']:.3f}")
    s = st["step_ms"]
    lines.append(f"  step time: p50 {s['p50']:.0f} ms | p90 {s['p90']:.0f} ms | max {s['max']:.0f} ms | "
                 f"max/median {s['max_over_median']:.2f}")
    fs = st["first_step"]
    rep["first_step"]["after_launch_s"] = (fs["end"] - launched if launched is not None and fs["end"] is not None
                                           else None)
    lines.append(f"  first step (step {fs['step']}): {fs['s']:.1f} s"
                 + (f", ended {rep['first_step']['after_launch_s']:.1f} s after the launch"
                    if rep["first_step"]["after_launch_s"] is not None else ""))
    rep["util"] = None
    if util is not None and util.is_file():
        rep["util"] = util_stats(load_util(util), st["window"])
    u = rep["util"]
    lines.append("  GPU utilization: no samples in the measured window" if u is None else
                 f"  GPU utilization (every 200 ms over the measured steps): mean {u['mean']:.0f}% | median "
                 f"{u['median']:.0f}% | samples at 0%: {u['zero_share']:.0%} (n {u['n']})")
    rep["resolved"], rep["compile"] = None, None
    if log is not None and log.is_file():
        text = log.read_text(errors="replace")
        rep["resolved"] = parse_resolved(text)
        rep["compile"] = compile_notes(text)
    lines.append("  resolved: " + (" ".join(f"{k}={v}" for k, v in rep["resolved"].items()) if rep["resolved"]
                                   else "(the training printed no 'resolved:' line)"))
    c = rep["compile"]
    if c and (c["recompiles"] or c["graph_breaks"] or c["limit_hit"]):
        lines.append(f"  torch.compile: {c['recompiles']} recompiles, {c['graph_breaks']} graph breaks"
                     + (", a recompile limit was hit (that frame runs eagerly)" if c["limit_hit"] else ""))
    rep["profile"] = None
    if trace is None:
        lines.append("  profiled step: no trace (the run ended before train.profile.start)")
    else:
        kb = kernel_breakdown(load_trace(trace))
        n = len(profiled)
        per_step = {k: kb[k] / n for k in ("kernels", "copies", "launch_calls", "host_ms", "wait_ms", "syncs")}
        per_step["wall_ms"] = kb["wall_ms"] / n
        rep["profile"] = {"trace": str(trace), "steps": sorted(profiled), **kb, "per_step": per_step}
        parts = " | ".join(f"{c} {kb['ms'][c] / kb['wall_ms']:.1%}" for c in CLASSES if kb["ms"][c] > 0 or
                           c != "other")
        lines.append(f"  profiled step {min(profiled)} ({kb['device']}, {kb['wall_ms']:.0f} ms wall, shares of it): "
                     f"{parts} | idle {kb['idle_ms'] / kb['wall_ms']:.1%}")
        lines.append(f"  per step: {per_step['kernels']:.0f} kernels ({per_step['launch_calls']:.0f} launch calls, "
                     f"{per_step['copies']:.0f} copies/memsets) | host {per_step['host_ms']:.0f} ms of "
                     f"{per_step['wall_ms']:.0f} ms wall, waiting on the device {per_step['wait_ms']:.0f} ms in "
                     f"{per_step['syncs']:.0f} syncs")
    ps = rep["profile"]["per_step"] if rep["profile"] else None
    rep["digest"] = (f"{st['tokens_per_s']:.0f} tokens/s, MFU {mfu.split(' ')[0]}, step p50 {s['p50']:.0f} ms, "
                     f"first step {fs['s']:.1f} s" + (f", {ps['kernels']:.0f} kernels/step" if ps else ""))
    lines.append(f"RESULT GPU_FAMILY {name.replace(' ', '_')} tokens_per_s={st['tokens_per_s']:.0f} "
                 f"mfu={st['mfu'] if st['mfu'] is not None else 'nan'} p50_ms={s['p50']:.1f} "
                 f"max_over_median={s['max_over_median']:.2f} util_mean={u['mean'] if u else 'nan'} "
                 f"peak_mem_gib={st['peak_mem_gib'] if st['peak_mem_gib'] is not None else 'nan'} "
                 f"kernels_per_step={ps['kernels'] if ps else 'nan'} host_ms_per_step={ps['host_ms'] if ps else 'nan'} "
                 f"first_step_s={fs['s']:.1f}")
    return rep, lines


def sample_util(out: Path, interval_ms: int, fake: bool) -> int:
    """Write ``unix_time,percent`` lines to ``out`` until SIGTERM/SIGINT."""
    proc = None
    if not fake:
        cmd = ["nvidia-smi", "--id=0", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
               "-lms", str(interval_ms)]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        except OSError as e:
            print(f"gpu_report sample-util: cannot run nvidia-smi: {e.strerror}", file=sys.stderr)
            return 1

    def stop(*_):
        if proc is not None:
            proc.terminate()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with open(out, "w") as f:
        if proc is None:
            while True:  # --fake: the dry run's stand-in, 0 % every interval
                f.write(f"{time.time():.3f},0\n")
                f.flush()
                time.sleep(interval_ms / 1e3)
        for ln in proc.stdout:  # a line arrives as nvidia-smi samples: stamp it on arrival
            f.write(f"{time.time():.3f},{ln.strip()}\n")
            f.flush()
    return proc.wait()


# ---- the A/B plan -----------------------------------------------------------------------------------------------
SEP = "\x1f"  # between the overrides of one run in runs.tsv / plan.tsv (an override may hold spaces and commas)


def read_runs(path: Path) -> list[dict]:
    """bench/gpu.sh's runs.tsv: name, base ("-" for a family), config, what, overrides (SEP-separated; a leading
    "?" marks an optional one)."""
    runs = []
    for ln in Path(path).read_text().splitlines():
        if not ln.strip():
            continue
        name, base, config, what, sets = (ln.split("\t") + [""] * 5)[:5]
        runs.append({"name": name, "base": base, "config": config, "what": what,
                     "sets": [s for s in sets.split(SEP) if s]})
    return runs


def write_plan(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            # "-" for an empty note: bash's read with IFS=tab collapses empty fields
            f.write("\t".join([r["name"], r["base"], r["status"], r["note"].replace("\t", " ") or "-", r["config"],
                               r["what"] or "-", SEP.join(r["sets"])]) + "\n")


def read_plan(path: Path) -> list[dict]:
    rows = []
    if not Path(path).is_file():
        return rows
    for ln in Path(path).read_text().splitlines():
        if ln.strip():
            name, base, status, note, config, what, sets = (ln.split("\t") + [""] * 7)[:7]
            rows.append({"name": name, "base": base, "status": status, "note": "" if note == "-" else note,
                         "config": config, "what": "" if what == "-" else what,
                         "sets": [s for s in sets.split(SEP) if s]})
    return rows


def _diff(a, b, prefix="") -> list[str]:
    """The dotted keys whose values differ between two config dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def plan(runs: list[dict]) -> list[dict]:
    """Each run checked against the config code: {name, base, status "run"|"skip", note, config, what, sets}."""
    sys.path.insert(0, str(REPO))
    from pipeline.config import load_config  # noqa: PLC0415 - the tree's own config code, imported on demand

    def short(e: Exception) -> str:
        return str(e).split(" (known:", 1)[0]

    done: dict[str, tuple[list, dict]] = {}
    rows = []
    for r in runs:
        sets, notes = [], []
        base = done.get(r["base"]) if r["base"] != "-" else None
        if r["base"] != "-" and base is None:
            rows.append({**r, "status": "skip", "note": f"its base {r['base']} does not run", "sets": r["sets"]})
            continue
        inherited = list(base[0]) if base else []
        try:
            cfg = None
            for s in r["sets"]:
                if s.startswith("?"):  # optional: kept where this tree's config accepts it
                    try:
                        load_config(r["config"], inherited + sets + [s[1:]])
                        sets.append(s[1:])
                    except Exception as e:  # noqa: BLE001 - ConfigError, or a family's own ValueError
                        notes.append(f"without {s[1:]}: {short(e)}")
                else:
                    sets.append(s)
            cfg = load_config(r["config"], inherited + sets).to_dict()
        except Exception as e:  # noqa: BLE001 - the variant cannot run in this tree: say why, in the config's words
            rows.append({**r, "status": "skip", "note": short(e), "sets": inherited + sets})
            continue
        if base is not None:
            changed = _diff(cfg, base[1])
            if not changed:
                rows.append({**r, "status": "skip", "note": f"its config equals {r['base']}'s (nothing to compare)",
                             "sets": inherited + sets})
                continue
            notes.insert(0, "changes " + ", ".join(changed))
        done[r["name"]] = (inherited + sets, cfg)
        rows.append({**r, "status": "run", "note": "; ".join(notes), "sets": inherited + sets})
    return rows


# ---- the summary ------------------------------------------------------------------------------------------------
def read_stages(work: Path) -> list[dict]:
    """bench/gpu.sh's stages.tsv: name, status, seconds, timeout, note (one line per stage, in order)."""
    out = []
    p = work / "stages.tsv"
    if p.is_file():
        for ln in p.read_text().splitlines():
            if ln.strip():
                name, status, secs, budget, note = (ln.split("\t") + [""] * 5)[:5]
                out.append({"name": name, "status": status, "s": secs, "timeout": budget, "note": note})
    return out


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def _num(x, fmt="{:.0f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def summary(work: Path) -> str:
    """The closing table of bench/gpu.sh from what ``work`` holds (any part may be missing: a check killed early)."""
    work = Path(work)
    head = (work / "summary_head.txt").read_text().strip() if (work / "summary_head.txt").is_file() else ""
    lines = ["== bench/gpu.sh summary" + (f": {head}" if head else "")]
    stages = read_stages(work)
    if stages:
        lines.append(f"  {'stage':<18}{'status':<10}{'s':>5}{'timeout':>8}  note")
        for s in stages:
            lines.append(f"  {s['name']:<18}{s['status']:<10}{s['s']:>5}{s['timeout']:>8}  {s['note']}")
    rows = read_plan(work / "plan.tsv")
    if (work / "wanted.txt").is_file():  # the trainings this invocation meant to run (--quick: a few)
        wanted = set((work / "wanted.txt").read_text().split())
        rows = [r for r in rows if r["name"] in wanted]
    reports = {}
    for r in rows:
        p = work / f"report_{r['name']}.json"
        if p.is_file():
            try:
                reports[r["name"]] = json.loads(p.read_text())
            except ValueError:
                pass
    fams = [r for r in rows if r["base"] == "-" and r["name"] in reports]
    if fams:
        lines.append(f"families (targets: MFU {', '.join(f'{k} >= {v:.0%}' for k, v in TARGET_MFU.items())}; "
                     f"max/median <= {MAX_OVER_MEDIAN:g} after warm-up)")
        lines.append(f"  {'run':<14}{'tokens/s':>9}{'MFU':>7}{'target':>8}{'p50 ms':>8}{'max/med':>8}{'peak GiB':>9}"
                     f"{'kern/step':>10}{'host ms':>8}{'syncs':>6}{'idle':>6}{'1st s':>7}")
        for r in fams:
            lines.append("  " + _row(r["name"], reports[r["name"]]))
    variants = [r for r in rows if r["base"] != "-"]
    if variants:
        lines.append("A/B (the same lease; each variant against its base: x base = its tokens/s over the base's)")
        lines.append(f"  {'variant':<16}{'base':<14}{'tokens/s':>9}{'x base':>7}{'MFU':>7}{'p50 ms':>8}{'peak GiB':>9}"
                     f"{'kern/step':>10}{'host ms':>8}{'1st s':>7}  switch; resolved differs")
        for r in variants:
            rep, base = reports.get(r["name"]), reports.get(r["base"])
            if rep is None:
                why = r["note"] if r["status"] == "skip" else _stage_note(stages, r["name"])
                lines.append(f"  {r['name']:<16}{r['base']:<14}{'not measured':>9}  {r['what']}: {why}")
                continue
            ratio = (rep["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else None)
            ps = (rep.get("profile") or {}).get("per_step") or {}
            diff = ""
            if rep.get("resolved") and base and base.get("resolved"):
                d = {k: v for k, v in rep["resolved"].items() if base["resolved"].get(k) != v}
                diff = " ".join(f"{k}={v}" for k, v in d.items()) or "(none)"
            lines.append(f"  {r['name']:<16}{r['base']:<14}{rep['tokens_per_s']:>9.0f}{_num(ratio, '{:.2f}'):>7}"
                         f"{_pct(rep['mfu']):>7}{rep['step_ms']['p50']:>8.0f}{_num(rep['peak_mem_gib'], '{:.1f}'):>9}"
                         f"{_num(ps.get('kernels')):>10}{_num(ps.get('host_ms')):>8}"
                         f"{rep['first_step']['s']:>7.1f}  {r['what']}" + (f"; {diff}" if diff else ""))
    prof = [(name, rep) for name, rep in reports.items() if rep.get("profile")]
    if prof:
        lines.append("where the profiled step goes (% of its wall time; classes by kernel source, docs/gpu_check.md)")
        lines.append(f"  {'run':<16}" + "".join(f"{SHORT[c]:>8}" for c in CLASSES) + f"{'idle':>8}")
        for name, rep in prof:
            p = rep["profile"]
            lines.append(f"  {name:<16}" + "".join(f"{p['ms'][c] / p['wall_ms']:>8.1%}" for c in CLASSES)
                         + f"{p['idle_ms'] / p['wall_ms']:>8.1%}")
    res = [(name, rep["resolved"]) for name, rep in reports.items() if rep.get("resolved")]
    if res:
        lines.append("resolved (each training's own 'resolved:' line)")
        lines += [f"  {name:<16}" + " ".join(f"{k}={v}" for k, v in d.items()) for name, d in res]
    if (work / "pack.txt").is_file():
        lines.append("returned: " + (work / "pack.txt").read_text().splitlines()[0])
    verdicts = _verdicts(rows, reports)
    if verdicts:
        lines.append("verdicts")
        lines += [f"  {v}" for v in verdicts]
    return "\n".join(lines) + "\n"


def _stage_note(stages: list[dict], name: str) -> str:
    for s in stages:
        if s["name"] == name:
            return f"{s['status']}" + (f" ({s['note']})" if s["note"] else "")
    return "not reached"


def _row(name: str, rep: dict) -> str:
    ps = (rep.get("profile") or {}).get("per_step") or {}
    p = rep.get("profile")
    idle = p["idle_ms"] / p["wall_ms"] if p else None
    target = TARGET_MFU.get(name)
    return (f"{name:<14}{rep['tokens_per_s']:>9.0f}{_pct(rep['mfu']):>7}{_pct(target):>8}{rep['step_ms']['p50']:>8.0f}"
            f"{rep['step_ms']['max_over_median']:>8.2f}{_num(rep['peak_mem_gib'], '{:.1f}'):>9}"
            f"{_num(ps.get('kernels')):>10}{_num(ps.get('host_ms')):>8}{_num(ps.get('syncs')):>6}{_pct(idle):>6}"
            f"{rep['first_step']['s']:>7.1f}")


def _where(rep: dict) -> str:
    """The largest shares of a profiled step (idle first when it leads): where a run that falls short goes."""
    p = rep.get("profile")
    if not p:
        return "no profiled step"
    shares = {c: p["ms"][c] / p["wall_ms"] for c in CLASSES}
    shares["idle"] = p["idle_ms"] / p["wall_ms"]
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:3]
    ps = p["per_step"]
    return (", ".join(f"{c} {v:.0%}" for c, v in top) + f"; {ps['kernels']:.0f} kernels and host {ps['host_ms']:.0f} ms"
            f" of {ps['wall_ms']:.0f} ms a step")


def _verdicts(rows: list[dict], reports: dict) -> list[str]:
    out, spread_ok = [], 0
    for r in rows:
        rep = reports.get(r["name"])
        if rep is None:
            continue
        target = TARGET_MFU.get(r["name"]) if r["base"] == "-" else None
        if target is not None:
            if rep["mfu"] is None:
                out.append(f"{r['name']}: no MFU (train.peak_flops_per_device unset)")
            else:
                met = rep["mfu"] >= target
                out.append(f"{r['name']}: MFU {rep['mfu']:.1%} against {target:.0%}: {'met' if met else 'missed'}"
                           + ("" if met else f"; the step goes to {_where(rep)}"))
        mom = rep["step_ms"]["max_over_median"]
        if not mom <= MAX_OVER_MEDIAN:
            out.append(f"{r['name']}: a step took {mom:.2f}x the median after warm-up (max {rep['step_ms']['max']:.0f}"
                       f" ms): over {MAX_OVER_MEDIAN:g}x")
        else:
            spread_ok += 1
        compiled = any(s.replace(" ", "") == "train.compile=blocks" for s in r["sets"])
        if compiled:
            fs = rep["first_step"]["s"]
            base = reports.get(r["base"])
            why = ""
            if not fs < FIRST_STEP_S:
                c = rep.get("compile") or {}
                why = (f": {c.get('recompiles', 0)} recompiles, {c.get('graph_breaks', 0)} graph breaks logged"
                       + ("; a recompile limit was hit" if c.get("limit_hit") else "")
                       + (f"; the uncompiled base's first step took {base['first_step']['s']:.1f} s" if base else ""))
            out.append(f"{r['name']}: first step {fs:.1f} s (compiling) against {FIRST_STEP_S:g} s: "
                       f"{'met' if fs < FIRST_STEP_S else 'missed'}{why}")
    if spread_ok:
        out.append(f"{spread_ok} run(s) with no step over {MAX_OVER_MEDIAN:g}x their median after warm-up"
                   + ("" if spread_ok == len([r for r in rows if r["name"] in reports]) else " (the others above)"))
    return out


# ---- packing the results into the device's return folder ---------------------------------------------------------
LOG_CAPS = (512 * 1024, 128 * 1024, 32 * 1024, 8 * 1024)  # bytes of each log's tail, tried in turn


def _tail(path: Path, cap: int) -> bytes:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size > cap:
            f.seek(size - cap)
            return f"[... the first {size - cap} bytes left out ...]\n".encode() + f.read()
        return f.read()


def results_tar(work: Path, cap_bytes: int) -> tuple[bytes, str]:
    """(a gzipped tar of WORK's small results, a note on what was cut). Members: the stage table, the plan, the
    summary, the environment, every report, each run's metrics.jsonl, the utilization samples, every log's tail
    (the largest tail that keeps the archive under ``cap_bytes``), the depth study's result."""
    work = Path(work)
    fixed = [p for p in [work / "stages.tsv", work / "plan.tsv", work / "summary.txt", work / "env.txt",
                         work / "depth_study" / "depth_study.json"] if p.is_file()]
    fixed += sorted(work.glob("report_*.json")) + sorted(work.glob("ret/*.cut.txt"))
    metrics = [(p, f"metrics_{p.parent.name[4:]}.jsonl") for p in sorted(work.glob("run_*/metrics.jsonl"))]
    utils = sorted(work.glob("util_*.csv"))
    logs = sorted(work.glob("logs/*.log")) + sorted(work.glob("prep_*.log")) + [p for p in [work / "eval.log"]
                                                                                if p.is_file()]
    note = ""
    for level, cap in enumerate(LOG_CAPS + (0,)):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
            def add(name: str, data: bytes):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))

            for p in fixed:
                add(p.name, p.read_bytes())
            if cap:  # the last resort (cap 0) keeps only the tables and reports
                for p, arc in metrics:
                    add(arc, p.read_bytes())
                for p in utils if level < len(LOG_CAPS) - 1 else []:
                    add(p.name, p.read_bytes())
                for p in logs:
                    add(f"logs/{p.name}", _tail(p, cap))
        if buf.tell() <= cap_bytes:
            if level:
                note = (f"logs cut to their last {cap // 1024} KiB" if cap else
                        "only the tables and reports (metrics, samples and logs did not fit)")
            return buf.getvalue(), note
    return buf.getvalue(), "over the cap even with the tables alone"


def _write_atomic(out: Path, name: str, data: bytes) -> None:
    """``out/name`` replaced in one rename: the only other file that exists meanwhile is TMP_NAME."""
    tmp = out / TMP_NAME
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out / name)


def _own(name: str) -> bool:
    return name in ("summary.txt", "results.tar.gz") or bool(re.match(r"^trace_[A-Za-z0-9_-]+\.json\.gz$", name))


def pack(work: Path, out: Path, max_files: int = 8, file_cap: int = 15 * MIB, total_cap: int = 60 * MIB) -> list[str]:
    """Leave OUT with at most ``max_files`` files (counting whatever else is there, e.g. the caller's tee'd log, and
    the one temporary file a replacement needs): summary.txt, results.tar.gz (results_tar), and the cut traces in
    WORK/ret (trace_KEY.json.gz, in the order WORK/ret/order.txt names them), each at most ``file_cap`` bytes and
    all together at most ``total_cap``. Returns the lines to print (what was left out, if anything)."""
    work, out = Path(work), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    said = []
    text = summary(work)
    (work / "summary.txt").write_text(text)
    stale = out / TMP_NAME
    if stale.exists():  # a pack killed mid-write left it
        stale.unlink()
    present = [p for p in out.rglob("*") if p.is_file() or p.is_symlink()]
    foreign = [p for p in present if not (p.parent == out and _own(p.name))]
    foreign_bytes = sum(p.stat().st_size for p in foreign if p.is_file())
    slots = max_files - len(foreign) - 1  # one for TMP_NAME
    tar, tar_note = results_tar(work, min(12 * MIB, file_cap))
    if tar_note:
        said.append(f"pack: results.tar.gz: {tar_note}")
    want = [("summary.txt", text.encode()), ("results.tar.gz", tar)]
    order = (work / "ret" / "order.txt").read_text().split() if (work / "ret" / "order.txt").is_file() else []
    for key in order:
        p = work / "ret" / f"trace_{key}.json.gz"
        if p.is_file():
            want.append((p.name, p))
    keep, used = [], foreign_bytes
    for name, data in want:
        size = len(data) if isinstance(data, bytes) else data.stat().st_size
        if len(keep) >= slots:
            said.append(f"pack: {name} left out: {max_files} files at most in {out} ({len(foreign)} not the check's)")
            continue
        if size > file_cap or used + size > total_cap:
            said.append(f"pack: {name} left out: {size / MIB:.1f} MiB over the size limits")
            continue
        keep.append((name, data))
        used += size
    names = {n for n, _ in keep}
    state = (f"{out}: " + ", ".join(n for n, _ in keep) + (f" and {len(foreign)} other file(s)" if foreign else "")
             + "".join(f"; {ln.split(': ', 1)[1]}" for ln in said))
    notes = work / "pack.txt"
    old = notes.read_text().splitlines() if notes.is_file() else []
    notes.write_text(state + "\n" + "".join(ln + "\n" for ln in said))
    said = [ln for ln in said if ln not in old]  # each note printed once, not after every later stage
    for p in present:  # own files no longer kept (a trace pushed out by a later foreign file)
        if p.parent == out and _own(p.name) and p.name not in names:
            p.unlink()
    for name, data in keep:
        dest = out / name
        if isinstance(data, Path):
            if dest.is_file() and dest.stat().st_size == data.stat().st_size and \
                    dest.stat().st_mtime >= data.stat().st_mtime:
                continue  # this trace went out in an earlier pack
            data = data.read_bytes()
        _write_atomic(out, name, data)
    return said


def cut_trace(src: Path, dst: Path, max_bytes: int) -> str:
    """Write ``src`` (a Chrome trace, .json or .json.gz) gzipped to ``dst`` in at most ``max_bytes``, dropping the
    least needed events first until it fits; returns what was dropped ("" when nothing). In order: the memory
    events and the operators' recorded shapes (profile_memory, record_shapes); flow arrows and Python frames; the
    CPU operators nested in others; every CPU event but the runtime calls; then only device events, the last ones
    dropped. The kernel classes were counted on the whole trace (bench/gpu.sh reports before it cuts).

    First the whole file gzipped as a stream (no parse: a one-step trace of Eco-RNA fits so in a second or two);
    only a trace that does not fit is parsed and cut."""
    src, dst = Path(src), Path(dst)
    tmp = Path(str(dst) + ".partial")
    if str(src).endswith(".gz"):
        tmp.write_bytes(src.read_bytes())
    else:
        with open(src, "rb") as f, gzip.open(tmp, "wb", compresslevel=6) as g:
            while chunk := f.read(1 << 22):
                g.write(chunk)
    if tmp.stat().st_size <= max_bytes:
        os.replace(tmp, dst)
        return ""
    tmp.unlink()
    data = read_trace_json(src)
    if isinstance(data, list):
        data = {"traceEvents": data}
    events = [e for e in data.get("traceEvents", []) if isinstance(e, dict)]

    def cat(e):
        return str(e.get("cat", "")).lower()

    def slim(e):
        if cat(e) == "cpu_op" and "args" in e:
            e = dict(e, args={k: v for k, v in e["args"].items() if k in ("External id", "Sequence number",
                                                                            "Fwd thread id", "Record function id")})
        return e

    def top_level(evs):
        keep, by_thread = [], {}
        for e in evs:
            if cat(e) == "cpu_op" and e.get("ph") == "X":
                by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
            else:
                keep.append(e)
        for ops in by_thread.values():
            end = -math.inf
            for e in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0))):
                if e["ts"] >= end:
                    keep.append(e)
                    end = e["ts"] + e.get("dur", 0)
        return keep

    device = lambda e: cat(e) in DEVICE_CATS or e.get("ph") == "M"  # noqa: E731 - metadata names the tracks
    levels = [
        ("memory events and operator shapes",
         lambda evs: [slim(e) for e in evs if e.get("name") != "[memory]" and cat(e) != "cpu_instant_event"]),
        ("flows and Python frames", lambda evs: [e for e in evs if e.get("ph") not in ("s", "f", "t")
                                                 and cat(e) not in ("ac2g", "python_function")]),
        ("nested CPU operators", top_level),
        ("CPU operators (runtime calls and device events kept)",
         lambda evs: [e for e in evs if cat(e) in ("cuda_runtime", "cuda_driver") or device(e)]),
        ("everything but device events", lambda evs: [e for e in evs if device(e)]),
    ]
    done = []

    def blob(evs, note):
        d = dict(data, traceEvents=evs)
        if note:
            d["bench_gpu_cut"] = note
        return gzip.compress(json.dumps(d, separators=(",", ":")).encode(), compresslevel=6)

    for what, fn in levels:
        events = fn(events)
        if what:
            done.append(what)
        note = "dropped: " + "; ".join(done) if done else ""
        b = blob(events, note)
        if len(b) <= max_bytes:
            _write_bytes(dst, b)
            return note
    # device events only and still too large: keep the first n of them (by time), n found by bisection
    meta = [e for e in events if e.get("ph") == "M"]
    dev = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: e.get("ts", 0))
    lo, hi, best = 0, len(dev), None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        note = "dropped: " + "; ".join(done) + f"; device events after the first {mid} of {len(dev)}"
        b = blob(meta + dev[:mid], note)
        if len(b) <= max_bytes:
            lo, best = mid, (b, note)
        else:
            hi = mid - 1
    if best is None:
        raise SystemExit(f"gpu_report: {src} does not fit {max_bytes} bytes even without events")
    _write_bytes(dst, best[0])
    return best[1]


def _write_bytes(dst: Path, b: bytes) -> None:
    tmp = Path(str(dst) + ".partial")
    tmp.write_bytes(b)
    os.replace(tmp, dst)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("family", help="print one training's figures")
    f.add_argument("--name", required=True)
    f.add_argument("--run", required=True, type=Path, help="the run directory (metrics.jsonl, profile/)")
    f.add_argument("--util", type=Path, help="sample-util's output")
    f.add_argument("--log", type=Path, help="the training's log (its 'resolved:' line, torch.compile's notes)")
    f.add_argument("--launched", type=float, help="unix time of the launch (when the first step ended after it)")
    f.add_argument("--json", type=Path, help="also write the figures here")
    s = sub.add_parser("sample-util", help="sample GPU utilization until terminated")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--interval-ms", type=int, default=200)
    s.add_argument("--fake", action="store_true", help="0 %% samples without nvidia-smi (dry run)")
    pl = sub.add_parser("plan", help="check the trainings' overrides against the config code")
    pl.add_argument("--runs", required=True, type=Path)
    pl.add_argument("--out", required=True, type=Path)
    sm = sub.add_parser("summary", help="print the closing table")
    sm.add_argument("--work", required=True, type=Path)
    pk = sub.add_parser("pack", help="leave at most --max-files files in OUT")
    pk.add_argument("--work", required=True, type=Path)
    pk.add_argument("--out", required=True, type=Path)
    pk.add_argument("--max-files", type=int, default=8)
    ct = sub.add_parser("cut-trace", help="fit a trace into a byte budget, gzipped")
    ct.add_argument("src", type=Path)
    ct.add_argument("dst", type=Path)
    ct.add_argument("--max-bytes", type=int, default=15 * MIB)
    args = p.parse_args(argv)
    if args.cmd == "sample-util":
        return sample_util(args.out, args.interval_ms, args.fake)
    if args.cmd == "plan":
        rows = plan(read_runs(args.runs))
        write_plan(args.out, rows)
        for r in rows:
            print(f"  {r['name']:<16}{r['status']:<5}" + (f" {r['note']}" if r["note"] else ""))
        return 0
    if args.cmd == "summary":
        print(summary(args.work), end="")
        return 0
    if args.cmd == "pack":
        for line in pack(args.work, args.out, args.max_files):
            print(line)
        return 0
    if args.cmd == "cut-trace":
        note = cut_trace(args.src, args.dst, args.max_bytes)
        print(f"{args.dst}: {args.dst.stat().st_size / MIB:.2f} MiB" + (f" ({note})" if note else ""))
        return 0
    if not (args.run / "metrics.jsonl").is_file():
        raise SystemExit(f"gpu_report: {args.run} has no metrics.jsonl")
    rep, lines = family_report(args.name, args.run, args.util, args.log, args.launched)
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
