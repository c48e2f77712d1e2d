"""Shard sets in object storage (``s3://``, ``gs://``, ``https://``): fetched whole into a bounded local cache, so that
the reader, the shuffle and the resume are exactly those of a local directory (docs/data.md, "Remote shard sets").

Access goes through fsspec (s3fs, gcsfs: the ``[remote]`` extra); credentials come from the usual environment and
config files of each library (``AWS_*``, ``~/.aws``, ``GOOGLE_APPLICATION_CREDENTIALS``; botocore also reads
``AWS_ENDPOINT_URL`` for an S3-compatible store); nothing in the project's config holds a secret. The libraries' own
retries are turned off where they can be (s3fs, botocore) so that every retry happens here, with backoff, and is
counted (:class:`RetryPolicy`, :data:`COUNTERS`).

A remote shard set is ``URL/manifest.json`` plus the shards it lists. The manifest is read from the URL (its sha256
is the data fingerprint a checkpoint records, as for local data); the shards' sizes and ETags come from one listing
of the prefix (s3, gs) or a HEAD per shard (http), which also names a missing shard before training starts.

The cache (:class:`ShardCache`): one directory per run (``data.cache_dir``), shared by every process of a node
that trains the run, bounded in bytes (``data.cache_bytes``). Its layout::

    objects/<sha256>.tar                  a verified shard (content-addressed: the manifest's digest)
    objects/<sha256>.<size>.<pid>.part    a download in progress (counted as <size> bytes from the start)
    locks/<sha256>.fetch                  flock EX while a process downloads the shard: one download per node
    locks/<sha256>.pin                    flock SH while a process reads it (the loader): never evicted then
    locks/<sha256>.hint                   flock SH while a process holds it prefetched for one of its streams
    .lock                                 flock EX around every decision on space (reserve, evict, clean up)
    usage.json                            the peak size the cache reached ({"peak_bytes": ...})

A shard is downloaded to its ``.part`` name, checked (the object's size as listed and as received, the manifest's
sha256) and renamed: a torn or changed download is never read. Space is reserved under ``.lock`` before a download
starts, so the files never add up to more than the limit. Eviction takes the least recently used shard that no
process pins or has prefetched; a shard the loader needs now (a *demand*) may also take the room of a prefetched
one (the newest first, counted as ``evicted_prefetched``), because a prefetched shard is held across the steps'
collectives and waiting for it could deadlock two ranks; prefetching itself never evicts a pinned or prefetched
shard, and takes at most ``limit / processes`` bytes per process. All locks are ``flock``: the kernel drops them
when their holder dies, and a ``.part`` whose fetch lock nobody holds is a dead download, removed.

Prefetch: each process runs one background thread that downloads the next ``data.prefetch_shards`` shards of each
of its loader streams (in the order the streams will read them, across epochs), so that at steady state the loader
finds its next shard in the cache.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from pipeline.data.shards import MANIFEST, Manifest, ShardError, check_counts_fit, parse_manifest

REMOTE_SCHEMES = ("s3", "gs", "gcs", "http", "https")
EXTRA = "pip install 'bioseq-pretrain[remote]'"  # s3fs and gcsfs; http needs only fsspec and aiohttp


def is_remote(spec) -> bool:
    """Whether a shard-set spec is a URL of object storage (``s3://``, ``gs://``, ``gcs://``, ``http(s)://``)."""
    head, sep, _ = str(spec).partition("://")
    return bool(sep) and head.lower() in REMOTE_SCHEMES


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


class FetchError(ShardError):
    """An object that could not be read from the store (after the retries), or that is not what the manifest lists;
    the message is one line naming the URL and the error."""


# --------------------------------------------------------------------------------------------------------------------
# Counters and retries
# --------------------------------------------------------------------------------------------------------------------
COUNTER_NAMES = ("fetched_bytes", "fetches", "cache_hits", "retries", "wait_s", "evicted", "evicted_prefetched")


class Counters:
    """This process's remote-data counters (thread-safe). ``take()`` returns what was added since the last take: the
    loader attaches it to each batch, so that DataLoader workers' counts reach the training process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._now = dict.fromkeys(COUNTER_NAMES, 0)
        self._taken = dict(self._now)

    def _fresh(self):
        if self._pid != os.getpid():  # a forked worker starts from zero (its parent's counts are the parent's)
            self._pid, self._now, self._taken = os.getpid(), dict.fromkeys(COUNTER_NAMES, 0), \
                dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, name: str, value=1):
        with self._lock:
            self._fresh()
            self._now[name] += value

    def total(self) -> dict:
        with self._lock:
            self._fresh()
            return dict(self._now)

    def take(self) -> dict:
        with self._lock:
            self._fresh()
            delta = {k: self._now[k] - self._taken[k] for k in COUNTER_NAMES}
            self._taken = dict(self._now)
            return delta


COUNTERS = Counters()


@dataclass(frozen=True)
class RetryPolicy:
    """Transient errors (a refused or reset connection, a timeout, HTTP 5xx or 429, S3 throttling, a download cut
    short) are retried ``retries`` times, waiting ``backoff_s`` x 2^i (at most ``max_backoff_s``) before try i + 1."""

    retries: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def wait(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt)


class Torn(Exception):
    """A download that ended before the object's size: retried (transient)."""


_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "429",
                    "RequestLimitExceeded", "TooManyRequests"}


def _status(e: BaseException) -> int | None:
    """The HTTP status an error carries (aiohttp's ClientResponseError, botocore's ClientError), if any."""
    status = getattr(e, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def transient(e: BaseException) -> bool:
    """Whether an error from the store is worth another try (module docstring of RetryPolicy)."""
    for x in _chain(e):
        if isinstance(x, (Torn, ConnectionError, TimeoutError)):
            return True
        status = _status(x)
        if status is not None and (status >= 500 or status == 429):
            return True
        code = getattr(x, "response", {}).get("Error", {}).get("Code") if isinstance(
            getattr(x, "response", None), dict) else None
        if code in _TRANSIENT_CODES:
            return True
        name = type(x).__name__
        # aiohttp's and botocore's connection errors, without importing either (each is optional)
        if name in ("ClientConnectorError", "ClientPayloadError", "ServerDisconnectedError", "ClientOSError",
                    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                    "HTTPClientError", "ResponseStreamingError", "IncompleteRead", "IncompleteReadError",
                    "AioReadTimeoutError", "FSTimeoutError"):
            return True
        if isinstance(x, OSError) and x.errno in (errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT,
                                                    errno.EPIPE, errno.EREMOTEIO):
            return True
    return False


def describe(e: BaseException) -> str:
    """An error as one short line: its type and first line, credentials named as such."""
    for x in _chain(e):
        if type(x).__name__ in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"):
            return (f"no credentials ({str(x).splitlines()[0]}): set them in the environment or the store's config "
                    "file (AWS_ACCESS_KEY_ID / AWS_PROFILE / ~/.aws/credentials, GOOGLE_APPLICATION_CREDENTIALS)")
    for x in _chain(e):
        if isinstance(x, PermissionError) or _status(x) in (401, 403):
            return f"access denied ({_line(x)}): are the credentials right, and may they read it?"
    return f"{type(e).__name__}: {_line(e)}"


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(e).__name__


def call(url: str, fn, policy: RetryPolicy, what: str = "read"):
    """``fn()`` with ``policy``'s retries on transient errors (each counted in COUNTERS["retries"]); a FetchError
    naming ``url`` when it still fails, or at once for an error no retry can fix (missing object, credentials)."""
    attempt = 0
    while True:
        try:
            return fn()
        except FetchError:
            raise
        except Exception as e:  # noqa: BLE001 - every library's errors: classified, then named in one line
            if isinstance(e, ImportError):
                raise FetchError(f"{url}: {e}; install the remote extra: {EXTRA}") from None
            if not transient(e):
                if isinstance(e, FileNotFoundError):
                    raise FetchError(f"{url}: no such object") from None
                raise FetchError(f"{url}: cannot {what} it: {describe(e)}") from None
            if attempt >= policy.retries:
                raise FetchError(f"{url}: cannot {what} it after {attempt + 1} tries: {describe(e)}") from None
            COUNTERS.add("retries")
            time.sleep(policy.wait(attempt))
            attempt += 1


# --------------------------------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------------------------------
def filesystem(url: str):
    """(fsspec filesystem, path) for ``url``, with the library's own retries off (s3fs: one try per call; botocore:
    one attempt) so that :func:`call` retries and counts. ImportError names the extra to install."""
    import fsspec

    protocol = url.partition("://")[0].lower()
    options = {}
    if protocol == "s3":
        options = {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise FetchError(f"{url}: reading {protocol}:// needs a package that is not installed ({e}); "
                         f"install the remote extra: {EXTRA}") from None
    if protocol == "s3":
        fs.retries = 1  # s3fs's own retry loop (a class attribute): one try per call, call() retries
    return fs, path


def read_bytes(url: str, policy: RetryPolicy = RetryPolicy()) -> bytes:
    fs, path = filesystem(url)
    data = call(url, lambda: fs.cat_file(path), policy)
    COUNTERS.add("fetched_bytes", len(data))
    return data


@dataclass(frozen=True)
class RemoteSet:
    """A remote shard set as read at the start: its manifest, the manifest's bytes and sha256, and each shard's
    object size and ETag (None where the store gives none)."""

    url: str
    manifest: Manifest
    manifest_sha256: str
    sizes: tuple
    etags: tuple


@lru_cache(maxsize=None)
def open_set(url: str, policy: RetryPolicy = RetryPolicy()) -> RemoteSet:
    """Read ``URL/manifest.json`` and the size and ETag of every shard it lists (one listing of the prefix for s3 and
    gs, a HEAD per shard for http); cached per process. A missing manifest or shard, missing or wrong credentials and
    an unreachable store are one FetchError line naming the URL."""
    url = url.rstrip("/")
    murl = join(url, MANIFEST)
    try:
        raw = read_bytes(murl, policy)
    except FetchError as e:
        if str(e).endswith("no such object"):
            raise FetchError(f"{murl}: no manifest.json at this URL (not a shard set, or its upload has not "
                             "finished: `data_prep upload` writes the manifest last)") from None
        raise
    manifest = parse_manifest(raw, murl)
    fs, base = filesystem(url)
    found: dict[str, dict] = {}
    http = _is_http(fs)
    if not http:  # one listing gives every shard's size and ETag
        listing = call(url, lambda: fs.find(base, detail=True), policy, "list")
        prefix = base.rstrip("/") + "/"
        found = {p[len(prefix):]: d for p, d in listing.items() if p.startswith(prefix)}
    sizes, etags = [], []
    for i, s in enumerate(manifest.shards):
        d = found.get(s.path)
        if d is None:
            if not http:
                raise FetchError(f"{murl}: lists shard {s.path} which is missing from {url}")
            surl = join(url, s.path)
            d = call(surl, lambda: fs.info(fs._strip_protocol(surl)), policy, "stat")
        if d.get("size") is None:
            raise FetchError(f"{join(url, s.path)}: the store gives no size for it (a shard set needs one)")
        sizes.append(int(d["size"]))
        check_counts_fit(s, i, sizes[-1], murl)
        etags.append(_etag(d))
    return RemoteSet(url, manifest, hashlib.sha256(raw).hexdigest(), tuple(sizes), tuple(etags))


def _is_http(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"http", "https"} & set(protocols))


def _etag(info: dict) -> str | None:
    for k in ("ETag", "etag", "Etag"):
        if info.get(k):
            return str(info[k]).strip('"')
    return None


def fingerprint(spec) -> dict | None:
    """What a checkpoint records of a shard set (pipeline.data.shards.data_fingerprint), for a URL too: the sha256 of
    its manifest.json and its shard and sample counts."""
    from pipeline.data.shards import data_fingerprint

    if not is_remote(spec):
        return data_fingerprint(spec)
    s = open_set(str(spec))
    return {"sha256": s.manifest_sha256, "shards": len(s.manifest.shards), "samples": s.manifest.total_samples}


def manifest_of(spec) -> Manifest:
    """A shard set's manifest, local directory or URL."""
    from pipeline.data.shards import load_manifest

    return open_set(str(spec)).manifest if is_remote(spec) else load_manifest(spec)


# --------------------------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSettings:
    """``directory`` (data.cache_dir resolved), ``limit_bytes`` (data.cache_bytes), ``prefetch`` shards ahead per
    stream (data.prefetch_shards), ``retry``, ``processes``: the processes of a node sharing the cache (its ranks x
    their DataLoader workers): each may hold at most limit / processes bytes prefetched."""

    directory: str
    limit_bytes: int
    prefetch: int = 2
    retry: RetryPolicy = RetryPolicy()
    processes: int = 1


@dataclass(frozen=True)
class Remote:
    """One shard of a remote set, as the cache needs it."""

    url: str
    sha256: str
    size: int
    etag: str | None
    set_url: str  # the shard set's URL: its manifest is read again to tell a rewritten set from a changed object
    set_sha256: str  # the manifest's sha256 at the start of the run


class _Flock:
    """An open lock file; ``take(mode)`` blocks, ``try_take(mode)`` does not."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def take(self, mode=fcntl.LOCK_EX):
        fcntl.flock(self.fd, mode)
        return self

    def try_take(self, mode=fcntl.LOCK_EX) -> bool:
        try:
            fcntl.flock(self.fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def close(self):
        if self.fd is not None:
            os.close(self.fd)  # drops the lock
            self.fd = None


class ShardCache:
    """The node's shard cache (module docstring) as seen by one process: ``acquire`` (the loader needs a shard now:
    its local path, pinned until ``release``), ``want`` (a stream's next shards, for the prefetch thread)."""

    _instances: dict = {}
    _instances_lock = threading.Lock()

    @classmethod
    def get(cls, settings: CacheSettings) -> "ShardCache":
        """This process's cache object for ``settings`` (a forked DataLoader worker makes its own)."""
        key = (os.getpid(), settings)
        with cls._instances_lock:
            if key not in cls._instances:
                cls._instances[key] = cls(settings)
            return cls._instances[key]

    def __init__(self, settings: CacheSettings):
        self.settings = settings
        self.root = Path(settings.directory)
        self.objects, self.locks = self.root / "objects", self.root / "locks"
        try:
            self.objects.mkdir(parents=True, exist_ok=True)
            self.locks.mkdir(exist_ok=True)
        except OSError as e:
            raise ShardError(f"data.cache_dir: cannot create the shard cache {self.root} ({e.strerror or e})") from None
        self.limit = settings.limit_bytes
        self.pins: dict[str, list] = {}  # sha -> pin locks held by this process (one per acquire)
        self.hints: dict[str, tuple[_Flock, int]] = {}  # sha -> (hint lock, size): prefetched, not yet read
        self.wants: dict = {}  # stream key -> [Remote] the stream reads next, in order
        self.skip: set = set()  # shas the prefetcher failed on: left to the loader's own fetch
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None

    # -- paths and locks
    def path(self, sha: str) -> Path:
        return self.objects / f"{sha}.tar"

    def _lockfile(self, sha: str, kind: str) -> _Flock:
        return _Flock(self.locks / f"{sha}.{kind}")

    def _space_lock(self) -> _Flock:
        return _Flock(self.root / ".lock").take()

    # -- the loader's side
    def acquire(self, r: Remote) -> Path:
        """The local path of shard ``r``, fetched (or waited for) if the cache lacks it, pinned until
        :meth:`release`: no process evicts it meanwhile. Time spent waiting counts as ``wait_s``."""
        t0 = time.perf_counter()
        pin = self._lockfile(r.sha256, "pin").take(fcntl.LOCK_SH)
        try:
            obj, hit = self.path(r.sha256), True
            while not obj.is_file():
                hit = False
                fetch = self._lockfile(r.sha256, "fetch").take()  # another process or our prefetch: wait for it
                try:
                    if not obj.is_file():
                        self._download(r, demand=True)
                finally:
                    fetch.close()
            os.utime(obj)  # least recently used = oldest mtime
        except BaseException:
            pin.close()
            raise
        with self._lock:
            self.pins.setdefault(r.sha256, []).append(pin)
        COUNTERS.add("cache_hits" if hit else "wait_s", 1 if hit else time.perf_counter() - t0)
        return obj

    def release(self, r: Remote):
        """The loader has read shard ``r`` into memory: no longer pinned, nor prefetched for this process."""
        with self._lock:
            pins = self.pins.get(r.sha256)
            if pins:
                pins.pop().close()
                if not pins:
                    del self.pins[r.sha256]
            hint = self.hints.pop(r.sha256, None)
        if hint is not None:
            hint[0].close()
        self._wake.set()

    def want(self, key, upcoming: list[Remote]):
        """Stream ``key`` reads ``upcoming`` next, in that order: the prefetch thread fetches the first
        ``prefetch`` of them that are not cached (its other streams' too), and lets go of what no stream wants."""
        if self.settings.prefetch <= 0:
            return
        with self._lock:
            self.wants[key] = list(upcoming[:self.settings.prefetch])
            wanted = {r.sha256 for rs in self.wants.values() for r in rs}
            stale = [s for s in self.hints if s not in wanted]
            dropped = [self.hints.pop(s)[0] for s in stale]
        for lock in dropped:
            lock.close()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._prefetch_loop, daemon=True, name="shard-prefetch")
            self._thread.start()
        self._wake.set()

    # -- prefetch
    def _prefetch_loop(self):
        while True:
            self._wake.wait(0.5)
            self._wake.clear()
            with self._lock:
                queues = [list(v) for v in self.wants.values()]
            order = [r for rank in range(max((len(q) for q in queues), default=0))
                     for q in queues if rank < len(q) for r in (q[rank],)]
            for r in order:
                if r.sha256 in self.hints or r.sha256 in self.skip:
                    continue
                try:
                    if not self._prefetch(r):
                        break  # no room now: try again when a shard is released
                except FetchError:
                    self.skip.add(r.sha256)  # the loader's own fetch tries again and reports it
                except Exception:  # noqa: BLE001 - prefetching is an optimization: the loader fetches itself
                    self.skip.add(r.sha256)

    def _prefetch(self, r: Remote) -> bool:
        """Fetch ``r`` ahead of the loader and hold it as prefetched; False when the quota or the cache's room says
        not now."""
        with self._lock:
            mine = sum(size for _, size in self.hints.values())
        if mine + r.size > self.limit / max(1, self.settings.processes) and self.hints:
            return False
        hint = self._lockfile(r.sha256, "hint").take(fcntl.LOCK_SH)
        fetch = self._lockfile(r.sha256, "fetch")
        try:
            if not self.path(r.sha256).is_file():
                if not fetch.try_take():
                    hint.close()
                    return True  # someone else is fetching it
                if not self.path(r.sha256).is_file() and not self._download(r, demand=False):
                    hint.close()
                    return False
            else:
                os.utime(self.path(r.sha256))
        except BaseException:
            hint.close()
            raise
        finally:
            fetch.close()
        with self._lock:
            wanted = any(r.sha256 == x.sha256 for rs in self.wants.values() for x in rs)
            if wanted and r.sha256 not in self.hints:
                self.hints[r.sha256] = (hint, r.size)
                return True
        hint.close()
        return True

    # -- space
    def _usage(self) -> tuple[int, list]:
        """(bytes the cache holds or has reserved, complete objects as (mtime, sha, size)); dead downloads removed.
        Called under the space lock."""
        used, objects = 0, []
        for p in self.objects.iterdir():
            name = p.name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if name.endswith(".tar"):
                used += st.st_size
                objects.append((st.st_mtime_ns, name[:-4], st.st_size))
            elif name.endswith(".part"):
                sha, size = name.split(".")[0], int(name.split(".")[1])
                probe = self._lockfile(sha, "fetch")
                try:
                    if probe.try_take():  # nobody downloads it: its downloader died
                        p.unlink(missing_ok=True)
                        continue
                finally:
                    probe.close()
                used += max(size, st.st_size)
        return used, objects

    def _reserve(self, r: Remote, demand: bool) -> Path | None:
        """Room for ``r``'s download, made by evicting (see the module docstring): its ``.part`` path, counted at
        its full size from now on; None when a prefetch finds no room without taking a needed shard's. A demand
        waits for room that pinned shards and other downloads hold."""
        part = self.objects / f"{r.sha256}.{r.size}.{os.getpid()}-{threading.get_ident()}.part"
        while True:
            space = self._space_lock()
            try:
                used, objects = self._usage()
                free_first = sorted(objects)  # oldest mtime first
                soft = []
                for _, sha, size in free_first:
                    if used + r.size <= self.limit:
                        break
                    kind = self._evict(sha, size, soft_ok=False)
                    if kind == "evicted":
                        used -= size
                    elif kind == "hinted":
                        soft.append((sha, size))
                if used + r.size > self.limit and demand:
                    for sha, size in sorted(soft, key=lambda x: -self._mtime(x[0])):  # the newest prefetch first
                        if used + r.size <= self.limit:
                            break
                        if self._evict(sha, size, soft_ok=True) == "evicted":
                            used -= size
                            COUNTERS.add("evicted_prefetched")
                if used + r.size <= self.limit:
                    part.touch()
                    self._note_peak(used + r.size)
                    return part
            finally:
                space.close()
            if not demand:
                return None
            time.sleep(0.05)  # pinned shards are read within moments, downloads end: room comes

    def _mtime(self, sha: str) -> int:
        try:
            return self.path(sha).stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    def _evict(self, sha: str, size: int, soft_ok: bool) -> str:
        """Remove object ``sha`` unless a process pins it ("pinned") or, without ``soft_ok``, holds it prefetched
        ("hinted"); "evicted" when removed."""
        pin = self._lockfile(sha, "pin")
        hint = self._lockfile(sha, "hint")
        try:
            if not pin.try_take():
                return "pinned"
            if not hint.try_take() and not soft_ok:
                return "hinted"
            self.path(sha).unlink(missing_ok=True)
            COUNTERS.add("evicted")
            return "evicted"
        finally:
            hint.close()
            pin.close()

    def _note_peak(self, used: int):
        """The cache's peak size, kept in usage.json (under the space lock)."""
        path = self.root / "usage.json"
        try:
            peak = json.loads(path.read_text()).get("peak_bytes", 0)
        except (OSError, ValueError):
            peak = 0
        if used > peak:
            tmp = path.with_name(f".usage.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"peak_bytes": used, "limit_bytes": self.limit}) + "\n")
            os.replace(tmp, path)

    # -- one download
    def _download(self, r: Remote, demand: bool) -> bool:
        """Download ``r`` into the cache (the caller holds its fetch lock): reserve room, fetch to the .part name,
        check size and digest against what the run started with, rename. Transient errors are retried (policy);
        False when a prefetch found no room."""
        part = self._reserve(r, demand)
        if part is None:
            return False
        fs, path = filesystem(r.url)
        try:
            def once():
                fs.invalidate_cache(path)  # the listing of the start is cached: ask the store again (a HEAD)
                info = fs.info(path)
                self._check_object(r, size=info.get("size"), etag=_etag(info))
                fs.get_file(path, str(part))
                received = part.stat().st_size
                COUNTERS.add("fetched_bytes", received)
                if received < r.size:  # the connection ended early without an error: never read, fetched again
                    raise Torn(f"the download ended after {received} of {r.size} bytes")
                return received

            call(r.url, once, self.settings.retry, "fetch")
            COUNTERS.add("fetches")
            self._check_object(r, size=part.stat().st_size, sha256=_sha256(part))
            os.replace(part, self.path(r.sha256))  # whole and checked: visible only now
            return True
        finally:
            part.unlink(missing_ok=True)

    def _check_object(self, r: Remote, size=None, etag=None, sha256=None):
        """A FetchError when the object is not the one the run started with: another size or ETag than the listing
        at the start, another sha256 than the manifest's. The manifest is read again to say which: a rewritten shard
        set (the data-change refusal of local shards) or one object replaced under its manifest."""
        what = None
        if size is not None and int(size) != r.size:
            what = f"its size is {int(size)} bytes, the shard set listed {r.size} at the start of the run"
        elif etag is not None and r.etag is not None and etag != r.etag:
            what = f"its ETag is {etag}, it was {r.etag} at the start of the run"
        elif sha256 is not None and sha256 != r.sha256:
            what = f"its sha256 {sha256[:16]}... differs from the manifest's {r.sha256[:16]}..."
        if what is None:
            return
        try:
            now = hashlib.sha256(read_bytes(join(r.set_url, MANIFEST), self.settings.retry)).hexdigest()
        except FetchError:
            now = None
        if now != r.set_sha256:
            raise FetchError(f"{r.set_url}: the shard set was rewritten while this run read it (its {MANIFEST} "
                             f"changed since the run started; {r.url}: {what}). The loader's position means "
                             "nothing in other data: restore the data, or resume with --allow-data-change to read "
                             "the new data from its beginning")
        raise FetchError(f"{r.url}: the object changed after its manifest was written ({what}); it is never read: "
                         "restore it, or rebuild and upload the shard set and resume with --allow-data-change to "
                         "read the new data from its beginning")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
