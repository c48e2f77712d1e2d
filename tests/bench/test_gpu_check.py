"""bench/gpu.sh cannot waste a lease: on a host that looks like CUDA it stops with one line before anything runs when
the carried wheels are missing, do not fit or do not install, or deepspeed does not import; and what it leaves in OUT
(the device returns at most 8 files of at most 16 MiB, two folders deep, plain names) stays inside those limits at
every moment, also when the check is killed mid-way, by SIGTERM (the trap stops the running stage and packs) or by
SIGKILL (what the last stage packed is there).

The runs use a copy of the working tree without .venv and PY set to this python (tests/bench/test_gpu_env.py runs the
dry run on a python that holds only the CUDA image's packages). "A CUDA host" is this python with
torch.cuda.is_available patched to True by a sitecustomize on PYTHONPATH: the script's checks come before anything
touches the device."""
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.bench.test_gpu_env import working_tree_copy

REPO = Path(__file__).resolve().parents[2]
MAX_FILES, MAX_BYTES = 8, 16 * 2**20
NAME = re.compile(r"^[A-Za-z0-9._-]+$")

FAKE_CUDA = """import os, sys
if os.environ.get("FAKE_CUDA") == "1":
    import torch
    torch.cuda.is_available = lambda: True
if os.environ.get("NO_DEEPSPEED") == "1":
    sys.modules["deepspeed"] = None  # import deepspeed raises ImportError
"""


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu_check") / "tree"
    working_tree_copy(root)
    assert not (root / ".venv").exists()
    return root


def env_for(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PY", "PYTHONPATH", "VIRTUAL_ENV", "OUT")}
    env.update(PY=sys.executable, GPU_WORK=str(tmp_path / "work"), GPU_DATA=str(tmp_path / "no_data"), **extra)
    return env


def fake_cuda_env(tmp_path: Path, **extra) -> dict:
    site = tmp_path / "fake_cuda"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(FAKE_CUDA)
    return env_for(tmp_path, PYTHONPATH=str(site), FAKE_CUDA="1", **extra)


def one_line(tree: Path, env: dict) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    r = subprocess.run(["bash", "bench/gpu.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=180)
    return r.returncode, r.stdout.strip().splitlines(), time.monotonic() - t0


def test_on_a_cuda_host_missing_or_unusable_wheels_stop_at_once_with_one_line(tree, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, lines, _ = one_line(tree, fake_cuda_env(tmp_path, GPU_WHEELS=str(empty)))
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"bench/gpu.sh: no wheels in {empty}: run bash scripts/prepare_gpu_check.sh"), lines
    assert not (tmp_path / "work" / "stages.tsv").exists()  # nothing started

    other = tmp_path / "cp312"  # wheels for the GPU host's python, not this one
    other.mkdir()
    (other / "isal-1.7.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"not used")
    rc, lines, _ = one_line(tree, fake_cuda_env(tmp_path, GPU_WHEELS=str(other)))
    assert rc == 1 and len(lines) == 1, lines
    assert "1 of the wheels in" in lines[0] and "do not fit this python" in lines[0], lines

    broken = tmp_path / "broken"  # fits every python, does not install
    broken.mkdir()
    (broken / "nothing_here-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
    rc, lines, _ = one_line(tree, fake_cuda_env(tmp_path, GPU_WHEELS=str(broken)))
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"bench/gpu.sh: installing {broken} failed: "), lines


def test_on_a_cuda_host_deepspeed_that_does_not_import_stops_at_once_with_one_line(tree, tmp_path):
    rc, lines, _ = one_line(tree, fake_cuda_env(tmp_path, GPU_WHEELS="none", NO_DEEPSPEED="1"))
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"bench/gpu.sh: deepspeed does not import with {sys.executable}: "), lines


def test_a_stage_that_would_pass_the_deadline_is_not_started_and_said(tree, tmp_path):
    """GPU_DEADLINE 30 s: the plan runs (it is not held to the deadline), a training (60 s at least) does not; the summary names it with the command
    that runs it alone, and OUT holds the summary and the results."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", "bench/gpu.sh", "--dry-run", "--quick", "rna"], cwd=tree, capture_output=True,
                       text=True, timeout=180, env=env_for(tmp_path, GPU_DEADLINE="30", OUT=str(out)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(r"^== rna: not run \(GPU_DEADLINE 30 s: -?\d+ s left, it needs 60\)$", r.stdout, re.M), r.stdout
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("  rna ") and "not run" in ln)
    assert "alone: bash bench/gpu.sh --quick rna" in row, row
    assert r.stdout.strip().splitlines()[-2:] == ["bench/gpu.sh: not run within GPU_DEADLINE: rna",
                                                 "bench/gpu.sh: every stage that ran passed"]
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.txt"]


def out_state(out: Path) -> list[str]:
    """Every way OUT breaks the device's return limits (empty: within them)."""
    bad = []
    files = [p for p in out.rglob("*") if not p.is_dir()]
    if len(files) > MAX_FILES:
        bad.append(f"{len(files)} files: {sorted(p.name for p in files)}")
    for p in files:
        rel = p.relative_to(out)
        if len(rel.parts) > 3:
            bad.append(f"{rel}: more than two folders down")
        if not all(NAME.match(part) for part in rel.parts):
            bad.append(f"{rel}: a name the device does not return")
        if p.is_symlink() or not p.is_file():
            bad.append(f"{rel}: not a plain file")
        elif p.stat().st_size > MAX_BYTES:
            bad.append(f"{rel}: {p.stat().st_size} bytes")
    return bad


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (the check and everything it started, `timeout` groups included)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(d.name))
    return pids


def run_until(tree: Path, args: list, env: dict, out: Path, marker: str, after: float, sig: int,
              to_group: bool) -> tuple[int, str, list[str], list[int]]:
    """Start ``bash bench/gpu.sh ARGS`` in its own session with its output in OUT/gpu.log (as the documented
    `| tee $OUT/gpu.log` leaves it), watch OUT every 50 ms, send ``sig`` (to the shell alone, or to its whole process
    group) ``after`` seconds after ``marker`` appears in its output; (exit status, output, every limit broken at any
    sample, the session's processes still alive 15 s after the shell ended). Whatever of the session still runs then
    is killed by its ids."""
    out.mkdir()
    log = out / "gpu.log"
    broken = []
    with open(log, "w") as f:
        p = subprocess.Popen(["bash", "bench/gpu.sh", *args], cwd=tree, env={**env, "OUT": str(out)}, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, fire_at, sent = time.monotonic() + 400, None, False
        while p.poll() is None and time.monotonic() < deadline:
            broken += out_state(out)
            if fire_at is None and marker in log.read_text(errors="replace"):
                fire_at = time.monotonic() + after
            if not sent and fire_at is not None and time.monotonic() >= fire_at:
                if to_group:
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)
                sent = True
            time.sleep(0.05)
        try:
            rc = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = None
        broken += out_state(out)
        t_end = time.monotonic() + 15
        while session_pids(p.pid) and time.monotonic() < t_end:
            time.sleep(0.2)
        return rc, log.read_text(errors="replace"), broken, session_pids(p.pid)
    finally:
        for _ in range(3):
            for pid in session_pids(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        if p.poll() is None:
            p.kill()


def members(tar_path: Path) -> dict[str, bytes]:
    with tarfile.open(tar_path) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


@pytest.mark.slow  # a plan, the gpu-marked tests' collection and a tiny training through the launcher (~50 s)
def test_sigkill_mid_way_leaves_what_the_last_stage_packed(tree, tmp_path):
    env = env_for(tmp_path, GPU_SKIP="eco_rna eval protlingo gpt")
    out = tmp_path / "out"
    # killed with the whole process group, as the device kills a command past its limit: 3 s into the second
    # training, after the first one's results were packed
    rc, log, broken, _ = run_until(tree, ["--dry-run"], env, out, "== rna_padded (timeout", 3.0, signal.SIGKILL,
                                   to_group=True)
    assert rc == -signal.SIGKILL, log[-3000:]
    assert broken == [], broken[:5]
    names = sorted(p.name for p in out.iterdir())
    assert {"gpu.log", "summary.txt", "results.tar.gz", "trace_rna.json.gz"} <= set(names), names
    got = members(out / "results.tar.gz")
    assert {"stages.tsv", "plan.tsv", "report_rna.json", "metrics_rna.jsonl", "logs/rna.log"} <= set(got), sorted(got)
    stages = got["stages.tsv"].decode()
    assert re.search(r"^tests\tok\t", stages, re.M) and re.search(r"^rna\tok\t", stages, re.M), stages
    assert "rna_padded" not in stages  # killed before it ended: nothing could record it
    summary = (out / "summary.txt").read_text()
    assert "families" in summary and re.search(r"^  rna +\d", summary, re.M), summary


@pytest.mark.slow  # two tiny trainings through the launcher, the second one killed (~50 s)
def test_sigterm_stops_the_running_stage_packs_and_prints_the_summary_last(tree, tmp_path):
    env = env_for(tmp_path)
    out = tmp_path / "out"
    rc, log, broken, left = run_until(tree, ["--dry-run", "--quick", "rna", "rna_padded"], env, out,
                                      "== rna_padded (timeout", 3.0, signal.SIGTERM, to_group=False)
    assert rc == 128 + signal.SIGTERM, log[-3000:]
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200] for pid in left]
    assert broken == [], broken[:5]
    assert "dry run: no wheels in build/gpu_wheels; going on with what" in log  # the dry run goes on, saying so
    assert "bench/gpu.sh: SIGTERM during rna_padded: stopping it and packing what exists" in log
    tail = log.strip().splitlines()
    assert tail[-1] == "bench/gpu.sh: FAILED: SIGTERM", tail[-5:]
    assert any(ln.startswith("== bench/gpu.sh summary: ") for ln in tail[-30:]), tail[-30:]
    assert re.search(r"^  rna_padded +killed ", log, re.M), log[-3000:]
    assert len(list(out.iterdir())) <= MAX_FILES
    got = members(out / "results.tar.gz")
    assert re.search(r"^rna_padded\tkilled\t", got["stages.tsv"].decode(), re.M), got["stages.tsv"]
    assert "report_rna.json" in got and "logs/rna_padded.log" in got, sorted(got)
    assert "killed" in (out / "summary.txt").read_text()
