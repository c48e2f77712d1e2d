"""The outputs the documented commands write (runs, exports, shards, reports such as tools/routing_report.py's
``--out reports/routing``) are ignored by git, so running the documentation leaves the checkout clean."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ["runs/eco_rna_demo/x", "exports/eco_rna_demo/x", "data/shards/rfam_demo/x", "reports/routing/x"]


@pytest.mark.parametrize("path", OUTPUTS)
def test_outputs_are_ignored(path):
    try:
        proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, timeout=60)
    except OSError:
        pytest.skip("git is not installed")
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert proc.returncode == 0, f"{path} is not in .gitignore"
