"""Imported first by the scripts that must run where this repository cannot be imported (isolated_hf.py,
isolated_task_hf.py): a meta-path finder refuses ``pipeline``, ``data_prep``, ``tools``, ``launchers`` and ``bench``
(the venv's editable install would otherwise find them). ``check()`` stops the process if the refusal failed."""
import importlib.abc
import sys

BLOCKED = {"pipeline", "data_prep", "tools", "launchers", "bench"}


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (this process must not see the repository)")
        return None


sys.meta_path.insert(0, Refuse())


def check() -> None:
    try:
        import pipeline as _  # noqa: F401
        raise SystemExit("the repository is importable: the isolation failed")
    except ModuleNotFoundError:
        pass
