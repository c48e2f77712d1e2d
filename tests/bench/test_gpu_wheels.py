"""scripts/prepare_gpu_check.sh's carried packages against what the GPU check needs: every runtime dependency of
pyproject.toml, and every requirement of a carried package, is carried or in the CUDA image
(scripts/gpu_image_packages.txt), and nothing the image holds is carried without a stated reason. The walk here is
written apart from the script's, so a package the script drops (the first GPU run lacked isal) fails it."""
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
GPU_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# mlflow: tracking is off in the check; duckdb, pyarrow: data_prep's cluster join, whose shards prepare_gpu_check.sh
# builds here (tests/bench/test_gpu_env.py runs the check without any of them)
EXEMPT = {"mlflow", "duckdb", "pyarrow"}
CARRIED_ANYWAY = {"typing-extensions"}  # in the image, but pydantic needs a newer one


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(repo: Path = REPO) -> set[str]:
    lines = (repo / "scripts" / "gpu_image_packages.txt").read_text().splitlines()
    return {canon(ln.split("#", 1)[0].strip()) for ln in lines if ln.split("#", 1)[0].strip()}


def carried(repo: Path = REPO) -> dict[str, str]:
    """name -> version of ``prepare_gpu_check.sh --list``, run with this python."""
    r = subprocess.run(["bash", "scripts/prepare_gpu_check.sh", "--list"], cwd=repo, capture_output=True, text=True,
                       env={**os.environ, "PY": sys.executable}, timeout=120)
    assert r.returncode == 0, r.stderr
    pins = [ln.split("#", 1)[0].strip() for ln in r.stdout.splitlines() if ln.strip()]
    return {canon(p.split("==")[0]): p.split("==")[1] for p in pins}


def needs(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(GPU_ENV)


def uncovered(repo: Path = REPO) -> list[str]:
    """The requirements (runtime dependencies and those of carried packages) neither carried nor in the image."""
    have, image = carried(repo), image_packages(repo)
    roots = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = [("pyproject.toml", Requirement(r)) for r in roots]
    for name in have:
        wanted += [(name, Requirement(r)) for r in metadata.requires(name) or []]
    return sorted(f"{canon(r.name)} (required by {who})" for who, r in wanted
                  if needs(r) and canon(r.name) not in set(have) | image | EXEMPT)


def test_every_runtime_dependency_is_carried_or_in_the_image():
    assert uncovered() == []


def test_carried_packages_are_not_in_the_image_and_match_this_venv():
    have = carried()
    assert set(have) & image_packages() <= CARRIED_ANYWAY
    assert {"deepspeed", "webdataset", "isal", "pydantic-core"} <= set(have)  # the first run's missing ones
    assert not EXEMPT & set(have)
    for name, version in have.items():
        assert metadata.version(name) == version, name


def test_image_list_names_installed_distributions():
    # a typo in the image list would make the script carry nothing for that name: every name must be a real
    # distribution (installed here, or triton: CUDA torch's, absent from the CPU wheel)
    missing = [n for n in image_packages() - {"triton"} if not _installed(n)]
    assert missing == []


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def test_bad_argument_is_one_line_and_nonzero():
    r = subprocess.run(["bash", "scripts/prepare_gpu_check.sh", "--bogus"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "prepare_gpu_check.sh: unknown argument '--bogus' (see --help)"]
    r = subprocess.run(["bash", "scripts/prepare_gpu_check.sh", "--list"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PY": sys.executable, "GPU_PYTHON": "python3"})
    assert r.returncode != 0 and "GPU_PYTHON must read like 3.12" in r.stderr
