"""The one rule for every tool that writes a directory (exports, upcycled checkpoints, random ESM2 models, data_prep
shards): it replaces only a directory that it wrote itself, and it finds out before any work.

The export tools (convert_checkpoint, upcycle_esm2, make_random_esm2) own a directory only through the marker
``.written-by.json`` they write into it (``publish_dir``): it names the tool and the run that wrote it and lists
every file that run wrote. A file name anyone can create (``export.json``, ``config.json``) proves nothing. With
``--force`` such a directory is swapped out only after the new one is complete, and only the files its marker lists
go: anything else in it (``launchers/evaluate.py``'s results, a user's notes) is carried into the new directory and
named in a note. Anything else that is not empty (a training run, a folder of exports, a home directory, an export
written before markers) is refused with one line naming what is inside, and nothing is deleted. data_prep
recognises its outputs by their manifests (data_prep/common.py). The new directory is built beside the output (same
filesystem) and renamed into place, so an output that is a mount point, where that rename must fail, is refused at
the start too. ``write_atomic`` is the same rule for one file; ``take_lock`` the one lock that names its holder.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import tempfile
import threading
import time
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


MARKER = ".written-by.json"  # {"tool", "run", "written", "files"}: publish_dir writes it, written_by reads it


def has_file(name: str) -> Callable[[Path], bool]:
    """``owned`` for a tool whose directories are recognised by one file of its own (data_prep's manifests)."""
    return lambda directory: (directory / name).is_file()


def _marker(directory: Path) -> dict | None:
    """The ownership marker of ``directory``, or None when it is missing or not one: unreadable, not JSON, nested
    past the parser's depth, or not {"tool": str, "files": [str, ...]} (a file list holding an object raised a
    TypeError in publish_dir). A marker that is not one proves nothing: the directory is treated as unmarked."""
    try:
        doc = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not (isinstance(doc, dict) and isinstance(doc.get("tool"), str) and isinstance(doc.get("files"), list)
            and all(isinstance(f, str) for f in doc["files"])):
        return None
    return doc


def written_by(tool: str) -> Callable[[Path], bool]:
    """``owned`` for a tool that publishes with ``publish_dir``: the directory holds that tool's marker."""
    return lambda directory: (_marker(directory) or {}).get("tool") == tool


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if (p.is_file() or p.is_symlink()) and p.name != MARKER)


def publish_dir(new: Path, out: Path, tool: str, claimed: Callable[[Path], set[str]] | None = None) -> list[str]:
    """Mark the finished directory ``new`` as ``tool``'s and put it in place of ``out`` (``replace_dir``).

    The marker lists every file of ``new``. An existing ``out`` (one ``check_output_dir`` allowed) keeps what its
    own marker does not list: those files are moved into ``new`` first (one the new run also wrote keeps the new
    one's name and the old one gets ``.previous``). An ``out`` without a valid marker (written before markers, or its
    marker damaged) keeps every file but those ``claimed(out)`` names (data_prep: the files its manifests list);
    without ``claimed`` it keeps every file. Nothing is deleted on the word of a marker or manifest that is not one.
    Returns the files kept, for the tool's note."""
    kept = []
    if out.is_dir():
        old = _marker(out)
        mine = set(old["files"]) if old is not None else (claimed(out) if claimed is not None else set())
        kept = [f for f in _files(out) if f not in mine]
    umask = os.umask(0)
    os.umask(umask)
    for f in _files(new):  # safetensors writes 0600 (its temp file's mode): others may read what the umask allows
        if not (new / f).is_symlink():
            (new / f).chmod(0o666 & ~umask | (new / f).stat().st_mode & 0o111)
    doc = {"tool": tool, "run": f"pid {os.getpid()} on {socket.gethostname()}",
           "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": _files(new)}
    (new / MARKER).write_text(json.dumps(doc, indent=1) + "\n")
    moved = []  # (where it was, where it is now): put back if the swap fails, since the caller then deletes new
    try:
        for f in kept:
            dest = new / f
            if dest.exists() or dest.is_symlink():
                dest = dest.with_name(dest.name + ".previous")
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(out / f, dest)
            moved.append((out / f, dest))
        replace_dir(new, out)
    except BaseException:
        for was, now in reversed(moved):
            os.replace(now, was)
        raise
    return kept


def kept_note(kept: list[str], tool: str) -> str:
    """The note a tool prints for ``publish_dir``'s kept files."""
    shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
    return (f"note: kept {len(kept)} file{'s' if len(kept) > 1 else ''} that {tool} did not write: {shown} (results "
            "in them describe the replaced weights)")


def staging_dir(out: Path) -> Path:
    """A new, empty directory beside ``out`` (same filesystem, so the final rename is atomic), hidden and unique:
    two tools writing beside each other never share one, and nothing of the user's is ever cleared to make it."""
    try:  # a read-only or full filesystem: refused here, before the tool's long work, naming the place
        out.parent.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise OutputDirError(f"{out}: cannot write in {out.parent} ({e.strerror or e})") from None
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


def take_lock(path: Path, holder: str) -> tuple[int | None, str]:
    """An exclusive, non-blocking ``flock`` on ``path`` (created if missing) whose file names its holder: (fd, "")
    when taken, the file then holding ``holder``; (None, what the file names) when another process holds it. The
    kernel drops the lock when its holder dies, so a killed holder never leaves a stale lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        return None, text
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)
    return fd, ""


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
