"""The sample streams the loader's microbatches are drawn from (pipeline/data/loader.py's docstring: "Sources",
"Streams", "Clusters"): a source's shards (:func:`resolve_shards`), how a run's data is dealt into streams and
to ranks (:class:`StreamLayout`, :func:`reshard_states` for another world size), and one source's infinite,
deterministic per-stream sample order (:class:`SourceStream`). Shards are read by pipeline/data/shard_reader.py."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from pipeline import commands
from pipeline.data.remote import CacheSettings, Remote, ShardCache, is_remote, open_set
from pipeline.data.shard_reader import (cluster_members, read_cluster_tokens, read_records, read_shard, read_tokens,
                                        shard_layout, shard_sequences)
from pipeline.data.shards import MANIFEST, ShardError, load_manifest

# Told the path of each shard a read opens, in a DataLoader worker (pipeline/data/loader.py sets it there), so that
# the rank can name the shard a worker was reading when the worker dies; None elsewhere.
reading: Callable[[Path], None] | None = None

# (tokens uint8 [n], rng) -> {"input_ids": int64 [L], "labels": int64 [L]}; a transform whose ``reads_meta`` is
# true (a supervised task's, pipeline/tasks) takes (tokens, rng, the record's meta dict): its labels live there
SampleTransform = Callable[[np.ndarray, np.random.Generator], dict]


def reads_meta(transform) -> bool:
    """Whether a sample transform takes each record's meta as a third argument (module comment above)."""
    return bool(getattr(transform, "reads_meta", False))


_MIX_TAG = 0x6D6978  # "mix": last seed entry of a group's interleaving, apart from every other seed key


class LazyRng:
    """A sample's np.random.Generator, seeded on first use.

    Seeding from a key list costs about 25 us, as much as the rest of the per-sample work; a transform that draws
    nothing for a sample (no crop needed, no corruption) should not pay it. Behaves as the Generator it wraps.
    """

    __slots__ = ("_key", "_rng")

    def __init__(self, key: list):
        self._key, self._rng = key, None

    def __getattr__(self, name):
        if self._rng is None:
            self._rng = np.random.default_rng(self._key)
        return getattr(self._rng, name)


def _stat(path: Path) -> tuple | None:
    """(inode, size, mtime) of ``path``, or None when it is missing: what changes when a file is replaced."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def draw_member(offsets: np.ndarray, rng) -> int:
    """Index of the member a cluster sample trains on: uniform over its n members from the sample's generator
    (BioNeMo: ``rng.choice(cluster)``); a one-member cluster draws nothing, so its generator stays unseeded."""
    n = len(offsets) - 1
    return int(rng.integers(n)) if n > 1 else 0


@dataclass(frozen=True)
class ShardRef:
    path: Path | None  # file to open; None for a remote shard (read from the cache)
    name: str  # shown in sample ids: the manifest's relative path, or the file name for brace URLs
    samples: int
    tokens: int
    layout: str = "sequences"  # the directory's layout: a sample is a sequence, or a cluster of members
    sha256: str | None = None  # the manifest's digest of the file; None for brace URLs (no manifest: not verified)
    remote: Remote | None = None  # a shard of a remote set (pipeline/data/remote.py): fetched into the cache


def is_url_pattern(spec: str) -> bool:
    return not is_remote(spec) and ("{" in spec or spec.endswith(".tar"))


@lru_cache(maxsize=None)
def resolve_shards(spec: str) -> tuple[ShardRef, ...]:
    """A manifest directory, a remote shard set's URL (its manifest read from the store, nothing fetched), or
    brace-notation tar paths counted by reading each tar once (no manifest)."""
    if is_remote(spec):
        if "{" in spec or spec.endswith(".tar"):
            raise ShardError(f"{spec}: a remote shard set is a URL prefix holding manifest.json (brace-notation tar "
                             "URLs have no sizes or digests to check a download against)")
        rs = open_set(spec)
        return tuple(ShardRef(None, s.path, s.samples, s.tokens, rs.manifest.layout, s.sha256,
                              Remote(f"{rs.url}/{s.path}", s.sha256, size, etag, rs.url, rs.manifest_sha256))
                     for s, size, etag in zip(rs.manifest.shards, rs.sizes, rs.etags))
    if not is_url_pattern(spec):
        directory = Path(spec)
        manifest = load_manifest(directory)
        return tuple(ShardRef(directory / s.path, s.path, s.samples, s.tokens, manifest.layout, s.sha256)
                     for s in manifest.shards)
    from braceexpand import braceexpand

    paths = [Path(p) for p in braceexpand(spec)]
    refs = []
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{spec}: shard {p} does not exist")
        layout = shard_layout(p)
        if refs and layout != refs[0].layout:
            raise ShardError(f"{spec}: {p.name} holds {layout} but {refs[0].name} holds {refs[0].layout}")
        # read_tokens refuses cluster members; read_cluster_tokens refuses samples without offsets
        records = read_cluster_tokens(p) if layout == "clusters" else read_tokens(p)
        refs.append(ShardRef(p, p.name, len(records), sum(len(r[1]) for r in records), layout))
    if not refs:
        raise ShardError(f"{spec}: the pattern names no shards")
    return tuple(refs)


def set_sequences(spec: str, limit: int | None = None, cache: CacheSettings | None = None) -> list[np.ndarray]:
    """Every sequence of a shard set in manifest order (a clusters layout: every member of every cluster), the first
    ``limit`` of them when given: shard_reader.shard_sequences, for a remote set too (its shards through ``cache``)."""
    if not is_remote(spec):
        return shard_sequences(spec, limit)
    if cache is None:
        raise ShardError(f"{spec}: a remote shard set is read through a shard cache (data.cache_dir)")
    out: list[np.ndarray] = []
    shard_cache = ShardCache.get(cache)
    for ref in resolve_shards(spec):
        if limit is not None and len(out) >= limit:
            break
        path = shard_cache.acquire(ref.remote)
        try:
            if ref.layout == "clusters":
                out += [t for _, tokens, offsets in read_cluster_tokens(path, ref.samples, sha256=ref.sha256)
                        for t in cluster_members(tokens, offsets)]
            else:
                out += [t for _, t in read_tokens(path, ref.samples, sha256=ref.sha256)]
        finally:
            shard_cache.release(ref.remote)
    return out if limit is None else out[:limit]


def set_records(spec: str, limit: int | None = None, cache: CacheSettings | None = None) -> list[tuple]:
    """:func:`set_sequences` with each record's meta: [(tokens, meta)] in manifest order (a supervised task's held-out
    set, whose labels are in the meta). Sequence layouts only."""
    out: list[tuple] = []
    if is_remote(spec) and cache is None:
        raise ShardError(f"{spec}: a remote shard set is read through a shard cache (data.cache_dir)")
    for ref in resolve_shards(spec):
        if limit is not None and len(out) >= limit:
            break
        if ref.layout != "sequences":
            raise ShardError(f"{spec}: holds {ref.layout}; a task's records are sequences with labels")
        if ref.remote is None:
            out += [(t, m) for _, t, m in read_shard(ref.path, ref.samples)]
            continue
        shard_cache = ShardCache.get(cache)
        path = shard_cache.acquire(ref.remote)
        try:
            out += [(t, m) for _, t, m in read_records(path, ref.samples, sha256=ref.sha256)]
        finally:
            shard_cache.release(ref.remote)
    return out if limit is None else out[:limit]


@dataclass(frozen=True)
class StreamLayout:
    """How a run's data is dealt into sample streams (module docstring, "Streams"), and this rank's share.

    ``streams`` S is fixed for the run; rank r of R reads global streams r*S/R .. (r+1)*S/R - 1. Stream g is seeded
    by the coordinates (g // seed_width, g % seed_width): seed_width is the streams per rank of the run's first
    layout, so a stream's samples are those of (rank, stream) of that layout whatever rank reads it later.
    """

    streams: int
    seed_width: int
    world_size: int
    rank: int

    def __post_init__(self):
        if self.streams < 1 or self.streams % self.world_size:
            raise ValueError(f"data.loader_streams: the data is dealt into {self.streams} loader streams, which do "
                             f"not divide among {self.world_size} ranks; run on a number of ranks that divides "
                             f"{self.streams}")
        if self.seed_width < 1 or self.streams % self.seed_width:
            raise ValueError(f"loader state: seed width {self.seed_width} does not divide {self.streams} streams")

    @classmethod
    def fresh(cls, world_size: int, rank: int, num_workers: int, streams: int | None = None) -> "StreamLayout":
        """A new run's layout: ``streams`` (data.loader_streams), default ranks x max(1, workers)."""
        streams = streams or world_size * max(1, num_workers)
        return cls(streams, max(1, streams // world_size), world_size, rank)

    @property
    def local(self) -> int:
        """Streams of this rank."""
        return self.streams // self.world_size

    def global_stream(self, local: int) -> int:
        return self.rank * self.local + local

    def seed_coords(self, stream: int) -> tuple[int, int]:
        return divmod(stream, self.seed_width)

    def describe(self) -> str:
        return f"{self.local} per rank x {self.world_size} ranks"

    def as_dict(self) -> dict:
        return {"streams": self.streams, "seed_width": self.seed_width}


def saved_layout(state: dict) -> dict:
    """A loader state's layout; states from before layouts were stored had ranks x streams-per-rank streams."""
    return state.get("layout") or {"streams": int(state["world_size"]) * len(state["streams"]),
                                   "seed_width": len(state["streams"])}


def reshard_states(states: list[dict], world_size: int, num_workers: int) -> list[dict]:
    """The loader states of a checkpoint written by ``len(states)`` ranks, one per rank of ``world_size`` ranks.

    Every stream keeps its position and its samples; only which rank reads it changes (contiguous blocks of
    S / world_size streams, in stream order), so the continued run neither repeats nor skips a sample. The ranks'
    microbatch counts are rescaled (N x R / R': the same optimizer step), and each new rank's rotation over its
    streams must continue where its streams stand: with every stream at the same count (no workers, or workers
    dividing train.grad_accum_steps) it always does. A ValueError says what to change otherwise.
    """
    R = len(states)
    states = sorted(states, key=lambda st: int(st["rank"]))
    if [int(st["rank"]) for st in states] != list(range(R)) or any(int(st["world_size"]) != R for st in states):
        raise ValueError(f"loader state: the checkpoint's {R} loader states are not one per rank")
    layout = saved_layout(states[0])
    S = int(layout["streams"])
    counts = {int(st["batches_consumed"]) for st in states}
    if len(counts) != 1:
        raise ValueError(f"loader state: ranks consumed different numbers of microbatches {sorted(counts)}")
    total = counts.pop() * R
    if S % world_size or total % world_size:
        raise ValueError(f"the checkpoint's data is dealt into {S} loader streams (data.loader_streams), which "
                         f"cannot be divided among {world_size} ranks; continue on a number of ranks that divides "
                         f"{S} (a run that should move between world sizes sets data.loader_streams to a multiple "
                         "of each)")
    streams = [st for state in states for st in state["streams"]]  # global stream order
    L, N = S // world_size, total // world_size
    if L % max(1, num_workers):
        raise ValueError(f"data.num_workers: {num_workers} workers cannot share the {L} loader streams of each of "
                         f"{world_size} ranks; use a number of workers that divides {L}")
    out = []
    for r in range(world_size):
        mine = streams[r * L:(r + 1) * L]
        for w, st in enumerate(mine):
            want = max(0, -(-(N - w) // L))  # batches stream w has given once its rank has taken N in rotation
            if int(st["batches"]) != want:
                raise ValueError(f"loader state: stream {r * L + w} has given {st['batches']} microbatches where the "
                                 f"rotation of {world_size} ranks expects {want}: the checkpoint's streams stand at "
                                 "unequal positions (data.num_workers not dividing train.grad_accum_steps) and "
                                 f"continue only on {R} ranks")
        out.append({**copy.deepcopy(states[0]), "rank": r, "world_size": world_size, "batches_consumed": N,
                    "layout": dict(layout), "streams": copy.deepcopy(mine)})
    return out


@dataclass
class Source:
    """A named mixture source; ``transform`` overrides the loader's (e.g. another molecule's replacement pool)."""

    name: str
    shards: str | Path
    transform: SampleTransform | None = None


class SourceStream:
    """The infinite sample streams of one source for one rank (one stream per loader stream).

    ``mix_shards`` K: a stream's epoch interleaves its shards K at a time (module docstring, "Streams");
    ``vocab_size``: every token id is checked against it as a shard is read; ``verify``: each shard's sha256 is
    checked against the manifest the first time this process reads it (shards of brace URLs have no manifest and
    are not verified).
    """

    def __init__(self, source: Source, key: tuple, *, layout: "StreamLayout",
                 transform: SampleTransform, id_prefix: str, shuffle_buffer: int = 0,
                 cluster_sampling: bool | None = None, mix_shards: int = 1, vocab_size: int | None = None,
                 verify: bool = True, cache: CacheSettings | None = None):
        self.name, self.spec = source.name, str(source.shards)
        self.cache = cache  # where a remote source's shards are fetched to (None: a local source)
        self.shuffle_buffer, self.mix_shards = shuffle_buffer, mix_shards
        self.vocab_size, self.verify = vocab_size, verify
        self._verified: set[int] = set()  # shards whose digest this process has checked
        self.shards = resolve_shards(self.spec)
        self.clusters = self.shards[0].layout == "clusters"
        if cluster_sampling is True and not self.clusters:
            raise ValueError(f"{self.spec}: cluster sampling (data.cluster_sampling) is on but these shards hold "
                             f"sequences, not UniRef50 clusters; prepare them with `{commands.python()} -m data_prep uniref "
                             "--clusters TSV` or turn cluster sampling off")
        if cluster_sampling is False and self.clusters:
            raise ValueError(f"{self.spec}: holds UniRef50 clusters (manifest layout 'clusters'), which are only "
                             "read by drawing a member; cluster sampling (data.cluster_sampling) is off")
        self.key, self.layout = key, layout
        self.transform, self.id_prefix = source.transform or transform, id_prefix
        self.with_meta = reads_meta(self.transform)  # a task's labels: each record's meta goes to the transform
        if self.with_meta and self.clusters:
            raise ShardError(f"{self.spec}: holds UniRef50 clusters; a supervised task reads sequence records")
        if len(self.shards) < layout.streams:
            raise ShardError(f"{self.spec}: {len(self.shards)} shards < {layout.streams} loader streams "
                             f"({layout.describe()}); reshard with a smaller --shard-size or use fewer streams")
        self.counts = np.array([s.samples for s in self.shards])
        self.remote = self.shards[0].remote is not None
        if self.remote and cache is None:
            raise ValueError(f"{self.spec}: a remote shard set is read through a shard cache (data.cache_dir)")
        # a rebuild of the directory replaces its manifest (a new inode); a remote set's is checked at each fetch
        self._manifest = None if self.remote else _stat(Path(self.spec) / MANIFEST)

    def stream_shards(self, stream: int, epoch: int) -> np.ndarray:
        """The shards global stream ``stream`` (of layout.streams) reads in ``epoch``."""
        perm = np.random.default_rng([*self.key, epoch]).permutation(len(self.counts))
        return perm[stream::self.layout.streams]

    def read(self, sid: int) -> list:
        """Shard ``sid``'s records, checked (counts, member names, token ids; the digest on its first read here)."""
        ref = self.shards[sid]
        sha256 = ref.sha256 if self.verify and sid not in self._verified else None
        read = read_cluster_tokens if self.clusters else read_records if self.with_meta else read_tokens
        if ref.remote is not None:  # fetched whole into the cache (size and digest checked), read as a local file
            cache = ShardCache.get(self.cache)
            path = cache.acquire(ref.remote)
            try:
                records = read(path, expected_samples=int(self.counts[sid]), sha256=sha256,
                               vocab_size=self.vocab_size)
            finally:
                cache.release(ref.remote)
            if sha256 is not None:
                self._verified.add(sid)
            return records
        self._check_unchanged(None)
        if reading is not None:
            reading(ref.path)
        try:
            records = read(ref.path, expected_samples=int(self.counts[sid]), sha256=sha256, vocab_size=self.vocab_size)
        except (ShardError, OSError) as e:  # a shard rewritten under the run reads as damaged: say what happened
            self._check_unchanged(e)
            raise
        if sha256 is not None:
            self._verified.add(sid)
        return records

    def _check_unchanged(self, error: Exception | None):
        """A ShardError when the shard directory was rebuilt (data_prep --overwrite) since this run resolved it:
        its shards are no longer those the loader's position counts in (``error``: what reading one gave)."""
        if self._manifest is not None and _stat(Path(self.spec) / MANIFEST) != self._manifest:
            seen = f"; reading a shard gave: {str(error).splitlines()[0]}" if error is not None else ""
            raise ShardError(f"{self.spec}: the shard directory was rewritten while this run read it (its "
                             f"{MANIFEST} changed since the run started{seen}). The loader's position means nothing "
                             "in other data: restore the data, or resume with --allow-data-change to read the new "
                             "data from its beginning")

    def samples(self, stream: int, skip: int) -> Iterator[dict]:
        """Infinite sample stream of global stream ``stream``, starting after its first ``skip`` samples."""
        epoch = 0
        while True:
            shards = self.stream_shards(stream, epoch)
            total = int(self.counts[shards].sum())
            if total == 0:
                raise ShardError(f"{self.spec}: loader stream {stream} of {self.layout.streams} owns only empty "
                                 "shards")
            if skip >= total:  # jump a whole epoch by counts alone (each epoch deals this stream other shards)
                skip -= total
                epoch += 1
                continue
            records: dict[int, list] = {}  # shard index -> its records, for the shards still to be read from
            clusters = self.clusters
            position = {int(sid): i for i, sid in enumerate(shards)}
            for window, live in self._epoch_windows(stream, epoch, shards, skip):
                for sid in set(records) - live:
                    del records[sid]
                for sid, j in window:
                    if sid not in records:
                        if self.remote:  # the shards this stream reads after this one, for the prefetch thread
                            self._want(stream, epoch, shards, position[sid], records)
                        records[sid] = self.read(sid)
                    rng = LazyRng([*self.key, epoch, sid, j])
                    if clusters:  # the member first, from the sample's own generator: see "Clusters" above
                        key, tokens, offsets = records[sid][j]
                        m = draw_member(offsets, rng)
                        sample = self.transform(tokens[int(offsets[m]):int(offsets[m + 1])], rng)
                        sample["sample_id"] = f"{self.id_prefix}{self.shards[sid].name}/{key}@{epoch}#{m}"
                    else:
                        key, tokens = records[sid][j][:2]
                        sample = (self.transform(tokens, rng, records[sid][j][2]) if self.with_meta  # a task's
                                  else self.transform(tokens, rng))  # labels: (key, tokens, meta) records
                        sample["sample_id"] = f"{self.id_prefix}{self.shards[sid].name}/{key}@{epoch}"
                    sample["source"] = self.name
                    yield sample
            skip = 0
            epoch += 1

    def _want(self, stream: int, epoch: int, shards: np.ndarray, at: int, records: dict):
        """Tell the cache which shards stream ``stream`` reads after the one at position ``at`` of its epoch (into
        the next epoch when this one ends): the prefetch thread fetches the first data.prefetch_shards of them."""
        ahead = self.cache.prefetch
        nxt = [int(x) for x in shards[at + 1:] if int(x) not in records][:ahead]
        e = epoch
        while len(nxt) < ahead and e < epoch + 2:  # a stream may own few shards: look into the next epochs
            e += 1
            nxt += [int(x) for x in self.stream_shards(stream, e)][:ahead - len(nxt)]
        ShardCache.get(self.cache).want((self.name, stream), [self.shards[i].remote for i in nxt])

    def _epoch_windows(self, stream: int, epoch: int, shards: np.ndarray, start: int) -> Iterator[tuple[list, set]]:
        """The stream's epoch from position ``start`` on, as (list of (shard, index in shard), live shards).

        The stream's n shards, in order, form ceil(n / K) groups of consecutive shards (K = ``mix_shards``; group
        sizes differ by at most one, and with K > 1 no shard is left alone: K = 2 with n odd makes one group of 3); a
        group's samples are a uniformly random interleaving of its shards, each shard in its own permutation (K = 1:
        the shards one after the other). With
        ``shuffle_buffer`` N > 1 that sequence is cut into consecutive windows of N samples and each window is
        permuted again, so samples of neighbouring groups mix too; without it each group is one window. Every
        permutation is seeded by its coordinates alone, so any position is reached from its count: a shuffle with no
        state to checkpoint, and resume stays exact. ``live`` holds the shards of the groups the window touches:
        the caller keeps their records (at most 2K shards read at a time) and drops the others.
        """
        K, n = max(1, self.mix_shards), len(shards)
        coords = self.layout.seed_coords(stream)
        # ceil(n / K) groups of sizes differing by at most one; with K = 2 and n odd one group takes 3, never 1
        G = n if K == 1 else min(-(-n // K), max(1, n // 2))
        bounds = [g * n // G for g in range(G + 1)]  # group g: shard positions bounds[g] .. bounds[g + 1] - 1
        members = [shards[bounds[g]:bounds[g + 1]] for g in range(G)]
        ends = np.cumsum([int(self.counts[m].sum()) for m in members])  # epoch position after each group
        orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # group -> (shard, index) per group position

        def group(g: int) -> tuple[np.ndarray, np.ndarray]:
            sids = members[g]
            n = self.counts[sids]
            # each shard's permutation, end to end: entry k is the k-th sample of the group in shard order
            inner = np.concatenate([np.random.default_rng([*self.key, epoch, int(sid)]).permutation(int(c))
                                    for sid, c in zip(sids, n)])
            label = np.repeat(np.arange(len(sids)), n)  # which of the group's shards each position reads
            if len(sids) > 1:
                label = np.random.default_rng([*self.key, epoch, *coords, g, K, _MIX_TAG]).permutation(label)
            # the i-th position reading shard s takes that shard's i-th sample: a stable sort by label lists the
            # positions in exactly the order of ``inner``
            at = np.empty(len(label), dtype=np.int64)
            at[np.argsort(label, kind="stable")] = np.arange(len(label))
            return sids[label], inner[at]

        def span(lo: int, hi: int) -> tuple[list[tuple[int, int]], set]:  # epoch positions [lo, hi)
            first, last = int(np.searchsorted(ends, lo, "right")), int(np.searchsorted(ends, hi - 1, "right"))
            for g in [g for g in orders if g < first]:  # windows only move forward
                del orders[g]
            out, live = [], set()
            for g in range(first, last + 1):
                if g not in orders:
                    orders[g] = group(g)
                sids, js = orders[g]
                at = int(ends[g]) - len(js)
                a, b = max(lo - at, 0), min(hi - at, len(js))
                out += zip(sids[a:b].tolist(), js[a:b].tolist())
                live.update(int(sid) for sid in members[g])
            return out, live

        total, N = int(ends[-1]), self.shuffle_buffer
        if N <= 1:
            for g in range(int(np.searchsorted(ends, start, "right")), G):
                yield span(max(start, int(ends[g - 1]) if g else 0), int(ends[g]))
            return
        for w in range(start // N, -(-total // N)):
            window, live = span(w * N, min((w + 1) * N, total))
            perm = np.random.default_rng([*self.key, epoch, *coords, w, N]).permutation(len(window))
            yield [window[i] for i in perm[start - w * N if w == start // N else 0:]], live
