"""``data_prep upload DIR URL`` (and ``--output URL``): publish a finished shard set to object storage.

Readers take a shard set by its ``manifest.json``, so a manifest must never be visible before every shard it lists:
the upload writes the ownership marker first (so that an interrupted upload can be replaced with ``--overwrite``),
then the shards and every other file, then the manifests (``DIR/manifest.json``, or ``train/`` and ``val/``'s and
then ``split.json``) last. Replacing an earlier upload (``--overwrite``) removes its manifests before anything else,
so no reader takes an old manifest while its shards are being replaced, and removes the files its marker lists that
the new set does not have at the end; objects the marker does not list (a user's notes) stay, as with local outputs
(pipeline/outputs.py). A prefix that holds objects without data_prep's marker is refused, flag or not.

Transfers go through pipeline/data/remote.py (fsspec; its retries and its one-line errors naming the URL).
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from pipeline.data.remote import FetchError, RetryPolicy, call, filesystem, is_remote, join
from pipeline.outputs import MARKER

from .checks import PrepError
from .common import MANIFEST, SPLIT_FILE, TOOL, _looks_like_output


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MARKER and not p.name.startswith("."))


def _last(name: str) -> int:
    """Upload order: 0 shards and other files, 1 manifests, 2 split.json (it names the manifests)."""
    base = name.rsplit("/", 1)[-1]
    return 2 if base == SPLIT_FILE else 1 if base == MANIFEST else 0


def remote_marker(url: str, policy: RetryPolicy) -> tuple[list[str], dict | None]:
    """(the objects under ``url``, relative to it; data_prep's marker there, or None)."""
    fs, base = filesystem(url)
    found = call(url, lambda: fs.find(base), policy, "list")
    prefix = base.rstrip("/") + "/"
    names = sorted(p[len(prefix):] for p in found if p.startswith(prefix))
    marker = None
    if MARKER in names:
        try:
            marker = json.loads(call(join(url, MARKER), lambda: fs.cat_file(prefix + MARKER), policy))
        except ValueError:
            marker = None
        if not (isinstance(marker, dict) and marker.get("tool") == TOOL and isinstance(marker.get("files"), list)):
            marker = None
    return names, marker


def check_remote_output(url: str, overwrite: bool, policy: RetryPolicy = RetryPolicy()) -> None:
    """Before any work: ``url`` must be empty, or (with ``overwrite``) hold a shard set data_prep uploaded."""
    try:
        names, marker = remote_marker(url, policy)
    except FetchError as e:
        raise PrepError(str(e)) from None
    if not names:
        return
    if marker is None:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise PrepError(f"{url} is not empty and was not written by {TOOL} (it holds {shown}); not replacing it, "
                        "even with --overwrite: choose a new prefix")
    if not overwrite:
        raise PrepError(f"{url} already holds a {TOOL} output; pass --overwrite to replace it")


def upload(directory: Path, url: str, overwrite: bool = False, policy: RetryPolicy = RetryPolicy()) -> dict:
    """Publish the data_prep output ``directory`` (a shard set, or a --val-fraction split) at ``url``; returns
    {"files", "bytes"}. Refusals (not a data_prep output, an occupied prefix) are PrepError lines; transfer errors
    FetchError lines naming the URL."""
    directory = Path(directory)
    if not is_remote(url):
        raise PrepError(f"{url}: not an object-store URL (s3://, gs://, https://); copy local directories with cp")
    if not directory.is_dir() or not (directory / MANIFEST).is_file() and not (directory / SPLIT_FILE).is_file():
        raise PrepError(f"{directory}: not a finished data_prep output (no {MANIFEST} or {SPLIT_FILE}); run data_prep "
                        "first, or `merge` an array's jobs")
    if not _looks_like_output(directory):
        raise PrepError(f"{directory}: its {MANIFEST} is not a data_prep manifest")
    check_remote_output(url, overwrite, policy)
    _, old = remote_marker(url, policy)
    files = sorted(_files(directory), key=lambda f: (_last(f), f))
    fs, base = filesystem(url)
    put = lambda local, name: call(join(url, name), lambda: fs.put_file(str(local), f"{base}/{name}"),  # noqa: E731
                                   policy, "write")
    gone = lambda name: call(join(url, name), lambda: fs.rm_file(f"{base}/{name}"), policy, "remove")  # noqa: E731
    old_files = set(old["files"]) if old else set()
    for name in sorted(old_files, key=lambda f: -_last(f)):  # the old manifests first: never one without its shards
        if _last(name):
            _missing_ok(gone, name)
    doc = {"tool": TOOL, "run": f"pid {os.getpid()} on {socket.gethostname()}",
           "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    marker = directory / f".{MARKER}.upload.tmp"
    marker.write_text(json.dumps(doc, indent=1) + "\n")
    try:
        put(marker, MARKER)  # first: an interrupted upload is data_prep's, so --overwrite may replace it
    finally:
        marker.unlink(missing_ok=True)
    total = 0
    for name in files:
        if _last(name):
            continue
        put(directory / name, name)
        total += (directory / name).stat().st_size
    for name in sorted(old_files - set(files)):  # the old set's files the new one does not have
        _missing_ok(gone, name)
    for name in files:  # the manifests last, split.json after the manifests it names
        if _last(name):
            put(directory / name, name)
            total += (directory / name).stat().st_size
    return {"files": len(files), "bytes": total}


def _missing_ok(remove, name: str):
    try:
        remove(name)
    except FetchError as e:
        if not str(e).endswith("no such object"):
            raise
