"""A run directory's safety rules: one training at a time, complete checkpoints only, rotation that never loses the
resume point.

Layout::

    RUN_DIR/.lock                       held (flock) by rank 0 of the training using RUN_DIR; names its host and pid
    RUN_DIR/checkpoints/stepNNNNNNNN/   DeepSpeed shards + client_state.json + config.yaml + SHA256SUMS + COMPLETE
                                        (written last)
    RUN_DIR/checkpoints/latest          the tag of the newest complete checkpoint (written after COMPLETE)

A checkpoint is complete when its ``COMPLETE`` marker exists and its ``client_state.json`` parses: the marker is
written after every rank's shards and the client state, so a kill at any moment of a save leaves either a complete
checkpoint or one that resume skips. Checkpoints written before the marker existed count as complete when their
client state parses (pipeline/checkpoint/migrate.py).

``SHA256SUMS`` (``sha256sum`` format, so ``cd stepNNNNNNNN && sha256sum -c SHA256SUMS`` checks it by hand) holds the
digest of every other file of the checkpoint, computed when it is marked complete. A file whose bytes changed since
(bit rot, a bad copy, a disk that returned other bytes) is found before any of it is loaded: torch's zip reader checks
no CRC, so a flipped byte inside a tensor would otherwise be trained on. A checkpoint whose client state says it was
written with digests (format 3 on, pipeline/checkpoint/migrate.py) and whose SHA256SUMS is missing or unreadable is
damaged like one with a bad digest: deleting the digest file must not turn a checkpoint into an unchecked one. Only a
checkpoint from before the digests (an older format, no SHA256SUMS) is checked as before (readable archives only),
and ``digest_note`` says so.

Nothing here writes or deletes outside ``RUN_DIR``.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import zipfile
from pathlib import Path

from pipeline.checkpoint import migrate
from pipeline.errors import ConfigError
from pipeline.outputs import take_lock, write_atomic  # noqa: F401 - write_atomic re-exported

LATEST = "latest"
BEST = "best"  # checkpoint.keep_best: the tag of the best checkpoint by a validation metric, outside rotation
COMPLETE = "COMPLETE"
DIGESTS = "SHA256SUMS"
CHECKPOINT_FORMAT = migrate.CURRENT_FORMAT  # client_state.json["format"]


def tag_step(tag: str) -> int:
    return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else -1


def checkpoint_tags(ckpt_dir: Path) -> list[str]:
    """Every stepNNNNNNNN directory, complete or not, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((p.name for p in ckpt_dir.iterdir() if p.is_dir() and tag_step(p.name) >= 0), key=tag_step)


CLIENT_STATE = "client_state.json"


def load_client(tag_dir: Path, raw: bool = False) -> dict:
    """The checkpoint's client_state.json in the current form (pipeline/checkpoint/migrate.py; ``raw``: as written);
    a ConfigError naming the file when it is missing, truncated or not an object. The one reader of that file."""
    client = read_json_object(Path(tag_dir) / CLIENT_STATE)
    return client if raw else migrate.client_state(client)


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path`` (client_state.json, an export's export.json); a ConfigError naming the file when
    it is missing, truncated or not an object."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (an incomplete checkpoint)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}): a truncated or damaged "
                          "checkpoint") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not a checkpoint's JSON (nested too deeply to read)") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return doc


def read_client(tag_dir: Path, raw: bool = False) -> dict | None:
    """``load_client``, or None when the file is missing, truncated or not an object (an incomplete checkpoint)."""
    try:
        return load_client(tag_dir, raw)
    except ConfigError:
        return None


def is_complete(tag_dir: Path) -> bool:
    client = read_client(tag_dir, raw=True)
    if client is None:
        return False
    return (tag_dir / COMPLETE).is_file() or migrate.complete_without_marker(client)


def file_sha256(path: Path) -> str:
    """The sha256 of ``path``, streamed (hashlib.file_digest: memory stays bounded whatever the file's size)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_files(tag_dir: Path) -> list[Path]:
    """Every file of a checkpoint but its markers, sorted by relative path."""
    return sorted(p for p in Path(tag_dir).rglob("*") if p.is_file() and p.name not in (COMPLETE, DIGESTS))


def write_digests(tag_dir: Path, known: dict[str, str] | None = None):
    """SHA256SUMS of every file of the checkpoint; ``known``: {relative path: sha256} of files digested as they were
    written (the background writer's), the others are read."""
    known = known or {}
    lines = []
    for p in checkpoint_files(tag_dir):
        name = p.relative_to(tag_dir).as_posix()
        lines.append(f"{known.get(name) or file_sha256(p)}  {name}\n")
    write_atomic(Path(tag_dir) / DIGESTS, "".join(lines))


def read_digests(tag_dir: Path) -> dict[str, str] | None:
    """{relative path: sha256} from the checkpoint's SHA256SUMS; None when there is no such file (a checkpoint written
    before digests, or one whose digest file is gone: ``damaged_files`` tells them apart). A SHA256SUMS that cannot be
    read (a directory in its place, no permission, an I/O error) is {"SHA256SUMS": ""}: one damaged entry."""
    f = Path(tag_dir) / DIGESTS
    if not f.exists() and not f.is_symlink():
        return None
    try:
        text = f.read_text(errors="replace")
    except OSError as e:
        return {DIGESTS: f"unreadable: {e.strerror or type(e).__name__}"}
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            out[f"{DIGESTS} line {n}"] = ""  # a damaged digest file damages the checkpoint it vouches for
            continue
        out[name] = digest
    return out


def damaged_files(tag_dir: Path) -> list[tuple[Path, str]]:
    """(file, what is wrong) for each file of a complete checkpoint that is not what was written: a torch file
    (``*.pt``, a zip archive) whose archive cannot be opened (truncated, cut short after COMPLETE was written), and
    any file whose sha256 differs from SHA256SUMS or that SHA256SUMS lists and is gone. The archive
    check reads each file's central directory only; the digest check reads every byte (docs/checkpoints.md gives
    its cost)."""
    tag_dir, bad = Path(tag_dir), []
    for f in sorted(tag_dir.glob("*.pt")):
        try:
            with zipfile.ZipFile(f):
                pass
        except (zipfile.BadZipFile, OSError):
            bad.append((f, "is damaged (not a readable torch archive: truncated?)"))
    digests = read_digests(tag_dir)
    if digests is None and migrate.has_digests(read_client(tag_dir, raw=True) or {}):
        bad.append((tag_dir / DIGESTS, "is missing (this checkpoint's client_state.json says it was written with "
                                       "digests, so its files can no longer be checked)"))
    for name, digest in (digests or {}).items():
        f = tag_dir / name
        if any(f == b for b, _ in bad):
            continue
        if name == DIGESTS:
            bad.append((f, f"is {digest} (the digests of this checkpoint's files cannot be read)"))
        elif not digest:
            bad.append((tag_dir / DIGESTS, f"is damaged ({name} is not a digest line)"))
        elif not f.is_file():
            bad.append((f, f"is missing (listed in {DIGESTS})"))
        elif file_sha256(f) != digest:
            bad.append((f, f"is damaged (its sha256 differs from the one recorded in {DIGESTS} when the checkpoint "
                           "was written: its bytes changed since)"))
    return bad


def digest_note(tag_dir: Path) -> str | None:
    """The one line said about a checkpoint read without digests: one from before them (no SHA256SUMS, and its client
    state's format predates format 3), whose files are checked as readable archives only; None otherwise."""
    tag_dir = Path(tag_dir)
    if read_digests(tag_dir) is not None or migrate.has_digests(read_client(tag_dir, raw=True) or {}):
        return None
    return (f"{tag_dir}: written before checkpoint digests (no {DIGESTS}, client_state.json format "
            f"{(read_client(tag_dir, raw=True) or {}).get('format', 'absent')}): its files are checked as readable "
            "archives only")


def check_intact(tag_dir: Path):
    """ConfigError naming the first damaged file of checkpoint ``tag_dir`` (``damaged_files``), before a tool or a
    new run reads it; a checkpoint from before digests is read with ``digest_note`` on stderr."""
    if bad := damaged_files(tag_dir):
        f, why = bad[0]
        raise ConfigError(f"{f}: {why.removeprefix('is ')}; this checkpoint cannot be trusted: use an earlier one "
                          "(or restore the file)")
    if (note := digest_note(tag_dir)) and str(tag_dir) not in _noted:
        _noted.add(str(tag_dir))  # a tool checks before its progress bar starts, and its loader checks again
        print(f"note: {note}", file=sys.stderr, flush=True)


_noted: set[str] = set()  # checkpoints check_intact has said digest_note of, in this process


def read_latest(ckpt_dir: Path, pointer: str = LATEST) -> str | None:
    """What ``latest`` (or another pointer file, ``best``) names (stripped), or None when it is missing, empty or not
    UTF-8 text (then resume falls back to the newest complete checkpoint, and the next save rewrites it). A directory
    in its place is a ConfigError: no save could replace it."""
    path = ckpt_dir / pointer
    if path.is_dir():
        raise ConfigError(f"{path}: a directory where the {pointer} pointer file belongs (it names the checkpoint to "
                          "resume from); move it out of the checkpoint directory")
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def resume_tag(ckpt_dir: Path, check_files: bool = False) -> tuple[str | None, str | None]:
    """(tag to resume from, a note when it is not what ``latest`` names).

    ``latest`` wins when it names a complete checkpoint; otherwise the newest complete checkpoint, and the note says
    why. A checkpoint directory whose checkpoints are all incomplete, or whose ``latest`` names a checkpoint that is
    gone with no complete one left, is a ConfigError: never a fresh start over a run that has history. With
    ``check_files`` (a training resuming; tools check the checkpoint they load, ``check_intact``) a complete
    checkpoint with a damaged file (``damaged_files``) counts as incomplete. Files are checked newest candidate first
    and only until one is intact, so a resume reads the bytes of one checkpoint, not of every one kept (on every
    rank: each resolves its resume point itself).
    """
    tags = checkpoint_tags(ckpt_dir)
    named = read_latest(ckpt_dir)
    complete = [t for t in tags if is_complete(ckpt_dir / t)]
    damaged = {}  # complete checkpoints found with a damaged file: (file, why), skipped like incomplete ones
    order = ([named] if named in complete else []) + [t for t in reversed(complete) if t != named]
    chosen = None
    for t in order:
        bad = damaged_files(ckpt_dir / t) if check_files else []
        if not bad:
            chosen = t
            break
        damaged[t] = bad[0]
    if chosen is not None and chosen == named:
        return named, None
    if chosen is None:
        if damaged:
            t = max(damaged, key=tag_step)
            f, why = damaged[t]
            raise ConfigError(f"{ckpt_dir / t}: {f.relative_to(ckpt_dir / t)} {why} and no earlier complete "
                              "checkpoint is intact; restore the file or use another run_dir")
        if tags:
            raise ConfigError(f"{ckpt_dir}: holds checkpoints ({', '.join(tags[-3:])}) but none is complete (no "
                              f"{COMPLETE} marker or an unreadable client_state.json); refusing to start over them. "
                              "Move them away or use another run_dir")
        if (ckpt_dir / LATEST).exists():
            raise ConfigError(f"{ckpt_dir}: {LATEST} names {named or 'nothing'}, but no checkpoint is left (the step "
                              f"directories are gone); refusing to start {ckpt_dir.parent} over its history. Restore "
                              "the checkpoints, or use another run_dir")
        return None, None
    if not (ckpt_dir / LATEST).exists():
        why = f"{LATEST} is missing"
    elif named is None:
        why = f"{LATEST} is empty or not UTF-8 text"
    elif named not in tags:
        why = f"{LATEST} names {named}, which does not exist"
    elif named in damaged:
        f, what = damaged[named]
        why = f"{LATEST} names {named}, whose {f.relative_to(ckpt_dir / named)} {what}"
    else:
        why = f"{LATEST} names {named}, which is incomplete"
    skipped = [t for t in damaged if t != named]
    if skipped:
        why += "; skipped as damaged: " + ", ".join(
            f"{t} ({damaged[t][0].relative_to(ckpt_dir / t)})" for t in skipped)
    return chosen, f"{ckpt_dir}: {why}; resuming from the newest complete checkpoint {chosen}"


def check_no_links(ckpt_dir: Path) -> None:
    """ConfigError naming the first symbolic link among ``ckpt_dir`` (RUN_DIR/checkpoints), its checkpoints and its
    pointer files. Checkpoints are written, rotated and deleted only inside the run directory: a save of the tag a
    link names, or its rotation, would act on whatever the link points to (and shutil.rmtree refuses a link: it
    ended a run at its next save with 'Cannot call rmtree on a symbolic link'). Checked before anything starts."""
    ckpt_dir = Path(ckpt_dir)
    links = [ckpt_dir] if ckpt_dir.is_symlink() else []
    if not links and ckpt_dir.is_dir():
        links = sorted(p for p in ckpt_dir.iterdir() if p.is_symlink() and (tag_step(p.name) >= 0 or p.name in (
            LATEST, BEST)))
    if links:
        link = links[0]
        raise ConfigError(f"{link}: a symbolic link (to {os.readlink(link)}); a run writes, rotates and deletes its "
                          "checkpoints only inside its run_dir, never through a link: move what it points to into "
                          f"{ckpt_dir if link != ckpt_dir else ckpt_dir.parent} (or put the whole run_dir on that "
                          "filesystem)")


def mark_complete(tag_dir: Path, known: dict[str, str] | None = None, fault=lambda name: None):
    """Record the digests of every file (``known``: those digested as they were written), then the COMPLETE marker:
    the marker vouches for the digests too. ``fault``: the background writer's fault points (its kill test)."""
    write_digests(tag_dir, known)
    fault(DIGESTS)
    write_atomic(tag_dir / COMPLETE, time.strftime("%Y-%m-%dT%H:%M:%S\n"))


def rotate(ckpt_dir: Path, keep_last: int, current: str) -> list[str]:
    """Delete old rotating checkpoints so that ``keep_last`` complete ones remain; returns the deleted tags.

    Only checkpoints up to ``current`` (the one just written) are considered (a rollback sets later ones aside first,
    ``set_aside_later_checkpoints``). Milestones (client_state ``milestone``) are never rotated; ``current`` and the
    tags ``latest`` and ``best`` name are never deleted. Incomplete checkpoints older than the kept ones go with them. While a tool
    reads a checkpoint of the run (``hold_off_rotation``) nothing is deleted: the next save rotates.
    """
    if not keep_last:
        return []
    try:
        fd = os.open(ckpt_dir / READERS, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a tool is reading a checkpoint of this run: rotate at the next save instead
            os.close(fd)
            return []
    try:
        return _rotate(ckpt_dir, keep_last, current)
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _rotate(ckpt_dir: Path, keep_last: int, current: str) -> list[str]:
    protected = {current, read_latest(ckpt_dir), read_latest(ckpt_dir, BEST)}
    timeline = [t for t in checkpoint_tags(ckpt_dir) if tag_step(t) <= tag_step(current)]
    rotating = [t for t in timeline if not (read_client(ckpt_dir / t) or {}).get("milestone")]
    kept = [t for t in rotating if is_complete(ckpt_dir / t)][-keep_last:]
    oldest_kept = tag_step(kept[0]) if kept else tag_step(current)
    doomed = [t for t in rotating if t not in protected and t not in kept and tag_step(t) < oldest_kept]
    for t in doomed:
        shutil.rmtree(ckpt_dir / t, ignore_errors=True)
    return doomed


READERS = ".readers.lock"  # in checkpoints/: tools reading a checkpoint hold it shared, rotation takes it exclusively
_held: list[int] = []  # this process's shared locks, kept until it exits


def hold_off_rotation(path: Path) -> None:
    """Keep the training that writes the checkpoints at ``path`` (a run dir, its checkpoints/ dir or a tag dir) from
    deleting any of them for the rest of this process: a shared flock on CHECKPOINTS/.readers.lock, which rotation
    must take exclusively. For short-lived tools (convert, evaluate): an export during rotation otherwise finds the
    checkpoint it resolved gone or half-deleted. Nothing for an export, or where no training ever rotated (the lock
    file is made by the first rotation, at a run's first save, before anything can be deleted)."""
    p = Path(path)
    ckpts = p / "checkpoints" if (p / "checkpoints").is_dir() else p if (p / LATEST).exists() else (
        p.parent if (p / CLIENT_STATE).is_file() else None)
    if ckpts is None:
        return
    try:  # never created here: a tool writes nothing into the run (rotation made it at the run's first save)
        fd = os.open(ckpts / READERS, os.O_RDONLY)
    except OSError:
        return
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a rotation deletes (milliseconds)
    _held.append(fd)


def set_aside_later_checkpoints(ckpt_dir: Path, tag: str) -> Path | None:
    """A rollback to ``tag``: move the checkpoints of the abandoned timeline (steps after it) into
    ``checkpoints/abandoned_after_<tag>_<time>/``, kept but out of the way of resume, rotation and evaluation.
    Returns that directory, or None when there was nothing later."""
    later = [t for t in checkpoint_tags(ckpt_dir) if tag_step(t) > tag_step(tag)]
    if not later:
        return None
    stamp, n = time.strftime('%Y%m%d-%H%M%S'), 0
    while (aside := ckpt_dir / f"abandoned_after_{tag}_{stamp}{f'-{n}' if n else ''}").exists():
        n += 1
    aside.mkdir()
    for t in later:
        os.replace(ckpt_dir / t, aside / t)
    return aside


class RunDirLock:
    """An exclusive ``flock`` on RUN_DIR/.lock for the life of the training (rank 0 holds it).

    The kernel drops the lock when the holder dies, so a killed run never leaves a stale lock; the file's text
    (host, pid, start time) is only for the message a second training gets.
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self.fd = None

    def acquire(self):
        try:  # the first write of a training into run_dir: a read-only or full filesystem fails here, in one line
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, holder = take_lock(self.path, f"host {socket.gethostname()}, pid {os.getpid()}, since "
                                              f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
        except OSError as e:
            raise ConfigError(f"run_dir {self.path.parent}: cannot write there ({e.strerror or e}); choose a "
                              "run_dir on a writable filesystem") from None
        if fd is None:
            raise ConfigError(f"run_dir {self.path.parent}: in use by another training ({holder or 'unknown holder'}"
                              "); wait for it to end or give this run another run_dir")
        self.fd = fd

    def release(self):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
