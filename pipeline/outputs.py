"""The one rule for every tool that writes a directory (exports, upcycled checkpoints, random ESM2 models, data_prep
shards): it replaces only a directory that it wrote itself, and it finds out before any work.

A tool's own directory is recognised by the marker file it writes (an export's ``export.json``, a Hugging Face
model's ``config.json`` with ``model_type``, data_prep's ``manifest.json``). With ``--force`` (data_prep:
``--overwrite``) such a directory is swapped out only after the new one is complete; anything else that is not
empty (a training run, a folder of exports, a home directory) is refused with one line naming what is inside, and
nothing is deleted. The new directory is built beside the output (same filesystem) and renamed into place, so an
output that is a mount point, where that rename must fail, is refused at the start too. ``write_atomic`` is the same
rule for one file.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path


class OutputDirError(ValueError):
    """An output directory that must not be written or replaced; the message is one line for the user."""


def contents(directory: Path, limit: int = 4) -> str:
    """'checkpoints/, metrics.jsonl, train.log and 3 more': what a refused directory holds, for its error line."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output_dir(out: Path, *, force: bool, owned: Callable[[Path], bool], what: str, tool: str,
                     flag: str = "--force") -> None:
    """Raise OutputDirError unless ``out`` may receive a new ``what`` (e.g. "an export"): it does not exist or is
    empty, or it is a directory this tool wrote (``owned(out)``) and ``flag`` was given. Also refused: a file in the
    way, and a mount point (the finished directory is renamed into place, which cannot replace a mount point)."""
    if next((a for a in (out, *out.parents) if a.exists()), out).is_file():
        raise OutputDirError(f"{out}: a file is in the way of the output directory")
    if not out.exists():
        return
    if os.path.ismount(out):
        raise OutputDirError(f"{out} is a mount point: the output is built beside it and renamed into place, which "
                             f"cannot replace a mount point; give a directory inside it (e.g. {out / out.name})")
    if not any(out.iterdir()):
        return
    if not owned(out):
        raise OutputDirError(f"{out} is not empty and was not written by {tool} (it holds {contents(out)}); "
                             f"not replacing it, even with {flag}: choose a new directory")
    if not force:
        raise OutputDirError(f"{out} already holds {what}; pass {flag} to replace it")


def has_file(name: str) -> Callable[[Path], bool]:
    """``owned`` for a tool whose directories are recognised by one marker file."""
    return lambda directory: (directory / name).is_file()


def staging_dir(out: Path) -> Path:
    """A new, empty directory beside ``out`` (same filesystem, so the final rename is atomic), hidden and unique:
    two tools writing beside each other never share one, and nothing of the user's is ever cleared to make it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    # mkdtemp makes it 0700; the finished directory gets the permissions of any directory made here (the umask's),
    # so that others on a shared filesystem can read the exports they are told to use
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    return path


def replace_dir(new: Path, out: Path) -> None:
    """Move the finished directory ``new`` to ``out``. An existing ``out`` (empty, or one ``check_output_dir``
    allowed) is set aside first and put back if the move fails, so ``out`` is always the old result or the new one,
    never a mix; the old one is deleted only after the new one is in place."""
    if not out.exists():
        os.rename(new, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.rename(out, old / out.name)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old / out.name, out)
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, text: str):
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never half of it. The temp name
    is per process and thread, so concurrent writers (the tracker's thread and the engine) never share one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk, a read-only or occupied destination: no temp file left behind
        tmp.unlink(missing_ok=True)
        raise
