"""The contract every bad input is held to: one error line naming the file, key or line; a non-zero exit; no
traceback. Shared by the tests/reliability/test_bad_inputs_*.py suites."""
from __future__ import annotations

import subprocess
from pathlib import Path

from prewarmed import run_python

REPO = Path(__file__).resolve().parents[2]


def run_cli(args: list, cwd: Path = REPO, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python ARGS...`` (a script path or ``-m module``) from the repository root, captured; forked from a
    process that imported torch and DeepSpeed once (tests/prewarmed.py)."""
    return run_python(args, cwd, timeout, env)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip().startswith("error:") or "error:" in ln[:40]]


def assert_one_line_error(proc: subprocess.CompletedProcess, *must_name: str):
    """Non-zero exit, no traceback, and an ``error:`` line that names every string in ``must_name``."""
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"exit 0 on a bad input:\n{text[-2000:]}"
    assert "Traceback" not in text, f"traceback instead of one error line:\n{text[-3000:]}"
    errors = error_lines(proc)
    assert errors, f"no 'error:' line:\n{text[-2000:]}"
    line = errors[-1]
    for s in must_name:
        assert str(s) in line, f"the error does not name {s!r}: {line}"
    return line
