#!/usr/bin/env python
"""Every CPU benchmark in one run, and one table of their figures against the targets.

    python bench/run_all.py [--full] [--only NAME ...] [--timeout 480]

Runs each script of BENCHES as its own subprocess (this python, cwd = the repository root), with ``--quick`` unless
``--full``, streams its output (prefixed with its name) and collects its ``RESULT <ID> <value> <description>``
lines. Each figure is a ratio both sides of which were measured in that script's one run. At the end it prints every
figure, marked against its target (TARGETS), the wall time of each script and the total.

Exit status 0 when every script ran, exited 0 and printed every figure it owes (FIGURES) as a well-formed RESULT
line; 1 otherwise, naming each script that failed and why. A figure that misses its target is marked MISS in the
table but is not a failure: the scripts measured what they measured. P5 (GPU MFU) is not here: bash bench/gpu.sh
measures it on a CUDA host.

The default (--quick) run takes a few minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import math
import operator
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (name, script relative to the repository root, the figure IDs it must print). A script may print more (e.g. the
# per-setup P6.<setup> lines); those appear in the table unmarked unless TARGETS names them.
BENCHES = [
    ("wavefront", "bench/wavefront.py", ("P1", "P1.waste", "P1.gather")),
    ("data", "bench/data.py", ("P2", "P3", "P3.steady", "P3w2", "P3j2")),
    ("padding", "bench/padding.py", ("P6",)),
    ("engine", "bench/engine.py", ("P4", "scaling")),
    ("activation checkpointing", "bench/activation_checkpointing.py", ("AC.memory", "AC.step")),
    ("validation", "bench/validation.py", ("VAL.overhead", "VAL.per_eval")),
    ("step proxies", "bench/step_proxies.py",
     ("OPS.step", "OPS.forward", "OPS.backward", "OPS.optimizer", "SYNC.micro", "SYNC.step", "SHAPES.core",
      "SHAPES.core.packed", "SHAPES.tokens")),
    ("compiled", "bench/compiled.py",
     ("COMPILE.breaks.padded", "COMPILE.breaks.packed", "COMPILE.graphs.padded", "COMPILE.graphs.packed",
      "COMPILE.loss.padded", "COMPILE.loss.packed", "HOST.step", "HOST.token")),
    ("checkpoint stall", "bench/checkpoint_stall.py", ("CKPT.stall2", "CKPT.loss2")),
    ("flops check", "bench/flops_check.py",
     ("FLOPS.eco_rna_80m", "FLOPS.eco_rna_control_stage_a", "FLOPS.protlingo_150m", "FLOPS.recursive_gpt_100m",
      "FLOPS.standard_h384")),
    ("remote shards", "bench/remote_data.py", ("REMOTE.wait_share",)),
]

# Every other bench/*.py, and why it is not in BENCHES (tests/bench/test_bench_quick.py checks that each script is
# in exactly one of the two, so a new bench is a conscious choice). Each has its own smoke test there or elsewhere.
NOT_IN_RUN_ALL = {
    "bench/run_all.py": "this runner",
    "bench/adaptive_depth.py": "needs a trained Eco-RNA export and prints a verdict on it (exit 0/1), no RESULT figure",
    "bench/babylm_pipeline.py": "needs a checkout of babylm/evaluation-pipeline-2025 and a text export; its RESULT "
                                "BABYLM.time and BABYLM.agree are in docs/benchmarks.md",
    "bench/comm_volume.py": "a correctness check (counted against predicted bytes, exit 0/1), no RESULT figure",
    "bench/depth_study.py": "a training study of minutes to hours; its verdict is OUT/depth_study.json",
    "bench/depth_task.py": "a training study (27 minutes); its verdict is OUT/depth_task.json",
    "bench/eco_rna_gpu.py": "needs CUDA: its RESULT P5 is measured by bash bench/gpu.sh",
    "bench/gpu_report.py": "reads the run directories of bash bench/gpu.sh's trainings (CUDA); per-family report",
    "bench/moe_gpu.py": "needs CUDA (bash bench/gpu.sh); a speed table, no RESULT figure",
    "bench/protlingo_ablation.py": "trains 4 models for minutes; perplexities without a target, no RESULT figure",
}

# ID -> (comparison, bound). P3w2 is data_prep with two workers against one gzip -dc: 0.5 of gzip's rate per worker
# is 1.0 in all. P3uc is `uniref --clusters` held to P3's bound; P3uc.rss10 its peak memory on 10 x the input over
# 1 x (bounded by the cluster map, not the input); P3j2 one job / two concurrent --num-jobs jobs on plain FASTA
# (near 2 on 2 free cores). P3uc, P3uc.rss10 and P3ucw2 (--workers 2 over 1 process) need ../shared/data's UniRef90
# sample, so BENCHES does not owe them. P2 has no target: its floor is a vectorized read of whole blocks, so it measures the loader's per-sample
# work (framing, masking, collate), which P6 and the training step put in proportion.
TARGETS = {
    "P1": ("<=", 1.10),
    "P1.waste": ("==", 0.0),
    "SHAPES.core.packed": ("<=", 64),  # over 100 loader steps (the default run; --quick counts 5)
    "SHAPES.tokens": ("<=", 1.05),
    "COMPILE.breaks.padded": ("==", 0.0),
    "COMPILE.breaks.packed": ("==", 0.0),
    "COMPILE.graphs.packed": ("<=", 40),  # eco_rna_80m's token buckets
    "COMPILE.loss.padded": ("<=", 1e-5),
    "COMPILE.loss.packed": ("<=", 1e-5),
    "HOST.token": (">=", 4.0),
    "P3": (">=", 0.5),
    "P3.steady": (">=", 0.5),
    "P3w2": (">=", 1.0),
    "P3uc": (">=", 0.5),
    "P3uc.rss10": ("<=", 1.2),
    "P3ucw2": (">=", 1.3),  # --workers 2 --clusters over 1 process (issue 50)
    "P3j2": (">=", 1.7),
    "P4": ("<=", 1.15),
    "P6": ("<=", 1.05),
    # a background checkpoint save's stall over a synchronous one's, 80M config on 2 CPU ranks (issue 49), and the
    # losses of the two runs, which must be the same bit for bit
    "CKPT.stall2": ("<=", 0.10),
    "CKPT.loss1": ("==", 0.0),
    "CKPT.loss2": ("==", 0.0),
    # The 80M step's CPU proxies of GPU work (docs/performance.md): no device read inside the microbatch loop, and
    # a quarter of the 20,895 operators one step dispatched at commit 354b0c0.
    "SYNC.micro": ("==", 0.0),
    "OPS.step": ("<=", 5224),
    # FLOPs one training microbatch executes / the FLOPs its MFU counts, per family (issue 47; exact today,
    # tests/bench/test_flops_check.py)
    **{f"FLOPS.{c}": ("<=", 1.10) for c in ("eco_rna_80m", "eco_rna_control_stage_a", "protlingo_150m",
                                             "recursive_gpt_100m", "standard_h384")},
}
_OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}

RESULT_RE = re.compile(r"^RESULT\s+(\S+)\s+(\S+)(?:\s+(.*))?$")


@dataclass
class Figure:
    id: str
    value: float
    description: str
    bench: str


@dataclass
class BenchRun:
    name: str
    script: str
    expected: tuple
    args: tuple = ()  # after --quick (tests/bench/test_bench_quick.py runs some scripts smaller still)
    rc: int | None = None  # None: not started (missing script) or killed at the timeout
    seconds: float = 0.0
    figures: list = field(default_factory=list)
    problems: list = field(default_factory=list)  # why this script counts as failed; empty when it passed

    @property
    def failed(self) -> bool:
        return bool(self.problems)


def parse_result_line(line: str, bench: str) -> Figure | str | None:
    """A Figure for a well-formed RESULT line, an error string for a malformed one, None for any other line."""
    s = line.strip()
    if not s.startswith("RESULT"):
        return None
    m = RESULT_RE.match(s)
    if not m:
        return f"malformed RESULT line {s!r} (want 'RESULT <ID> <value> <description>')"
    try:
        value = float(m.group(2))
    except ValueError:
        return f"RESULT {m.group(1)}: value {m.group(2)!r} is not a number"
    if not math.isfinite(value):
        return f"RESULT {m.group(1)}: value {m.group(2)} is not finite"
    return Figure(m.group(1), value, (m.group(3) or "").strip(), bench)


def check_target(fig_id: str, value: float) -> str:
    """'ok', 'MISS' or '-' (no target for this ID)."""
    if fig_id not in TARGETS:
        return "-"
    op, bound = TARGETS[fig_id]
    return "ok" if _OPS[op](value, bound) else "MISS"


def target_text(fig_id: str) -> str:
    if fig_id not in TARGETS:
        return ""
    op, bound = TARGETS[fig_id]
    return f"{op} {bound:g}"


def run_bench(run: BenchRun, quick: bool, timeout: float, python: str = sys.executable, out=None) -> BenchRun:
    """Run one script, stream its output prefixed with its name, collect its RESULT lines and its problems."""
    out = sys.stdout if out is None else out
    path = REPO / run.script if not Path(run.script).is_absolute() else Path(run.script)
    if not path.is_file():
        run.problems.append(f"{run.script} not found")
        return run
    cmd = [python, str(path)] + (["--quick"] if quick else []) + [str(a) for a in run.args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=_env())
    killed = threading.Event()

    def kill():  # a hung benchmark must not hold up the rest
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        for line in proc.stdout:
            out.write(f"[{run.name}] {line}")
            out.flush()
            parsed = parse_result_line(line, run.name)
            if isinstance(parsed, Figure):
                run.figures.append(parsed)
            elif isinstance(parsed, str):
                run.problems.append(parsed)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run.seconds = time.perf_counter() - t0
    if killed.is_set():
        run.problems.append(f"killed after the {timeout:g} s timeout")
    else:
        run.rc = rc
        if rc != 0:
            run.problems.append(f"exited with status {rc}")
    if not run.figures:
        if run.expected:  # a script that owes no figure (a smoke run of one that prints none) may print none
            run.problems.append("printed no RESULT line")
    else:
        seen = {f.id for f in run.figures}
        missing = [i for i in run.expected if i not in seen]
        if missing:
            run.problems.append(f"printed no RESULT line for {', '.join(missing)}")
        dup = sorted({f.id for f in run.figures if sum(g.id == f.id for g in run.figures) > 1})
        if dup:
            run.problems.append(f"printed {', '.join(dup)} more than once")
    return run


def _env() -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # stream the scripts' progress as it happens
    return env


def format_table(runs: list) -> str:
    """Every figure of every run, marked against its target; then each script's wall time and status; the total."""
    rows = [("figure", "value", "target", "", "bench", "description")]
    for r in runs:
        for f in r.figures:
            rows.append((f.id, f"{f.value:.4g}", target_text(f.id), check_target(f.id, f.value), r.name,
                         f.description))
        for i in r.expected:
            if i not in {f.id for f in r.figures}:
                rows.append((i, "n/a", target_text(i), "NONE", r.name, "not printed"))
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    lines.insert(1, "-" * (sum(widths) + 2 * 5 + 11))
    lines.append("")
    wn = max(len("bench"), *(len(r.name) for r in runs)) + 2
    ws = max(len("script"), *(len(r.script) for r in runs)) + 2
    lines.append(f"{'bench':<{wn}}{'script':<{ws}}{'wall s':>8}  status")
    for r in runs:
        status = "ok" if not r.failed else "FAILED: " + "; ".join(r.problems)
        lines.append(f"{r.name:<{wn}}{r.script:<{ws}}{r.seconds:>8.1f}  {status}")
    lines.append(f"{'total':<{wn + ws}}{sum(r.seconds for r in runs):>8.1f}")
    misses = [f.id for r in runs for f in r.figures if check_target(f.id, f.value) == "MISS"]
    if misses:
        lines.append(f"figures missing their target: {', '.join(misses)}")
    return "\n".join(lines)


def main(argv=None, benches=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="run each script at its default size instead of --quick")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="run only these benches (names: " + ", ".join(b[0] for b in BENCHES) + ")")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds one script may run (default 480)")
    args = p.parse_args(argv)
    benches = BENCHES if benches is None else benches
    names = [b[0] for b in benches]
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            p.error(f"--only: unknown bench {unknown[0]!r} (known: {', '.join(names)})")
        benches = [b for b in benches if b[0] in args.only]
    runs = []
    t0 = time.perf_counter()
    for name, script, expected in benches:
        print(f"== {name}: {script}{'' if args.full else ' --quick'}", flush=True)
        runs.append(run_bench(BenchRun(name, script, tuple(expected)), quick=not args.full, timeout=args.timeout))
    print()
    print(format_table(runs))
    print(f"run_all: {time.perf_counter() - t0:.1f} s wall")
    failed = [r for r in runs if r.failed]
    if failed:
        for r in failed:
            print(f"run_all: FAILED {r.name} ({r.script}): {'; '.join(r.problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
