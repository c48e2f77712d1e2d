"""bench/babylm_pipeline.py: bad arguments are one line and exit 2; with a checkout of babylm/evaluation-pipeline-2025
named by BABYLM_PIPELINE (none ships with the repository, and CI has none: skipped), its zero-shot predictions on the
fixture folders equal evaluate.py's item by item and its fine-tuning runs on the export."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, launch_env

sys.path.insert(0, str(REPO / "tests" / "pipeline" / "eval"))
from text_export import FIXTURES, make_export, sentencepiece  # noqa: E402

PIPELINE = Path(os.environ.get("BABYLM_PIPELINE", "/nonexistent"))


def bench(*args):
    return subprocess.run([sys.executable, str(REPO / "bench" / "babylm_pipeline.py"), *map(str, args)], cwd=REPO,
                          env=launch_env(), capture_output=True, text=True, timeout=900)


def test_refuses_what_is_not_a_checkout(tmp_path):
    proc = bench("--pipeline", tmp_path, "--export", tmp_path, "--data", FIXTURES)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {tmp_path}: not a checkout of babylm/evaluation-pipeline-2025 (no "
        "evaluation_pipeline/sentence_zero_shot/run.py)"]


@pytest.mark.slow
@pytest.mark.skipif(not (PIPELINE / "evaluation_pipeline").is_dir(),
                    reason="set BABYLM_PIPELINE to a checkout of babylm/evaluation-pipeline-2025")
def test_predictions_identical_to_the_pipeline(tmp_path):
    export = make_export(tmp_path, sentencepiece(tmp_path))
    proc = bench("--pipeline", PIPELINE, "--export", export, "--data", FIXTURES, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "zero-shot: 86/86 predictions identical over 7 task folders" in proc.stdout
    assert "RESULT BABYLM.agree 1.0000" in proc.stdout and "fine-tuning (finetune.run, rte, 1 epoch)" in proc.stdout
