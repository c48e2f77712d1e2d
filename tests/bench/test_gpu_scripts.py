"""The prepared GPU check's CUDA-free parts: bench/eco_rna_gpu.py's CPU dry run and its one-line exit without CUDA,
bench/gpu.sh's syntax and its exit on a host without CUDA."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import eco_rna_gpu

REPO = Path(__file__).resolve().parents[2]


def test_eco_rna_gpu_dry_run_runs_every_step(capsys):
    assert eco_rna_gpu.main(["--dry-run", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "(a) parity" in out and "case 'idle steps'" in out and "k_max 6" in out
    assert out.count(" ok") >= 6 and "FAIL" not in out  # three paths against fp32, both cases
    parity, speed = out.split("(b) forward+backward")
    for path in ("sdpa padded   SDPA ", "auto packed   SDPA per sequence ", "sdpa packed   SDPA per sequence "):
        assert parity.count(path) == 2, path  # parity: padded SDPA, the training's packed path, its fallback
    assert " bf16 " in speed and " autocast " in speed
    # speed: the two layouts as training runs them (attn_backend auto), each row naming its kernel
    assert speed.count(" auto padded   SDPA ") == 2 and speed.count(" auto packed   SDPA per sequence ") == 2
    assert " sdpa packed " not in speed
    assert "packed / padded (bf16, L 32): " in out and "RESULT P5.packed_over_padded.L32 " in out
    assert "RESULT P5 " in out


def test_eco_rna_gpu_packed_path_is_the_trainings_own():
    """What decides the layout on CUDA is attn_backend auto with unpad true: the kernel names follow layers.py."""
    cpu = torch.device("cpu")
    assert eco_rna_gpu.PACKED == ("auto", True) and eco_rna_gpu.PADDED == ("auto", False)
    assert eco_rna_gpu.speed_paths() == [eco_rna_gpu.PADDED, eco_rna_gpu.PACKED]
    assert eco_rna_gpu.kernel_of("auto", True, cpu) == "SDPA per sequence"  # no varlen kernel on the CPU
    assert eco_rna_gpu.kernel_of("auto", False, cpu) == "SDPA"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a host without CUDA")
def test_without_cuda_the_gpu_scripts_exit_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        eco_rna_gpu.main([])
    for script in ("bench/gpu.sh", "scripts/prepare_gpu_check.sh", "scripts/install_gpu_kernels.sh"):
        subprocess.run(["bash", "-n", script], cwd=REPO, check=True)
    env = {**os.environ, "PY": sys.executable, "GPU_WORK": str(tmp_path / "work")}
    r = subprocess.run(["bash", "bench/gpu.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout.strip().splitlines() == [
        "bench/gpu.sh: torch sees no CUDA device; nothing to check here (--dry-run checks the script)"], r.stdout
    r = subprocess.run(["bash", "bench/gpu.sh", "--quick", "rna"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "torch sees no CUDA device" in r.stdout


# The scripts that create .venv (and the demo that runs one of them first) may use it; every other script must run
# on a host without it (the first GPU run's depth task exited 127 on scripts/launch.sh's .venv/bin/deepspeed).
MAKES_VENV = {"scripts/setup.sh", "scripts/test.sh", "scripts/quickstart.sh", "scripts/protlingo_demo.sh",
              "scripts/depth_demo.sh"}
DEFAULT_PY = re.compile(r"if \[ -x \.venv/bin/python \]; then PY=\.venv/bin/python; else PY=python3; fi")


def test_no_script_hard_codes_the_venv():
    bad = []
    for path in sorted(p for d in ("bench", "scripts", "tools") for p in (REPO / d).rglob("*")
                       if p.suffix in (".sh", ".py")):
        rel = str(path.relative_to(REPO))
        if rel in MAKES_VENV:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0] if path.suffix == ".sh" else line
            if ".venv/bin" in code and not DEFAULT_PY.search(code):
                bad.append(f"{rel}:{i}: {line.strip()}")
    assert bad == []


def test_gpu_sh_bad_argument_is_one_line():
    r = subprocess.run(["bash", "bench/gpu.sh", "--bogus"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stdout.strip().splitlines() == ["bench/gpu.sh: unknown argument '--bogus' (see --help)"]
    r = subprocess.run(["bash", "bench/gpu.sh", "--quick"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stdout.strip().splitlines()) == 1 and "--quick needs" in r.stdout
    r = subprocess.run(["bash", "bench/gpu.sh", "--quick", "rna", "nosuch"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout.strip().splitlines() == [
        "bench/gpu.sh: --quick nosuch: no such training (one of: rna protlingo gpt rna_padded rna_compiled rna_mb16k "
        "rna_norm_plain rna_graphs rna_buckets_off)"]
    r = subprocess.run(["bash", "bench/gpu.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PY": "/nonexistent/python"})
    assert r.returncode == 1 and r.stdout.strip().splitlines() == [
        "bench/gpu.sh: no python '/nonexistent/python' (set PY)"]
