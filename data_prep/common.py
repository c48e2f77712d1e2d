"""What the data_prep modules share, below all of them but fasta and checks: the names of the files a run writes,
the record-id split, and the rules for replacing an output directory."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path

import numpy as np

from pipeline.outputs import OutputDirError, check_output_dir, write_atomic, written_by

from .checks import FILTERED, PrepError

# pipeline.data.shards is imported only where shards are written or read: webdataset pulls in torch (~2 s), and
# argument or output-directory mistakes should be reported at once. Its constants are mirrored here.
MANIFEST = "manifest.json"  # pipeline.data.shards.MANIFEST
TOOL = "data_prep"  # the ownership marker's tool name (pipeline.outputs.publish_dir)
SHARD_FORMAT = "bioseq-wds/2"  # pipeline.data.shards.FORMAT: shards of blocks of samples
BLOCK_SAMPLES = 2048  # pipeline.data.shards.BLOCK_SAMPLES
JOB_MANIFEST_RE = re.compile(r"manifest-job(\d{4})-of-(\d{4})\.json")
FILTERED_HEADER = ("id", "reason", "input", "line", "detail")
SPLIT_FILE = "split.json"
SPLITS = ("train", "val")
TAILS = ("short", "align", "drop")
# The header of a UniRef50 -> UniRef90 clusters TSV (data_prep/clusters.py), also recognized in a members file.
TSV_HEADER = ("UR50_cluster_name", "mapped_id")

# byte -> is an ASCII lowercase letter (soft-masked residues are counted, then upper-cased)
LOWERCASE = np.zeros(256, dtype=bool)
LOWERCASE[ord("a"):ord("z") + 1] = True
LOWERCASE.flags.writeable = False

__all__ = ["TOOL", "FILTERED", "FILTERED_HEADER", "MANIFEST", "SHARD_FORMAT", "BLOCK_SAMPLES", "JOB_MANIFEST_RE",
           "SPLIT_FILE", "SPLITS", "TAILS", "TSV_HEADER", "LOWERCASE", "job_manifest_name", "job_filtered_name",
           "split_of", "split_doc", "check_output_replaceable", "manifest_files", "lock_path", "output_lock", "write_json"]


SAMPLED_BLOCKS, SAMPLED_BLOCK = 17, 1 << 16  # input_fingerprint: 17 x 64 KiB, the first and the last included
FINGERPRINT = ("path", "size", "sha256_sampled")  # an input's identity in a job manifest


def input_fingerprint(path: Path) -> dict:
    """What a job records of an input so that ``merge`` can tell whether every job read the same version of it: its
    size and the sha256 of 17 blocks of 64 KiB spread evenly over it, first and last included (the whole file when
    it is smaller than that). A full digest would read every byte a second time in each job; the sampled one reads
    1.1 MiB and still catches a file replaced, appended to or cut (not an edit that keeps the size and touches
    only unsampled bytes)."""
    size = Path(path).stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLED_BLOCKS * SAMPLED_BLOCK:
            h.update(f.read())
        else:
            for i in range(SAMPLED_BLOCKS):
                f.seek((size - SAMPLED_BLOCK) * i // (SAMPLED_BLOCKS - 1))
                h.update(f.read(SAMPLED_BLOCK))
    return {"size": size, "sha256_sampled": h.hexdigest()}


def job_manifest_name(index: int, count: int) -> str:
    return f"manifest-job{index:04d}-of-{count:04d}.json"


def job_filtered_name(index: int, count: int) -> str:
    return f"filtered-job{index:04d}-of-{count:04d}.tsv"


def split_of(record_id: str, val_fraction: float | None) -> str:
    """'' without a split, else 'val' or 'train' by sha256 of the record id (data_prep/jobs.py's docstring)."""
    if val_fraction is None:
        return ""
    h = int.from_bytes(hashlib.sha256(record_id.encode("utf-8", "surrogateescape")).digest()[:8], "little")
    return "val" if h < val_fraction * 2.0 ** 64 else "train"


def split_doc(manifests: dict, val_fraction: float, source: str) -> dict:
    """``split.json`` of a --val-fraction output: the rule and each split's manifest, samples, tokens and records."""
    return {"source": source, "val_fraction": val_fraction,
            "by": "sha256(record id)[:8] as a little-endian integer < val_fraction * 2**64 -> val",
            "splits": {k: {"manifest": f"{k}/{MANIFEST}", "samples": m.total_samples, "tokens": m.total_tokens,
                           "records": sum(i["records"] for i in m.inputs)} for k, m in manifests.items()}}


def _looks_like_output(directory: Path) -> bool:
    """Whether data_prep wrote ``directory``: its ownership marker (pipeline.outputs.publish_dir), or, for outputs
    written before the marker and by array jobs and merge, a manifest (split, job) that parses as data_prep's. A file
    merely *named* manifest.json (``{}``) is anyone's, so its folder is never replaced."""
    if written_by(TOOL)(directory):
        return True
    candidates = [directory / MANIFEST, directory / SPLIT_FILE]
    candidates += [p for p in directory.iterdir() if JOB_MANIFEST_RE.fullmatch(p.name)]
    for s in SPLITS:
        if (directory / s).is_dir():
            candidates += [directory / s / MANIFEST]
            candidates += [p for p in (directory / s).iterdir() if JOB_MANIFEST_RE.fullmatch(p.name)]
    return any(_is_manifest(p) for p in candidates)


def _is_manifest(path: Path) -> bool:
    """A data_prep manifest: a shard list (manifest.json, job manifests) or a split record (split.json)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(doc, dict):
        return False
    if path.name == SPLIT_FILE:
        return isinstance(doc.get("splits"), dict) and "val_fraction" in doc
    shards = doc.get("shards")
    return isinstance(shards, list) and all(isinstance(x, dict) and "path" in x and "sha256" in x for x in shards)


def manifest_files(directory: Path) -> set[str]:
    """The files of ``directory`` that a data_prep manifest in it names, as paths relative to it: each manifest
    (manifest.json, the job manifests, split.json and the train/ val/ manifests), the shards it lists, its list of
    dropped records (stats.filtered_list) and its sentencepiece model. What ``--overwrite`` may replace in an output
    without a valid ownership marker (one written before markers, or whose marker is damaged): anything else there
    is a user's and is kept (pipeline.outputs.publish_dir). A name that is absolute or climbs out (``..``) is
    ignored: a manifest never causes a deletion outside its folder."""
    names: set[str] = set()

    def add(name) -> None:
        if isinstance(name, str) and name and not Path(name).is_absolute() and ".." not in Path(name).parts:
            names.add(Path(name).as_posix())

    def claim(folder: str, path: Path) -> None:
        if not _is_manifest(path):
            return
        add(f"{folder}{path.name}")
        doc = json.loads(path.read_text())
        if path.name == SPLIT_FILE:
            return
        for shard in doc["shards"]:
            add(f"{folder}{shard['path']}" if isinstance(shard["path"], str) else None)
        stats, tok = doc.get("stats"), doc.get("tokenizer")
        if isinstance(stats, dict) and isinstance(stats.get("filtered_list"), str):
            add(f"{folder}{stats['filtered_list']}")
        if isinstance(tok, dict) and isinstance(tok.get("model"), str):
            add(f"{folder}{tok['model']}")

    for folder in ("", *(f"{s}/" for s in SPLITS)):
        d = directory / folder if folder else directory
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.name in (MANIFEST, SPLIT_FILE) or JOB_MANIFEST_RE.fullmatch(p.name):
                claim(folder, p)
    return names


def check_output_replaceable(output: Path, overwrite: bool) -> None:
    """--overwrite replaces the whole directory: refuse a non-empty one without it, one data_prep did not write, and
    a mount point (the finished output is renamed into place: found now, not after the work)."""
    try:
        check_output_dir(output, force=overwrite, owned=_looks_like_output, what="a data_prep output",
                         tool=TOOL, flag="--overwrite")
    except OutputDirError as e:
        raise PrepError(str(e)) from None


def lock_path(output: Path) -> Path:
    """The one lock of an output directory, beside it (the output itself is renamed into place, and may not exist)."""
    return output.with_name(f".{output.name}.data_prep.lock")


@contextlib.contextmanager
def output_lock(output: Path, what: str, shared: bool = False):
    """The lock every data_prep run takes on its output for as long as it may write there: a plain run, a --workers
    run, merge and synthetic-hops exclusively; the jobs of a --num-jobs array shared (they write one output
    together). A second run is refused in one line naming the holder (PrepError), before it creates or removes
    anything: two runs on one output, one plain and one --workers, both exited 0 and both reported writing it, the
    later one silently replacing the other's records (campaign 3, case 3). ``what``: how the holder is named.

    An flock on ``lock_path(output)``: the kernel drops it when its holder dies, so a killed run never blocks the
    next. The last holder removes the file; a run that opened it just before that finds, once locked, that the path
    names another file or none, and tries again (so two runs never hold two different files)."""
    path = lock_path(output)
    holder = f"{what}, pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 4096, 0).decode(errors="replace").strip().replace("\n", "; ")
            os.close(fd)
            raise PrepError(f"{output} is being written by another data_prep run ({text or 'a process'}); wait for "
                            "it to end, or write to another --output") from None
        try:
            st, now = os.fstat(fd), os.stat(path)
            same = (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    if not shared:
        os.ftruncate(fd, 0)
    os.write(fd, (holder + "\n").encode())  # a shared holder adds its line beside its siblings'
    try:
        yield
    finally:
        try:  # the last holder (exclusive now, or the last of the shared ones) removes the file
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
        except BlockingIOError:
            pass
        os.close(fd)


def write_json(path: Path, doc: dict) -> None:
    write_atomic(path, json.dumps(doc, indent=1) + "\n")
