"""bench/gpu_report.py's parts that turn bench/gpu.sh's runs into what a lease returns: the A/B plan checked against
the real config code, the summary table, the packing of OUT within the device's limits at every moment, and the cut
of a trace too large to return."""
import gzip
import io
import json
import os
import random
import tarfile
from pathlib import Path

import pytest

from bench import gpu_report as gr
from tests.bench.test_gpu_report import write_metrics

REPO = Path(__file__).resolve().parents[2]
RNA = "launchers/configs/eco_rna_80m.yaml"


# ---- plan ---------------------------------------------------------------------------------------------------------
def runs_file(tmp_path: Path, rows: list[tuple]) -> Path:
    p = tmp_path / "runs.tsv"
    p.write_text("".join(f"{n}\t{b}\t{RNA}\t{w}\t{gr.SEP.join(s)}\n" for n, b, w, s in rows))
    return p


def test_plan_checks_every_row_against_the_config_code(tmp_path):
    rows = gr.plan(gr.read_runs(runs_file(tmp_path, [
        ("rna", "-", "Eco-RNA", ["tracking.enabled=false", "data.train_shards=/nowhere", "?train.no_such_key=1"]),
        ("padded", "rna", "packed layout off", ["model.unpad=false"]),
        ("compiled", "rna", "compile on", ["train.compile=blocks"]),
        ("compiled_plain", "compiled", "fused norm off, compiled", ["train.fused_norm=false"]),
        ("unknown", "rna", "a switch still to come", ["train.no_such_switch=true"]),
        ("on_unknown", "unknown", "its base cannot run", ["train.fused_norm=false"]),
        ("same", "rna", "already the default", ["train.fused_norm=true"]),
        ("bad_value", "rna", "a value the config refuses", ["train.compile=everything"]),
    ])))
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == ["rna", "padded", "compiled", "compiled_plain", "unknown", "on_unknown",
                                         "same", "bad_value"]
    assert by["rna"]["status"] == "run" and "train.no_such_key=1" not in by["rna"]["sets"]
    assert by["rna"]["note"].startswith("without train.no_such_key=1: ") and "unknown config key" in by["rna"]["note"]
    assert by["padded"]["status"] == "run" and by["padded"]["note"] == "changes model.unpad"
    assert by["padded"]["sets"][:2] == ["tracking.enabled=false", "data.train_shards=/nowhere"]  # the base's first
    assert by["compiled_plain"]["status"] == "run" and by["compiled_plain"]["note"] == "changes train.fused_norm"
    assert {"train.compile=blocks", "train.fused_norm=false"} <= set(by["compiled_plain"]["sets"])  # a chain
    assert by["unknown"]["status"] == "skip" and by["unknown"]["note"] == (
        "--set train.no_such_switch=true: train.no_such_switch: unknown config key")  # the config's own words
    assert by["on_unknown"]["status"] == "skip" and "its base unknown does not run" in by["on_unknown"]["note"]
    assert by["same"]["status"] == "skip" and "equals rna's" in by["same"]["note"]
    assert by["bad_value"]["status"] == "skip" and "train.compile" in by["bad_value"]["note"]
    gr.write_plan(tmp_path / "plan.tsv", rows)  # and back, as bash and the summary read it
    back = gr.read_plan(tmp_path / "plan.tsv")
    assert [(r["name"], r["status"], r["note"], r["sets"]) for r in back] == [
        (r["name"], r["status"], r["note"], r["sets"]) for r in rows]
    # bash reads plan.tsv with IFS=tab, which collapses empty fields: none is empty
    assert all("\t\t" not in ln for ln in (tmp_path / "plan.tsv").read_text().splitlines())


# ---- summary ------------------------------------------------------------------------------------------------------
def fake_run(work: Path, name: str, step_s: float, mfu_scale: float, first: float = 0.5, log: str = "",
             profile: bool = True) -> None:
    run = work / f"run_{name}"
    (run / "profile").mkdir(parents=True)
    times = [first] + [step_s] * 19
    write_metrics(run / "metrics.jsonl", times)
    if mfu_scale != 1:  # write_metrics' mfu is 0.01 / step_time
        recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        for r in recs:
            if "mfu" in r:
                r["mfu"] *= mfu_scale
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if profile:
        ev = [{"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 2000},
              {"ph": "X", "cat": "kernel", "name": "vectorized_layer_norm_kernel", "ts": 2000, "dur": 1000},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10000, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 4000, "dur": 1000,
               "pid": 1, "tid": 1}]
        (run / "profile" / "trace_steps_12-12.json").write_text(json.dumps({"traceEvents": ev}))
    (work / "logs").mkdir(exist_ok=True)
    (work / "logs" / f"{name}.log").write_text(log)
    rep, _ = gr.family_report(name, run, log=work / "logs" / f"{name}.log")
    (work / f"report_{name}.json").write_text(json.dumps(rep))


def test_summary_puts_families_against_targets_and_variants_against_their_base(tmp_path):
    work = tmp_path
    fake_run(work, "rna", 0.1, 10.0, log="resolved: layout=packed attention=torch_varlen norm=fused\n")  # MFU 100%
    fake_run(work, "gpt", 0.1, 1.0)  # MFU 10%: short of 45 %
    fake_run(work, "rna_padded", 0.2, 10.0, log="resolved: layout=padded attention=sdpa norm=fused\n")
    fake_run(work, "rna_compiled", 0.1, 10.0, first=95.0,
             log="[__recompiles] Recompiling function forward\n" * 3 + "Graph break in user code\n")
    rows = [{"name": "rna", "base": "-", "status": "run", "note": "", "config": RNA, "what": "Eco-RNA 80M",
             "sets": ["a=1"]},
            {"name": "gpt", "base": "-", "status": "run", "note": "", "config": RNA, "what": "GPT", "sets": ["a=1"]},
            {"name": "rna_padded", "base": "rna", "status": "run", "note": "changes model.unpad", "config": RNA,
             "what": "packed layout off", "sets": ["a=1", "model.unpad=false"]},
            {"name": "rna_compiled", "base": "rna", "status": "run", "note": "changes train.compile", "config": RNA,
             "what": "compiled blocks on", "sets": ["a=1", "train.compile=blocks"]},
            {"name": "rna_graphs", "base": "rna_compiled", "status": "skip", "note": "train.cuda_graphs: unknown",
             "config": RNA, "what": "CUDA graphs on", "sets": []},
            {"name": "rna_mb16k", "base": "rna", "status": "run", "note": "", "config": RNA, "what": "auto off",
             "sets": []},
            {"name": "not_wanted", "base": "rna", "status": "run", "note": "", "config": RNA, "what": "x",
             "sets": []}]
    gr.write_plan(work / "plan.tsv", rows)
    (work / "wanted.txt").write_text("rna gpt rna_padded rna_compiled rna_graphs rna_mb16k\n")
    (work / "stages.tsv").write_text("tests\tok\t44\t150\t9 passed, 8 skipped in 41s\n"
                                     "rna_mb16k\tnot run\t0\t-\tdeadline: 20 s left of 560, needs 55\n")
    (work / "summary_head.txt").write_text("NVIDIA H200, CUDA 13.0; full check; GPU_DEADLINE 560 s\n")
    text = gr.summary(work)
    lines = text.splitlines()
    assert lines[0] == "== bench/gpu.sh summary: NVIDIA H200, CUDA 13.0; full check; GPU_DEADLINE 560 s"
    assert any(ln.split()[:3] == ["tests", "ok", "44"] for ln in lines)
    fam = next(ln for ln in lines if ln.startswith("  rna ")).split()
    assert fam[1:5] == ["10000", "100.0%", "25.0%", "100"]  # tokens/s, MFU, target, p50 ms
    padded = next(ln for ln in lines if ln.startswith("  rna_padded ")).split()
    assert padded[1:4] == ["rna", "5000", "0.50"]  # half the base's tokens/s
    assert "layout=padded attention=sdpa" in text  # what the variant's own resolved line changed
    assert next(ln for ln in lines if ln.startswith("  rna_graphs ")).endswith(
        "CUDA graphs on: train.cuda_graphs: unknown")
    assert "deadline: 20 s left of 560, needs 55" in next(ln for ln in lines if ln.startswith("  rna_mb16k "))
    assert "not_wanted" not in text  # not part of this invocation
    assert "rna: MFU 100.0% against 25%: met" in text
    gpt = next(ln for ln in lines if ln.strip().startswith("gpt: MFU"))
    assert "against 45%: missed; the step goes to idle 70%, gemm 20%, norm 10%" in gpt  # where its step goes
    assert "2 kernels and host 9 ms of 10 ms a step" in gpt  # 10 ms of operators less 1 ms waiting
    comp = next(ln for ln in lines if ln.strip().startswith("rna_compiled: first step"))
    assert "first step 95.0 s (compiling) against 30 s: missed: 3 recompiles, 1 graph breaks logged" in comp
    assert "the uncompiled base's first step took 0.5 s" in comp
    assert "rna_padded: first step" not in text  # not compiled: no such verdict
    assert "4 run(s) with no step over 2x their median after warm-up" in text
    head = next(i for i, ln in enumerate(lines) if ln.startswith("where the profiled step goes"))
    assert lines[head + 1].split() == ["run", "gemm", "attn", "norm", "tri_red", "tri_poi", "reduce", "elemw",
                                       "optim", "comm", "copy", "other", "idle"]


def test_summary_of_a_check_killed_before_any_training(tmp_path):
    (tmp_path / "stages.tsv").write_text("plan\tok\t2\t120\t7 of 9 trainings can run here\n"
                                         "tests\tkilled\t12\t150\tSIGTERM after 20 s\n")
    text = gr.summary(tmp_path)
    assert text.splitlines()[0] == "== bench/gpu.sh summary" and "killed" in text


# ---- pack -----------------------------------------------------------------------------------------------------------
def work_with_traces(tmp_path: Path, n: int, size: int = 1000) -> Path:
    work = tmp_path / "work"
    (work / "ret").mkdir(parents=True)
    (work / "stages.tsv").write_text("rna\tok\t60\t120\t-\n")
    order = []
    for i in range(n):
        (work / "ret" / f"trace_r{i}.json.gz").write_bytes(os.urandom(size))
        order.append(f"r{i}")
    (work / "ret" / "order.txt").write_text("\n".join(order) + "\n")
    return work


def count_at_every_write(monkeypatch, out: Path) -> list[int]:
    """The number of files in OUT at each moment pack renames one into place (its temporary file still there)."""
    seen, real = [], os.replace

    def replace(a, b):
        if Path(b).parent == out:
            seen.append(sum(1 for p in out.rglob("*") if p.is_file()))
        return real(a, b)

    monkeypatch.setattr(gr.os, "replace", replace)
    return seen


def test_pack_never_holds_more_than_eight_files(tmp_path, monkeypatch):
    work = work_with_traces(tmp_path, 9)
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu.log").write_text("the caller's tee\n")  # not the check's: counted, never touched
    (out / gr.TMP_NAME).write_bytes(b"left by a pack killed mid-write")
    seen = count_at_every_write(monkeypatch, out)
    said = gr.pack(work, out)
    names = sorted(p.name for p in out.iterdir())
    # 7 files: the eighth place is the temporary file of the next replacement
    assert names == sorted(["gpu.log", "summary.txt", "results.tar.gz"] + [f"trace_r{i}.json.gz" for i in range(4)])
    assert seen and max(seen) <= 8, seen
    assert sum("left out: 8 files at most" in ln for ln in said) == 5  # r4 .. r8
    assert (work / "pack.txt").read_text().splitlines()[0] == (
        f"{out}: summary.txt, results.tar.gz, trace_r0.json.gz, trace_r1.json.gz, trace_r2.json.gz, "
        "trace_r3.json.gz and 1 other file(s); trace_r4.json.gz left out: 8 files at most in "
        f"{out} (1 not the check's); " + "; ".join(
            f"trace_r{i}.json.gz left out: 8 files at most in {out} (1 not the check's)" for i in range(5, 9)))
    assert gr.pack(work, out) == []  # the same notes are not printed again after the next stage
    assert "returned: " in (work / "summary.txt").read_text()  # the summary says what went out
    # more of the caller's files: the check's traces give way, the summary comes first
    for i in range(4):
        (out / f"other{i}.txt").write_text("x")
    gr.pack(work, out)
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 7 and "summary.txt" in names and "results.tar.gz" in names, names
    assert not any(n.startswith("trace_") for n in names)


def test_pack_size_limits_and_the_results_archive(tmp_path):
    work = work_with_traces(tmp_path, 2, size=3000)
    write_metrics(work / "metrics.jsonl", [0.1] * 3)
    (work / "run_rna").mkdir()
    (work / "run_rna" / "metrics.jsonl").write_text((work / "metrics.jsonl").read_text())
    (work / "report_rna.json").write_text("{}")
    (work / "logs").mkdir()
    (work / "logs" / "rna.log").write_bytes(os.urandom(600_000))  # incompressible: its tail is cut to fit
    out = tmp_path / "out"
    said = gr.pack(work, out, file_cap=2500)  # each file at most 2,500 bytes: the 3,000-byte traces are left out
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.txt"], said
    assert all(p.stat().st_size <= 2500 for p in out.iterdir())
    assert [ln.split(":")[1].strip() for ln in said if "over the size limits" in ln] == [
        "trace_r0.json.gz left out", "trace_r1.json.gz left out"]
    tar, note = gr.results_tar(work, 300_000)
    assert len(tar) <= 300_000 and note.startswith("logs cut to their last ")
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        names = t.getnames()
        log = t.extractfile("logs/rna.log").read()
    assert {"stages.tsv", "report_rna.json", "metrics_rna.jsonl", "logs/rna.log"} <= set(names), names
    assert log.startswith(b"[... the first ") and len(log) < 600_000
    tar, note = gr.results_tar(work, 2000)  # not even the smallest tails fit: tables and reports only
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        assert "logs/rna.log" not in t.getnames() and "report_rna.json" in t.getnames()
    assert note


# ---- cut-trace ------------------------------------------------------------------------------------------------------
def big_trace(path: Path, n_ops: int = 3000, n_kernels: int = 600) -> list[dict]:
    """A profiler-like trace: CPU operators with recorded shapes (random, so that they do not compress away), nested
    operators, memory events, flows, runtime calls and kernels."""
    rng = random.Random(0)
    ev = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}}]
    for i in range(n_ops):
        ev.append({"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 37}", "ts": i * 10, "dur": 8, "pid": 1,
                   "tid": 1, "args": {"External id": i, "Input Dims": [[rng.randrange(1 << 30) for _ in range(6)]],
                                      "Input type": ["c10::BFloat16"] * 3}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": i * 10 + 1, "dur": 2, "pid": 1, "tid": 1,
                   "args": {"External id": 100000 + i}})
        ev.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": i * 10 + 2, "pid": 1, "tid": 1,
                   "args": {"Addr": rng.randrange(1 << 40), "Bytes": rng.randrange(1 << 20)}})
        ev.append({"ph": "s", "cat": "ac2g", "id": i, "ts": i * 10 + 3, "pid": 1, "tid": 1})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": i * 10 + 3, "dur": 1,
                   "pid": 1, "tid": 1, "args": {"correlation": i}})
    names = ["nvjet_sm90_gemm", "vectorized_layer_norm_kernel", "triton_poi_fused_add_0", "flash_fwd_kernel"]
    for i in range(n_kernels):
        ev.append({"ph": "X", "cat": "kernel", "name": names[i % 4], "ts": i * 50, "dur": 20 + i % 7, "pid": 0,
                   "tid": 7, "args": {"correlation": i}})
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev}))
    return ev


def device_figures(events) -> tuple:
    kb = gr.kernel_breakdown([e for e in events if e.get("ph") == "X"])
    return kb["kernels"], kb["copies"], {c: round(v, 6) for c, v in kb["ms"].items() if c not in ("other",)}


def test_cut_trace_fits_the_budget_and_keeps_the_device_events(tmp_path):
    src = tmp_path / "trace_steps_5-5.json"
    events = big_trace(src)
    whole = tmp_path / "whole.json.gz"
    assert gr.cut_trace(src, whole, 10 << 20) == ""  # it fits gzipped: the same trace, nothing dropped
    assert json.loads(gzip.decompress(whole.read_bytes()))["traceEvents"] == events
    full = len(whole.read_bytes())
    cut = tmp_path / "cut.json.gz"
    note = gr.cut_trace(src, cut, full // 3)
    data = json.loads(gzip.decompress(cut.read_bytes()))
    assert cut.stat().st_size <= full // 3 and note.startswith("dropped: memory events and operator shapes")
    assert data["bench_gpu_cut"] == note  # the trace says what it lost
    assert device_figures(data["traceEvents"]) == device_figures(events)  # every kernel is still there
    assert not any(e.get("name") == "[memory]" for e in data["traceEvents"])
    assert not list(tmp_path.glob("*.partial"))
    tiny = tmp_path / "tiny.json.gz"  # room for part of the device events only: the first ones kept
    note = gr.cut_trace(src, tiny, 2500)
    data = json.loads(gzip.decompress(tiny.read_bytes()))
    kept = [e for e in data["traceEvents"] if e.get("cat") == "kernel"]
    assert tiny.stat().st_size <= 2500 and "device events after the first" in note and 0 < len(kept) < 600
    assert [e["ts"] for e in kept] == sorted(e["ts"] for e in events if e.get("cat") == "kernel")[:len(kept)]
    r = gr.main(["cut-trace", str(src), str(tmp_path / "cli.json.gz"), "--max-bytes", str(full // 3)])
    assert r == 0 and (tmp_path / "cli.json.gz").stat().st_size <= full // 3


def test_summary_names_a_run_with_a_step_over_twice_its_median(tmp_path):
    run = tmp_path / "run_gpt"
    run.mkdir()
    write_metrics(run / "metrics.jsonl", [0.5] * 5 + [0.1] * 10 + [0.35] + [0.1] * 4)  # step 16: 3.5x the median
    rep, _ = gr.family_report("gpt", run)
    (tmp_path / "report_gpt.json").write_text(json.dumps(rep))
    gr.write_plan(tmp_path / "plan.tsv", [{"name": "gpt", "base": "-", "status": "run", "note": "", "config": RNA,
                                           "what": "GPT", "sets": []}])
    text = gr.summary(tmp_path)
    assert "gpt: a step took 3.50x the median after warm-up (max 350 ms): over 2x" in text
    assert "with no step over" not in text
