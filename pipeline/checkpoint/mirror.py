"""Checkpoints that survive the node (``checkpoint.mirror``, docs/checkpoints.md "A mirror in object storage"): each
complete checkpoint is copied to an fsspec URL (``s3://``, ``gs://``, ``file://``...) in the background, with the same
rotation there, and a run whose run directory holds no complete checkpoint starts from the newest complete mirrored
one whose digests hold.

The mirror's layout is the run's ``checkpoints/``::

    URL/stepNNNNNNNN/...          every file of the checkpoint; SHA256SUMS is written FIRST, COMPLETE LAST
    URL/latest                    the tag of the newest checkpoint mirrored whole (written after its COMPLETE)

Order of an upload (``Mirror.upload``): SHA256SUMS, then every other file, then COMPLETE, then ``latest``, then the
mirror's rotation. So at every moment each checkpoint prefix of the mirror holds its digests, and a checkpoint looks
complete (COMPLETE) only once every file its digests list is there. Rotation removes a checkpoint's COMPLETE before
its files. A restore (``restore``) takes only checkpoints with COMPLETE, downloads one into
``checkpoints/.mirror-TAG.partial/``, checks every file against SHA256SUMS (pipeline.checkpoint.layout.damaged_files;
a mirrored checkpoint without SHA256SUMS is damaged) and only then renames it into place and points ``latest`` at it;
a damaged one is noted and the previous one tried.

Transfers go through pipeline/data/remote.py (fsspec, its counted retries with backoff and its one-line errors naming
the URL), with data.fetch_retries and data.fetch_backoff_s. Uploads run on rank 0 in one thread of their own, at most
one in flight; a checkpoint completed while one uploads waits for it (a newer one replaces a waiting one, which is
then not mirrored). A failed upload is one warning line and the training goes on. While a checkpoint uploads, its
files are protected from local rotation by the readers' lock (pipeline.checkpoint.layout.READERS, held shared).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from pathlib import Path

from pipeline.checkpoint.layout import (BEST, COMPLETE, DIGESTS, LATEST, READERS, checkpoint_tags, damaged_files,
                                        is_complete, read_client, read_digests, read_latest, tag_step, write_atomic)
from pipeline.data.remote import FetchError, RetryPolicy, call, filesystem, join
from pipeline.errors import ConfigError

RESTORE_LOCK = ".mirror-restore.lock"  # in RUN_DIR: the ranks of one node restore one at a time (the first does it)


def policy_of(cfg) -> RetryPolicy:
    return RetryPolicy(retries=cfg.data.fetch_retries, backoff_s=cfg.data.fetch_backoff_s)


class Store:
    """A mirror URL through fsspec: every call retried by pipeline.data.remote.call."""

    def __init__(self, url: str, policy: RetryPolicy):
        self.url, self.policy = url.rstrip("/"), policy
        self.fs, base = filesystem(self.url)
        self.base = base.rstrip("/")

    def _p(self, name: str) -> str:
        return f"{self.base}/{name}"

    def put(self, local: Path, name: str):
        call(join(self.url, name), lambda: self.fs.put_file(str(local), self._p(name)), self.policy, "write")

    def put_text(self, name: str, text: str):
        call(join(self.url, name), lambda: self.fs.pipe_file(self._p(name), text.encode()), self.policy, "write")

    def get(self, name: str, local: Path):
        local.parent.mkdir(parents=True, exist_ok=True)
        call(join(self.url, name), lambda: self.fs.get_file(self._p(name), str(local)), self.policy, "read")

    def text(self, name: str) -> str | None:
        try:
            return call(join(self.url, name), lambda: self.fs.cat_file(self._p(name)), self.policy).decode(
                errors="replace").strip()
        except FetchError as e:
            if str(e).endswith("no such object"):
                return None
            raise

    def remove(self, name: str):
        try:
            call(join(self.url, name), lambda: self.fs.rm_file(self._p(name)), self.policy, "remove")
        except FetchError as e:
            if not str(e).endswith("no such object"):
                raise

    def listing(self) -> dict[str, set[str]]:
        """{tag: the names of its objects, relative to the tag} of every stepNNNNNNNN prefix in the mirror."""
        try:
            found = call(self.url, lambda: self.fs.find(self.base), self.policy, "list")
        except FetchError as e:
            if str(e).endswith("no such object"):
                return {}
            raise
        out: dict[str, set[str]] = {}
        prefix = self.base + "/"
        for p in found:
            rel = p[len(prefix):] if p.startswith(prefix) else None
            tag, sep, rest = (rel or "").partition("/")
            if sep and tag_step(tag) >= 0:
                out.setdefault(tag, set()).add(rest)
        return out


def upload_order(tag_dir: Path) -> list[str]:
    """The files of a complete checkpoint in the order they are uploaded: SHA256SUMS, the rest, COMPLETE."""
    rest = sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
                  if p.is_file() and p.name not in (COMPLETE, DIGESTS) and not p.name.startswith("."))
    return [DIGESTS, *rest, COMPLETE]


class Mirror:
    """Rank 0's uploader: ``submit(tag_dir)`` (a checkpoint just completed, from the writer thread or the
    synchronous save) returns at once; ``wait()`` returns once nothing is uploading or waiting."""

    def __init__(self, cfg, run_dir: Path, say=print):
        self.url, self.keep_last = cfg.checkpoint.mirror.rstrip("/"), cfg.checkpoint.keep_last
        self.policy, self.ckpt_dir, self.say = policy_of(cfg), Path(run_dir) / "checkpoints", say
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._waiting: Path | None = None
        self._milestones: dict[str, bool] = {}
        self.uploaded: list[str] = []  # tags mirrored whole by this process
        self.failed: list[str] = []  # their one lines

    def submit(self, tag_dir: Path) -> None:
        with self._lock:
            if self._thread is not None:
                if self._waiting is not None:
                    self.say(f"note: checkpoint mirror: {self._waiting.name} is not uploaded ({Path(tag_dir).name} "
                             "was completed while an earlier upload was still running)", flush=True)
                self._waiting = Path(tag_dir)
                return
            self._thread = threading.Thread(target=self._run, args=(Path(tag_dir),), name="checkpoint-mirror",
                                            daemon=True)
            self._thread.start()

    def _run(self, tag_dir: Path) -> None:
        while tag_dir is not None:
            self._upload_reporting(tag_dir)
            with self._lock:
                tag_dir, self._waiting = self._waiting, None
                if tag_dir is None:
                    self._thread = None

    def wait(self) -> None:
        """Until the upload in flight and the one waiting are done (Ctrl-C leaves them)."""
        announced = False
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            if not announced:
                self.say(f"waiting for the checkpoint mirror's upload to {self.url} (Ctrl-C leaves it unfinished)",
                         flush=True)
                announced = True
            try:
                thread.join(0.2)
            except KeyboardInterrupt:  # the run's other end-of-run work still runs
                self.say(f"warning: checkpoint mirror: the upload to {self.url} was left unfinished (Ctrl-C); the "
                         "mirror keeps the checkpoints it had", flush=True)
                return

    def _upload_reporting(self, tag_dir: Path) -> None:
        started = time.perf_counter()
        try:
            self.upload(tag_dir)
        except Exception as e:  # noqa: BLE001 - a mirror never stops the training: one line, and it goes on
            why = str(e) if isinstance(e, (FetchError, OSError)) else f"{type(e).__name__}: {e}"
            still = f"still names {self.uploaded[-1]}" if self.uploaded else "is unchanged"
            line = (f"warning: checkpoint mirror: {tag_dir.name} was not uploaded to {self.url} ({why.splitlines()[0]}"
                    f"); the mirror's {LATEST} {still}; training goes on")
            self.failed.append(line)
            self.say(line, flush=True)
            return
        self.uploaded.append(tag_dir.name)
        self.say(f"checkpoint mirror: {tag_dir.name} uploaded to {self.url} in {time.perf_counter() - started:.2f} s",
                 flush=True)

    def upload(self, tag_dir: Path) -> None:
        """Copy complete checkpoint ``tag_dir`` to the mirror (module docstring's order), point the mirror's
        ``latest`` at it and rotate the mirror. The local files are kept from rotation while they are read."""
        tag = tag_dir.name
        fd = os.open(self.ckpt_dir / READERS, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # local rotation waits for the next save while this checkpoint uploads
            if not is_complete(tag_dir) or read_digests(tag_dir) is None:
                raise FetchError(f"{tag_dir}: not a complete checkpoint with {DIGESTS} (rotated away?)")
            store = Store(self.url, self.policy)
            for name in upload_order(tag_dir):
                store.put(tag_dir / name, f"{tag}/{name}")
            store.put_text(LATEST, tag + "\n")
            self._rotate(store, tag)
        finally:
            os.close(fd)

    def _milestone(self, store: Store, tag: str) -> bool:
        if tag not in self._milestones:
            client = read_client(self.ckpt_dir / tag)
            if client is None:
                text = store.text(f"{tag}/client_state.json")
                try:
                    client = json.loads(text) if text else {}
                except ValueError:
                    client = {}
            self._milestones[tag] = bool(client.get("milestone")) if isinstance(client, dict) else False
        return self._milestones[tag]

    def _rotate(self, store: Store, current: str) -> list[str]:
        """The local rule (pipeline.checkpoint.layout.rotate) on the mirror: keep the ``keep_last`` newest complete
        rotating checkpoints up to ``current``; never ``current``, the mirror's ``latest`` or the one the local
        ``best`` names; never a milestone; incomplete ones (a failed upload) older than the kept ones go too. A
        deleted checkpoint loses its COMPLETE first."""
        if not self.keep_last:
            return []
        listing = store.listing()
        protected = {current, store.text(LATEST), read_latest(self.ckpt_dir, BEST)}
        timeline = sorted((t for t in listing if tag_step(t) <= tag_step(current)), key=tag_step)
        rotating = [t for t in timeline if not (COMPLETE in listing[t] and self._milestone(store, t))]
        kept = [t for t in rotating if COMPLETE in listing[t]][-self.keep_last:]
        oldest_kept = tag_step(kept[0]) if kept else tag_step(current)
        doomed = [t for t in rotating if t not in protected and t not in kept and tag_step(t) < oldest_kept]
        for t in doomed:
            names = sorted(listing[t], key=lambda n: (n != COMPLETE, n == DIGESTS, n))  # COMPLETE first, digests last
            for name in names:
                store.remove(f"{t}/{name}")
        return doomed


def restore(cfg, run_dir: Path, say=print) -> str | None:
    """A run with checkpoint.mirror whose run directory holds no complete checkpoint (empty, or gone with the node):
    the newest complete mirrored checkpoint whose files match its digests, downloaded into ``run_dir/checkpoints``
    and named by ``latest``; the resume then goes on as usual. Returns its tag, or None (nothing to restore, or the
    run directory has its own checkpoints). Every rank calls it (each node's ranks share the run directory: the
    first to take RUN_DIR/.mirror-restore.lock downloads, the others find the checkpoint complete). A mirror that
    cannot be read is a ConfigError: never a fresh start over a run whose history may be there."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not cfg.checkpoint.mirror or any(is_complete(ckpt_dir / t) for t in checkpoint_tags(ckpt_dir)):
        return None
    url = cfg.checkpoint.mirror.rstrip("/")
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(run_dir) / RESTORE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"run_dir {run_dir}: cannot write there ({e.strerror or e}); choose a run_dir on a "
                          "writable filesystem") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if any(is_complete(ckpt_dir / t) for t in checkpoint_tags(ckpt_dir)):
            return None  # another rank of this node restored it
        try:
            return _restore(Store(url, policy_of(cfg)), ckpt_dir, say)
        except FetchError as e:
            raise ConfigError(f"checkpoint.mirror: {e}; {run_dir} holds no complete checkpoint, so the run would "
                              "start over whatever the mirror holds: make the mirror readable (or unset "
                              "checkpoint.mirror to start a new run)") from None
    finally:
        os.close(fd)


def _restore(store: Store, ckpt_dir: Path, say) -> str | None:
    listing = store.listing()
    complete = sorted((t for t, names in listing.items() if COMPLETE in names), key=tag_step)
    if not complete:
        return None
    named = store.text(LATEST)
    order = ([named] if named in complete else []) + [t for t in reversed(complete) if t != named]
    notes = []
    for tag in order:
        tmp = ckpt_dir / f".mirror-{tag}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.perf_counter()
        try:
            for name in sorted(listing[tag]):
                store.get(f"{tag}/{name}", tmp / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        bad = damaged_files(tmp)
        if read_digests(tmp) is None:
            bad.insert(0, (tmp / DIGESTS, "is missing (a mirrored checkpoint must carry its digests)"))
        elif not is_complete(tmp):
            bad.insert(0, (tmp / "client_state.json", "is missing or unreadable"))
        if bad:
            f, why = bad[0]
            notes.append(f"{join(store.url, tag)}/{f.relative_to(tmp).as_posix()} {why}")
            say(f"note: checkpoint mirror: {notes[-1]}; trying the previous mirrored checkpoint", flush=True)
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        dest = ckpt_dir / tag
        if dest.exists():  # an incomplete local copy of the same tag (a save that died): kept aside, never deleted
            os.replace(dest, ckpt_dir / f"incomplete-{tag}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(tmp, dest)
        write_atomic(ckpt_dir / LATEST, tag)
        size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
        say(f"restored checkpoint {tag} from the mirror {store.url} into {ckpt_dir} ({size / 2**20:.1f} MiB in "
            f"{time.perf_counter() - started:.1f} s, digests checked)", flush=True)
        return tag
    raise ConfigError(f"checkpoint.mirror: every complete checkpoint in {store.url} is damaged (newest: {notes[0]}) "
                      f"and {ckpt_dir.parent} holds none; restore the files or use another run_dir")
