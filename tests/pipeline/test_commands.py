"""pipeline.commands: printed commands name the running interpreter (relative inside the current directory, else
absolute) and its environment's mlflow script, so they run as printed without an activated venv; the training's
closing summary uses them."""
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from pipeline import commands


def test_shown_is_relative_inside_the_current_directory(tmp_path, monkeypatch):
    python = tmp_path / ".venv" / "bin" / "python"
    monkeypatch.chdir(tmp_path)
    assert commands.shown(python) == ".venv/bin/python"
    monkeypatch.chdir(tmp_path / "..")
    assert commands.shown(python) == f"{tmp_path.name}/.venv/bin/python"


def test_shown_is_absolute_outside_it(tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert commands.shown(tmp_path / "venv" / "bin" / "python") == str(tmp_path / "venv" / "bin" / "python")
    assert commands.shown(tmp_path / "a b" / "python") == f"'{tmp_path / 'a b' / 'python'}'"  # a shell word


def test_python_and_mlflow_are_the_running_environment(tmp_path, monkeypatch):
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)  # a venv's python links out of the venv: not followed
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.chdir(tmp_path)
    assert commands.python() == ".venv/bin/python"
    assert commands.mlflow() == ".venv/bin/mlflow"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert commands.python() == str(venv / "python") and commands.mlflow() == str(venv / "mlflow")


def test_training_summary_prints_the_running_interpreter(tmp_path, monkeypatch):
    from pipeline.train.callbacks import run_summary

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "demo"
    fake = SimpleNamespace(
        state=SimpleNamespace(cumulative={"tokens": 10}, step=3, last_loss=1.0, best=None),
        checkpointer=SimpleNamespace(ckpt_dir=run_dir / "checkpoints", latest=lambda default=None: "step00000003"),
        cfg=SimpleNamespace(train=SimpleNamespace(max_steps=3)), stopped_by="the budget", run_dir=run_dir,
        tracker=SimpleNamespace(uri="sqlite:///runs/demo/mlflow.db", run_id="abc"))
    text = run_summary(fake, "finished", 3, 5.0)
    python = str(Path(os.path.abspath(sys.executable)))
    assert f"export: {python} tools/convert_checkpoint.py --checkpoint {run_dir}" in text, text
    assert f"({Path(python).parent / 'mlflow'} ui --backend-store-uri sqlite:///runs/demo/mlflow.db)" in text, text
