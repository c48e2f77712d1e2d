"""bench/gpu.sh's set-up on a python that holds only the CUDA image's packages, in a copy of the working tree without
.venv: the first GPU run failed there twice (isal not carried; scripts/launch.sh calling .venv/bin/deepspeed) where
a dry run on a machine with the venv passed.

How the image is imitated on this machine (python 3.11, CPU torch): a fresh venv of the base interpreter (no system
site-packages, so nothing of this venv or the base install leaks in) whose site-packages holds only symlinks to the
distributions scripts/gpu_image_packages.txt names and their requirements, taken from this venv (triton, CUDA
torch's, is absent here and nothing imports it on the CPU). The carried wheels are built by scripts/prepare_gpu_check.sh for this python
(GPU_PYTHON = 3.11; on the GPU host they are cp312) from PyPI, and bench/gpu.sh --dry-run installs them with
`pip install --no-index --no-deps --target` as on the GPU host. PATH leads to that python as `python3`, PY is unset,
and the tree has no .venv, so any .venv path fails the run. The dry run does the set-up, every family's data step
(data_prep, the random ESM2 start and its upcycling, the sentencepiece model) and one launcher start with its report
(Eco-RNA); the other families' trainings, the parity bench and the depth study are left out to keep this under 3
minutes (bash bench/gpu.sh --dry-run runs them all)."""
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from packaging.requirements import Requirement

from tests.bench.test_gpu_wheels import canon, image_packages

REPO = Path(__file__).resolve().parents[2]


def image_python(root: Path) -> Path:
    """A python whose importable packages are the image's only."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    linked, seen, todo = set(), set(), sorted(image_packages())
    while todo:  # the listed distributions and, as pip installed them into the image, their requirements
        name = canon(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            assert name == "triton", f"{name} of the image list is not installed here"
            continue
        env = {"extra": ""}
        todo += [r.name for r in map(Requirement, dist.requires or []) if r.marker is None or r.marker.evaluate(env)]
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top in linked:
                continue  # console scripts (../../bin) and the shared cache are no packages
            src = Path(dist.locate_file(top))
            if src.exists():
                (site / top).symlink_to(src)
                linked.add(top)
    return root / "bin" / "python"


def working_tree_copy(dest: Path) -> None:
    """The working tree's tracked and unignored files (no .venv, no build/): what the GPU host receives."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.mark.slow
def test_dry_run_on_the_image_python_without_venv(tmp_path):
    wheels = tmp_path / "wheels"
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    data = tmp_path / "data"  # no shared data: ProtLingo's cluster shards of the shipped sample, built here
    r = subprocess.run(["bash", "scripts/prepare_gpu_check.sh"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PY": sys.executable, "GPU_PYTHON": here, "GPU_WHEELS": str(wheels),
                            "GPU_DATA": str(data), "SHARED_DATA": str(tmp_path / "no_shared")}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (data / "protein" / "shards" / "manifest.json").is_file()
    assert not list(wheels.glob("duckdb-*")) and not list(wheels.glob("pyarrow-*"))  # the cluster join stays here
    n_wheels = len(list(wheels.glob("*.whl")))

    py = image_python(tmp_path / "image")
    bare = subprocess.run([str(py), "-c", "import torch, transformers, sentencepiece; import isal"],
                          capture_output=True, text=True)
    assert "No module named 'isal'" in bare.stderr, bare.stderr  # the imitation holds the image, and no more

    tree = tmp_path / "tree"
    working_tree_copy(tree)
    assert not (tree / ".venv").exists() and (tree / "bench" / "gpu.sh").is_file()
    env = {k: v for k, v in os.environ.items() if k not in ("PY", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{py.parent}:/usr/bin:/bin", GPU_WORK=str(tmp_path / "work"), GPU_WHEELS=str(wheels),
               GPU_DATA=str(data),  # the carried cluster shards; the fallbacks in the repo: data/samples, docs/*.md
               GPU_SKIP="eco_rna eval protlingo gpt ab")
    r = subprocess.run(["bash", "bench/gpu.sh", "--dry-run"], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "bench/gpu.sh: every stage that ran passed" in out, out[-6000:]
    assert "not run within GPU_DEADLINE" not in out
    assert f"installed {n_wheels} wheels from {wheels}" in out
    installed = next(ln for ln in out.splitlines() if ln.startswith("installed: "))
    for name in ("deepspeed", "webdataset", "isal", "pydantic"):
        assert f"{name} {metadata.version(name)}" in installed, installed
    assert "mlflow no" in installed  # exempt, and the check ran without it
    assert f"({py.parent}/python3)" in out  # the environment line names the python that ran
    for family in ("rna", "protlingo", "gpt"):  # a skipped family's data step runs all the same
        assert f"data {family}: data_prep " in out
    assert f"data protlingo: data_prep ran where its cluster join is installed: the carried {data}/protein/shards" \
        in out  # not built where DuckDB is not
    assert "RecursiveGPT trains on docs/*.md" in out
    assert re.search(r"^  tests +ok ", out, re.M) and re.search(r"^  plan +ok ", out, re.M), out[-3000:]
    # the launcher ran its workers with the image python
    log = (tmp_path / "work" / "logs" / "rna.log").read_text()
    assert f"cmd = {py.parent}/python3 -u -m deepspeed.launcher.launch" in log, log[:3000]
    assert "== rna: 4 steps" in out and "profiled step 2 (cpu" in out
    assert "RESULT GPU_FAMILY rna " in out
    assert ".venv" not in out
