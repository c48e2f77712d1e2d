"""The commands the project prints for a user to run, spelled with the interpreter that is running.

A printed ``python tools/x.py`` or ``mlflow ui`` runs only where a venv is activated; the interpreter running now
(``sys.executable``, and the ``mlflow`` script installed beside it) runs as printed from any shell. Paths inside the
current directory are shown relative to it (``.venv/bin/python``), others absolute. The lowest layer: standard
library only, so data_prep and pipeline.data can use it.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def shown(path: str | Path) -> str:
    """``path`` relative to the current directory when it lies inside it, else absolute; quoted for a shell."""
    p = Path(os.path.abspath(path))  # not resolve(): a venv's python is a symlink whose target is not the venv
    cwd = Path(os.path.abspath(os.getcwd()))
    return shlex.quote(str(p.relative_to(cwd)) if p.is_relative_to(cwd) else str(p))


def python() -> str:
    """The running interpreter as a command: ``.venv/bin/python`` from the repository, else its absolute path."""
    return shown(sys.executable)


def mlflow() -> str:
    """The ``mlflow`` script of the running interpreter's environment (where pip installs it)."""
    return shown(Path(sys.executable).parent / "mlflow")
