#!/usr/bin/env python
"""Per-family figures of bench/gpu.sh's trainings, from what a run leaves behind (docs/gpu_check.md).

    python bench/gpu_report.py family --name "Eco-RNA 80M" --run RUN_DIR [--util UTIL.csv] [--json OUT.json]
    python bench/gpu_report.py sample-util --out UTIL.csv [--interval-ms 200] [--fake]

``family`` reads RUN_DIR/metrics.jsonl (one record a step), RUN_DIR/profile/trace_steps_S-*.json (train.profile)
and the utilization samples, and prints:

* end-to-end tokens/s (real tokens, the trainer's ``tokens_per_s``) and MFU (``mfu``: model FLOPs of the executed
  schedule over train.peak_flops_per_device), medians over the measured steps: every step after the warm-up (the
  first fifth of the steps, at least 5) except the profiled steps and the step after them (the profiler's overhead
  and the trace's export land there);
* step time p50, p90, max and max / median over the same steps (a max far above the median: stalls, e.g. the
  loader or a recompile);
* peak GPU memory: the largest ``peak_mem_gib`` (torch.cuda.max_memory_allocated of rank 0, pipeline/train/
  callbacks.py) of the run;
* GPU utilization: nvidia-smi's utilization.gpu (the share of time a kernel ran) sampled every 200 ms by
  ``sample-util``, over the measured steps' wall-clock window;
* the profiled step's time per kernel class (matmul, attention, elementwise, reduction, optimizer, communication,
  memcpy, other) and idle (the step's wall time with no kernel, copy or memset on the device), from the trace's
  device events; a trace without device events (a CPU run) is broken down by the CPU operators' self time instead.

``sample-util`` runs ``nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200`` and writes
``unix_time,percent`` a line until it is terminated; ``--fake`` writes 0 % samples without nvidia-smi (the dry run).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

CLASSES = ("matmul", "attention", "elementwise", "reduction", "optimizer", "communication", "memcpy", "other")
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# First match wins, so the specific classes come before the broad ones (a cuDNN attention kernel's name holds
# "gemm"-like parts; an NCCL kernel holds "reduce"). Names are CUDA kernel names or, for a CPU trace, aten ops.
RULES = [
    ("communication", r"nccl|c10d|gloo|all_?reduce|all_?gather|reduce_?scatter|all_to_all|alltoall"),
    ("memcpy", r"memcpy|memset|aten::copy_|aten::_to_copy|aten::to$|aten::contiguous|aten::clone"),
    ("optimizer", r"optimizer|adam|multi_tensor_apply|lamb\b|aten::_foreach_|sgd"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|cudnn::fusion"),
    ("matmul", r"gemm|gemv|cutlass|xmma|cublas|matmul|nvjet|wgmma|grouped_mm|aten::(?:mm|addmm|bmm|baddbmm|linear)$"
               r"|sm\d\d_|ampere_|hopper_|volta_|turing_"),
    ("reduction", r"reduce|norm(?!al)|softmax|aten::(?:sum|mean|max|min|amax|amin|argmax|var|std|cumsum|topk|sort)"
                  r"|cross_entropy|nll_loss|cub::|scan|radix"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_|pointwise|aten::|index|gather|scatter|fill|where|"
                    r"embedding|dropout|normal|random|cat|silu|gelu|exp|pow|rsqrt|mul|add|div"),
]
_RULES = [(c, re.compile(p, re.IGNORECASE)) for c, p in RULES]


def kernel_class(name: str) -> str:
    """The class of one CUDA kernel (or, in a CPU trace, one aten operator) by its name; "other" when no rule
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
            "loss_first": recs[0].get("loss"), "loss_last": recs[-1].get("loss"),
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


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"gpu_report: cannot read the trace {path}: {e}")
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def kernel_breakdown(events: list[dict]) -> dict:
    """{"device": "cuda"|"cpu", "wall_ms", "idle_ms", "ms": {class: ms}} of one profiled window.

    The window is the span of every complete event in the trace (the profiler runs from just before the step to
    just after it). With device events (kernels, memcpys, memsets): each class's summed durations (streams that
    overlap count twice, so the classes can add up to more than busy time) and idle = window - the union of the
    device intervals. Without (a CPU run): the self time (duration less the nested operators on the same thread) of
    each CPU operator, and idle = window - the union of the outermost operators."""
    if not events:
        raise SystemExit("gpu_report: the trace holds no complete event")
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    ms = dict.fromkeys(CLASSES, 0.0)
    device = [e for e in events if str(e.get("cat", "")).lower() in DEVICE_CATS]
    if device:
        for e in device:
            cat = str(e.get("cat", "")).lower()
            cls = "memcpy" if cat in ("gpu_memcpy", "gpu_memset") else kernel_class(str(e.get("name", "")))
            ms[cls] += e["dur"] / 1e3
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
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
        kind = "cpu"
    wall = (t1 - t0) / 1e3
    return {"device": kind, "wall_ms": wall, "idle_ms": max(wall - busy / 1e3, 0.0), "ms": ms}


def find_trace(run: Path) -> tuple[Path | None, set[int]]:
    """The run's profile trace and the steps it covers (from its name, trace_steps_S-E.json)."""
    for p in sorted((run / "profile").glob("trace_steps_*.json*")):
        m = re.match(r"trace_steps_(\d+)-(\d+|end)\.json", p.name)
        if m:
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) != "end" else start
            return p, set(range(start, end + 1))
    return None, set()


def family_report(name: str, run: Path, util: Path | None = None) -> tuple[dict, list[str]]:
    """(the figures, the printed lines) of one family's run."""
    trace, profiled = find_trace(run)
    st = step_stats(load_metrics(run / "metrics.jsonl"), profiled)
    rep = {"family": name, "run": str(run), **st}
    lines = [f"== {name}: {st['steps']} steps; measured {st['measured']} (steps {st['first_measured']}-"
             f"{st['last_measured']}: the first {st['warmup']} are warm-up"
             + (f", profiled step(s) {min(profiled)}-{max(profiled)} and the step after left out)" if profiled
                else ")")]
    mfu = "n/a (no train.peak_flops_per_device)" if st["mfu"] is None else f"{st['mfu']:.1%}"
    mem = ("n/a (no peak_mem_gib in metrics.jsonl: a CPU run)" if st["peak_mem_gib"] is None
           else f"{st['peak_mem_gib']:.2f} GiB")
    lines.append(f"  tokens/s (median) {st['tokens_per_s']:.0f} | MFU (median) {mfu} | peak GPU memory {mem} | "
                 f"loss {st['loss_first']:.3f} -> {st['loss_last']:.3f}")
    s = st["step_ms"]
    lines.append(f"  step time: p50 {s['p50']:.0f} ms | p90 {s['p90']:.0f} ms | max {s['max']:.0f} ms | "
                 f"max/median {s['max_over_median']:.2f}")
    rep["util"] = None
    if util is not None and util.is_file():
        rep["util"] = util_stats(load_util(util), st["window"])
    u = rep["util"]
    lines.append("  GPU utilization: no samples in the measured window" if u is None else
                 f"  GPU utilization (every 200 ms over the measured steps): mean {u['mean']:.0f}% | median "
                 f"{u['median']:.0f}% | samples at 0%: {u['zero_share']:.0%} (n {u['n']})")
    rep["profile"] = None
    if trace is None:
        lines.append("  profiled step: no trace (the run ended before train.profile.start)")
    else:
        kb = kernel_breakdown(load_trace(trace))
        rep["profile"] = {"trace": str(trace), "steps": sorted(profiled), **kb}
        parts = " | ".join(f"{c} {kb['ms'][c] / kb['wall_ms']:.1%}" for c in CLASSES if kb["ms"][c] > 0 or
                           c != "other")
        lines.append(f"  profiled step {min(profiled)} ({kb['device']}, {kb['wall_ms']:.0f} ms wall, shares of it): "
                     f"{parts} | idle {kb['idle_ms'] / kb['wall_ms']:.1%}")
    lines.append(f"RESULT GPU_FAMILY {name.replace(' ', '_')} tokens_per_s={st['tokens_per_s']:.0f} "
                 f"mfu={st['mfu'] if st['mfu'] is not None else 'nan'} p50_ms={s['p50']:.1f} "
                 f"max_over_median={s['max_over_median']:.2f} util_mean={u['mean'] if u else 'nan'} "
                 f"peak_mem_gib={st['peak_mem_gib'] if st['peak_mem_gib'] is not None else 'nan'}")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("family", help="print one family's figures")
    f.add_argument("--name", required=True)
    f.add_argument("--run", required=True, type=Path, help="the run directory (metrics.jsonl, profile/)")
    f.add_argument("--util", type=Path, help="sample-util's output")
    f.add_argument("--json", type=Path, help="also write the figures here")
    s = sub.add_parser("sample-util", help="sample GPU utilization until terminated")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--interval-ms", type=int, default=200)
    s.add_argument("--fake", action="store_true", help="0 %% samples without nvidia-smi (dry run)")
    args = p.parse_args(argv)
    if args.cmd == "sample-util":
        return sample_util(args.out, args.interval_ms, args.fake)
    if not (args.run / "metrics.jsonl").is_file():
        raise SystemExit(f"gpu_report: {args.run} has no metrics.jsonl")
    rep, lines = family_report(args.name, args.run, args.util)
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
