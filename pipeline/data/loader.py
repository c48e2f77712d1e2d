"""Resumable shard loader: deterministic per-rank sample streams with an exact, small position.

Sources. A loader reads one source (``data.train_shards``) or a mixture of named sources (``data.sources``), each a
shard directory with manifest.json or brace-notation tar paths (``data/x/x-{000000..000007}.tar``). Without a
manifest the per-shard sample and token counts are obtained by reading every tar once when the loader is built (one
full read + decode of the source, per process; cached for the process) -- use a manifest for large sources.

Streams. The shards of a source in epoch ``e`` are permuted with seed (key, e), key = (seed,) for the single-source
loader and (seed, crc32(name)) for a mixture source; with R ranks and W streams per rank (one per DataLoader worker,
or one without workers), stream w of rank r owns the shards at positions r*W + w, r*W + w + R*W, ... of that
permutation. Inside a shard the samples are permuted with seed (key, e, shard). With ``shuffle_buffer`` N the stream's
epoch is then cut into consecutive windows of N samples, each permuted with seed (key, e, rank, stream, window, N),
so samples of neighbouring shards mix as in a shuffle buffer; unlike a reservoir buffer it holds no state to
checkpoint (a position is still one count) and every window is a uniform permutation. Every source is an
infinite stream: after its shards it continues with its next epoch, independently of the other sources (sampling
with replacement across epochs). Every random choice for a sample (crop, masking) is seeded by (key, epoch, shard,
index), so a sample's content never depends on who read it or when.

Clusters. A source whose manifest has layout "clusters" (``data_prep uniref --clusters``) holds one UniRef50 cluster
per sample with all its UniRef90 members (pipeline/data/shards.py). Such a sample is a draw: the member is chosen
uniformly from the sample's own generator, seeded (key, epoch, shard, index) like every other choice and drawn
before the transform uses it, so the member depends on (seed, epoch, sample) only -- not on rank, worker count,
shuffle window or resume -- and a new epoch draws again (ESM-2's UniRef50/90 sampling; BioNeMo's ESM2 dataset seeds
one generator per (seed, index) and draws the member, the crop and the mask from it in that order). A one-member
cluster costs no draw. The transform sees the member's tokens as if they were the sample, and the sample id names
the member by its index in the cluster's meta ``members``: ``shard/key@epoch#member``. ``cluster_sampling`` True
requires cluster sources, False refuses them, None (default) follows each source's manifest.

Mixture. Draw k of stream (rank r, stream w) picks its source from u_k = U(seed, r, w, k) and the weights of the
optimizer step of the microbatch being filled (pipeline/data/mixture.py): stateless in k.

Batching. A microbatch holds ``micro_batch_size`` samples, or with a token budget as many as fit: a sample is added
unless (rows + 1) x max_len would exceed the budget, in which case it is held and opens the next microbatch. With
``pack`` each of the ``micro_batch_size`` rows concatenates whole documents as the transform framed them (both
families' transforms end a document with <eos>; ``pack_separator`` appends one more token after each) until the next
one would not fit in ``row_length``; a document longer than a row keeps its start. The row carries ``document_ids``
and ``position_ids`` (restarting at 0 per document) so attention and positions can keep documents apart.

Position. Per stream the state is a handful of integers: draws made, microbatches emitted, samples and tokens taken
from each source, and the source of a drawn-but-held sample (-1 if none). A source's sample stream resumes from its
count alone (the manifest counts jump over whole epochs and shards without opening them), and the held sample is
re-read from its source's position. Each Batch carries its stream's state after it; the loader in the main process
keeps the state of the last batch it handed out per stream plus N, the microbatches consumed. torch's DataLoader
takes batches from its workers in strict rotation, so batch j came from stream j mod W; a resumed loader rotates the
streams so that the next batch comes from stream N mod W. State size: W x (3 + 2 x sources) integers per rank.
"""
from __future__ import annotations

import copy
import io
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.data.mixture import MixtureSchedule, SourceChooser
from pipeline.data.shards import ShardError, check_offsets, load_manifest
from pipeline.objectives.masking import IGNORE_INDEX

# (tokens uint8 [n], rng) -> {"input_ids": int64 [L], "labels": int64 [L]}
SampleTransform = Callable[[np.ndarray, np.random.Generator], dict]
STATE_VERSION = 1


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64
    labels: torch.Tensor  # [B, L] int64, IGNORE_INDEX where unsupervised
    attention_mask: torch.Tensor  # [B, L] bool, True at real tokens
    sample_ids: list  # "[source:]shard/key@epoch" (clusters: "...@epoch#member"), one per sample (packed: several)
    sources: list | None = None  # source name per sample, aligned with sample_ids
    document_ids: torch.Tensor | None = None  # [B, L] int64 packed rows: document index in its row, -1 at padding
    position_ids: torch.Tensor | None = None  # [B, L] int64 packed rows: position within its document, 0 at padding
    stream: int = 0  # loader stream that produced it
    state: dict | None = None  # that stream's position after this batch (see the module docstring)

    @property
    def num_supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device):
        opt = [t.to(device) if t is not None else None for t in (self.document_ids, self.position_ids)]
        return Batch(self.input_ids.to(device), self.labels.to(device), self.attention_mask.to(device),
                     self.sample_ids, self.sources, *opt, self.stream, self.state)


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


def collate(samples: list[dict], pad_id: int) -> Batch:
    L = max(len(s["input_ids"]) for s in samples)
    ids = np.full((len(samples), L), pad_id, dtype=np.int64)
    labels = np.full((len(samples), L), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(samples), L), dtype=bool)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], True
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(mask),
                 [s["sample_id"] for s in samples], [s.get("source") for s in samples])


def pack_rows(rows: list[list[dict]], row_length: int, pad_id: int, separator: int | None = None) -> Batch:
    """rows: per row, whole documents ({"input_ids", "labels"} [n]) -> Batch [B, row_length], padded at the end.

    ``separator`` (e.g. <eos>) is appended after each document as input and label, so the model learns to end
    documents; ``document_ids`` (document index within the row, -1 at padding) lets an attention mask keep documents
    apart and ``position_ids`` restarts at 0 for each document.
    """
    B = len(rows)
    ids = np.full((B, row_length), pad_id, dtype=np.int64)
    labels = np.full((B, row_length), IGNORE_INDEX, dtype=np.int64)
    doc = np.full((B, row_length), -1, dtype=np.int64)
    pos = np.zeros((B, row_length), dtype=np.int64)
    sample_ids, sources = [], []
    extra = int(separator is not None)
    for r, docs in enumerate(rows):
        at = 0
        for d, s in enumerate(docs):
            n = len(s["input_ids"])
            if at + n + extra > row_length:
                raise ValueError(f"row {r}: documents need more than row_length {row_length} tokens")
            ids[r, at:at + n], labels[r, at:at + n] = s["input_ids"], s["labels"]
            if extra:
                ids[r, at + n] = labels[r, at + n] = separator
            doc[r, at:at + n + extra], pos[r, at:at + n + extra] = d, np.arange(n + extra)
            at += n + extra
            sample_ids.append(s["sample_id"])
            sources.append(s.get("source"))
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(doc >= 0), sample_ids, sources,
                 torch.from_numpy(doc), torch.from_numpy(pos))


# --------------------------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------------------------
# np.save's version-1.0 header for a C-ordered 1-D unsigned array, e.g. {'descr': '|u1', 'fortran_order': False,
# 'shape': (559,), } padded with spaces: what ShardWriter writes for every sample.
_NPY_1D_UNSIGNED = re.compile(rb"\{'descr': '([|<]u[1248])', 'fortran_order': False, 'shape': \((\d+),\), \} *\n")


def decode_tokens(raw: bytes) -> np.ndarray:
    """A ``.tokens.npy`` member's array. The 1-D unsigned arrays of our shards are decoded from a regex match of the
    header (np.load parses every header with ast.literal_eval: about 40% of the loader's time on short records);
    anything else, and any header the regex does not match exactly, goes through np.load with its checks."""
    if raw[:8] == b"\x93NUMPY\x01\x00" and len(raw) >= 10:
        end = 10 + int.from_bytes(raw[8:10], "little")
        m = _NPY_1D_UNSIGNED.fullmatch(raw, 10, end)
        if m is not None:
            dtype, n = np.dtype(m.group(1).decode()), int(m.group(2))
            if len(raw) - end != n * dtype.itemsize:
                raise ValueError(f"{len(raw) - end} data bytes for {n} x {dtype}")
            return np.frombuffer(raw, dtype, n, end)
    return np.load(io.BytesIO(raw), allow_pickle=False)


def read_tokens(path: Path, expected_samples: int | None = None) -> list[tuple[str, np.ndarray]]:
    """(key, tokens) of every sample of a shard, in file order: the loader's hot path.

    Plain tarfile iteration + np.load of the ``.tokens.npy`` members only (``meta.json`` is not needed to train and is
    skipped; shards.read_shard and tools/inspect_shards.py check it). About 3x faster than webdataset's
    tar_file_iterator + group_by_keys, which bench/data.py measures against the bare read floor. A truncated tar, a
    corrupt tokens member or a count differing from the manifest is a ShardError naming the file (and member).
    """
    out, last = [], None
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile() or not m.name.endswith(".tokens.npy"):
                    if m.name.endswith(".offsets.npy"):  # never hand out a cluster's members end to end
                        raise ShardError(f"{path}: member {m.name}: a UniRef50 cluster shard, read by cluster "
                                         "sampling only (its manifest must say layout 'clusters')")
                    continue
                out.append((m.name[:-len(".tokens.npy")], _unsigned_member(path, tf, m)))
                last = m.name
    except (tarfile.TarError, EOFError, OSError) as e:
        raise _truncated(path, last, e) from None
    return _checked_count(path, out, expected_samples)


def _truncated(path: Path, last: str | None, error: Exception) -> ShardError:
    after = f" after member {last}" if last else " at its first member"
    return ShardError(f"{path}: truncated or corrupt shard{after} ({error})")


def _checked_count(path: Path, samples: list, expected: int | None) -> list:
    if expected is not None and len(samples) != expected:
        raise ShardError(f"{path}: holds {len(samples)} samples but the manifest says {expected} (truncated shard?)")
    return samples


def _unsigned_member(path: Path, tf: tarfile.TarFile, m: tarfile.TarInfo) -> np.ndarray:
    try:
        array = decode_tokens(tf.extractfile(m).read())
        if array.ndim != 1 or array.dtype.kind != "u":
            raise ValueError(f"holds {array.dtype} {array.shape}, expected 1-D unsigned ids")
    except (ValueError, EOFError) as e:
        raise ShardError(f"{path}: corrupt member {m.name} ({e})") from None
    return array


def read_cluster_tokens(path: Path, expected_samples: int | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(key, members' tokens end to end, offsets) of every sample of a cluster shard, in file order.

    The cluster counterpart of read_tokens (same errors), plus: a sample without both members, or offsets that do not
    split its tokens into non-empty members, is a ShardError naming the member.
    """
    out, last = [], None
    key = tokens = offsets = None

    def finish():
        if tokens is None or offsets is None:
            raise ShardError(f"{path}: sample {key} lacks {key}.{'tokens' if tokens is None else 'offsets'}.npy "
                             "(a cluster shard holds both per sample)")
        why = check_offsets(offsets, len(tokens))
        if why is not None:
            raise ShardError(f"{path}: corrupt member {key}.offsets.npy ({why})")
        out.append((key, tokens, offsets))

    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                if m.name.endswith(".tokens.npy"):
                    k, kind = m.name[:-len(".tokens.npy")], "tokens"
                elif m.name.endswith(".offsets.npy"):
                    k, kind = m.name[:-len(".offsets.npy")], "offsets"
                else:
                    continue
                if k != key:  # the members of a sample are adjacent in a WebDataset tar
                    if key is not None:
                        finish()
                    key, tokens, offsets = k, None, None
                if kind == "tokens":
                    tokens = _unsigned_member(path, tf, m)
                else:
                    offsets = _unsigned_member(path, tf, m)
                last = m.name
            if key is not None:
                finish()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise _truncated(path, last, e) from None
    return _checked_count(path, out, expected_samples)


def draw_member(offsets: np.ndarray, rng) -> int:
    """Index of the member a cluster sample trains on: uniform over its n members from the sample's generator
    (BioNeMo: ``rng.choice(cluster)``); a one-member cluster draws nothing, so its generator stays unseeded."""
    n = len(offsets) - 1
    return int(rng.integers(n)) if n > 1 else 0


def _tar_layout(path: Path) -> str:
    """'clusters' when the first sample of a tar has an offsets member, else 'sequences' (brace URLs, no manifest)."""
    first = None
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                key = m.name.rsplit("/", 1)[-1].split(".", 1)[0]
                if first is not None and key != first:
                    break
                first = key
                if m.name.endswith(".offsets.npy"):
                    return "clusters"
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ShardError(f"{path}: truncated or corrupt shard at its first member ({e})") from None
    return "sequences"


@dataclass(frozen=True)
class ShardRef:
    path: Path  # file to open
    name: str  # shown in sample ids: the manifest's relative path, or the file name for brace URLs
    samples: int
    tokens: int
    layout: str = "sequences"  # the directory's layout: a sample is a sequence, or a cluster of members


def is_url_pattern(spec: str) -> bool:
    return "{" in spec or spec.endswith(".tar")


@lru_cache(maxsize=None)
def resolve_shards(spec: str) -> tuple[ShardRef, ...]:
    """A manifest directory, or brace-notation tar paths counted by reading each tar once (no manifest)."""
    if not is_url_pattern(spec):
        directory = Path(spec)
        manifest = load_manifest(directory)
        return tuple(ShardRef(directory / s.path, s.path, s.samples, s.tokens, manifest.layout)
                     for s in manifest.shards)
    from braceexpand import braceexpand

    paths = [Path(p) for p in braceexpand(spec)]
    refs = []
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{spec}: shard {p} does not exist")
        layout = _tar_layout(p)
        if refs and layout != refs[0].layout:
            raise ShardError(f"{spec}: {p.name} holds {layout} but {refs[0].name} holds {refs[0].layout}")
        # read_tokens refuses cluster members; read_cluster_tokens refuses samples without offsets
        records = read_cluster_tokens(p) if layout == "clusters" else read_tokens(p)
        refs.append(ShardRef(p, p.name, len(records), sum(len(r[1]) for r in records), layout))
    if not refs:
        raise ShardError(f"{spec}: the pattern names no shards")
    return tuple(refs)


@dataclass
class Source:
    """A named mixture source; ``transform`` overrides the loader's (e.g. another molecule's replacement pool)."""

    name: str
    shards: str | Path
    transform: SampleTransform | None = None


class SourceStream:
    """The infinite sample streams of one source for one rank (one stream per loader stream)."""

    def __init__(self, source: Source, key: tuple, *, rank: int, world_size: int, num_streams: int,
                 transform: SampleTransform, id_prefix: str, shuffle_buffer: int = 0,
                 cluster_sampling: bool | None = None):
        self.name, self.spec = source.name, str(source.shards)
        self.shuffle_buffer = shuffle_buffer
        self.shards = resolve_shards(self.spec)
        self.clusters = self.shards[0].layout == "clusters"
        if cluster_sampling is True and not self.clusters:
            raise ValueError(f"{self.spec}: cluster sampling (data.cluster_sampling) is on but these shards hold "
                             "sequences, not UniRef50 clusters; prepare them with `python -m data_prep uniref "
                             "--clusters TSV` or turn cluster sampling off")
        if cluster_sampling is False and self.clusters:
            raise ValueError(f"{self.spec}: holds UniRef50 clusters (manifest layout 'clusters'), which are only "
                             "read by drawing a member; cluster sampling (data.cluster_sampling) is off")
        self.key, self.rank, self.world_size, self.num_streams = key, rank, world_size, num_streams
        self.transform, self.id_prefix = source.transform or transform, id_prefix
        n_shards, needed = len(self.shards), world_size * num_streams
        if n_shards < needed:
            raise ShardError(f"{self.spec}: {n_shards} shards < {world_size} ranks x {num_streams} "
                             f"loader streams; reshard with a smaller --shard-size or use fewer workers")
        self.counts = np.array([s.samples for s in self.shards])

    def stream_shards(self, stream: int, epoch: int) -> np.ndarray:
        perm = np.random.default_rng([*self.key, epoch]).permutation(len(self.counts))
        return perm[self.rank * self.num_streams + stream::self.world_size * self.num_streams]

    def samples(self, stream: int, skip: int) -> Iterator[dict]:
        """Infinite sample stream of ``stream``, starting after its first ``skip`` samples."""
        epoch = 0
        while True:
            shards = self.stream_shards(stream, epoch)
            total = int(self.counts[shards].sum())
            if total == 0:
                raise ShardError(f"{self.spec}: stream {stream} of rank {self.rank} owns only empty shards")
            if skip >= total:  # jump a whole epoch by counts alone (each epoch deals this stream other shards)
                skip -= total
                epoch += 1
                continue
            records: dict[int, list] = {}  # shard index -> its (key, tokens), for the shards of the current window
            clusters, read = self.clusters, read_cluster_tokens if self.clusters else read_tokens
            for window in self._epoch_windows(stream, epoch, shards, skip):
                for sid in set(records) - {sid for sid, _ in window}:
                    del records[sid]
                for sid, j in window:
                    if sid not in records:
                        records[sid] = read(self.shards[sid].path, expected_samples=int(self.counts[sid]))
                    rng = LazyRng([*self.key, epoch, sid, j])
                    if clusters:  # the member first, from the sample's own generator: see "Clusters" above
                        key, tokens, offsets = records[sid][j]
                        m = draw_member(offsets, rng)
                        sample = self.transform(tokens[int(offsets[m]):int(offsets[m + 1])], rng)
                        sample["sample_id"] = f"{self.id_prefix}{self.shards[sid].name}/{key}@{epoch}#{m}"
                    else:
                        key, tokens = records[sid][j]
                        sample = self.transform(tokens, rng)
                        sample["sample_id"] = f"{self.id_prefix}{self.shards[sid].name}/{key}@{epoch}"
                    sample["source"] = self.name
                    yield sample
            skip = 0
            epoch += 1

    def _epoch_windows(self, stream: int, epoch: int, shards: np.ndarray, start: int) -> Iterator[list]:
        """The stream's epoch from position ``start`` on, as lists of (shard, index in shard).

        The epoch is the stream's shards in order, each in its own permutation. With ``shuffle_buffer`` N > 1 that
        sequence is cut into consecutive windows of N samples and each window is permuted again, so samples of the
        ~N / shard_size neighbouring shards mix; without it each shard is one window. Both permutations are seeded
        by their coordinates alone, so any position is reached from its count: a shuffle buffer with no state to
        checkpoint, and resume stays exact.
        """
        ends = np.cumsum(self.counts[shards])  # [shards] epoch position after each shard
        orders: dict[int, np.ndarray] = {}  # shard position -> in-shard permutation; a shard can span several windows

        def span(lo: int, hi: int) -> list[tuple[int, int]]:  # epoch positions [lo, hi)
            first, last = int(np.searchsorted(ends, lo, "right")), int(np.searchsorted(ends, hi - 1, "right"))
            for i in [i for i in orders if i < first]:  # windows only move forward
                del orders[i]
            out = []
            for i in range(first, last + 1):
                sid, n = int(shards[i]), int(self.counts[shards[i]])
                if i not in orders:
                    orders[i] = np.random.default_rng([*self.key, epoch, sid]).permutation(n)
                at = int(ends[i]) - n
                out += [(sid, int(j)) for j in orders[i][max(lo - at, 0):min(hi - at, n)]]
            return out

        total, N = int(ends[-1]), self.shuffle_buffer
        if N <= 1:
            for i in range(int(np.searchsorted(ends, start, "right")), len(shards)):
                yield span(max(start, int(ends[i] - self.counts[shards[i]])), int(ends[i]))
            return
        for w in range(start // N, -(-total // N)):
            window = span(w * N, min((w + 1) * N, total))
            perm = np.random.default_rng([*self.key, epoch, self.rank, stream, w, N]).permutation(len(window))
            yield [window[i] for i in perm[start - w * N if w == start // N else 0:]]


# --------------------------------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class StreamState:
    draws: int = 0  # samples placed into emitted batches (the mixture's k)
    batches: int = 0  # microbatches emitted by this stream
    pending: int = -1  # source of the drawn sample that did not fit the last batch; -1 = none
    taken: list = field(default_factory=list)  # [S] samples placed, per source
    tokens: list = field(default_factory=list)  # [S] tokens (len(input_ids)) placed, per source

    def as_dict(self) -> dict:
        return {"draws": self.draws, "batches": self.batches, "pending": self.pending, "taken": list(self.taken),
                "tokens": list(self.tokens)}


class ShardStream(IterableDataset):
    """Microbatch stream of one rank. ``shards``: a shard spec (one source) or a list of :class:`Source`.

    ``mixture`` (required for several sources) gives the weights per optimizer step; ``grad_accum_steps`` maps
    microbatches to steps. ``max_tokens`` turns on token-budget batching, ``pack`` packing into rows of
    ``row_length`` (optionally with ``pack_separator`` after each document), ``shuffle_buffer`` the cross-shard
    window shuffle. ``batches_consumed`` resumes a single-source, fixed-size loader from that count alone (what
    checkpoints before loader state_dicts stored); otherwise use :meth:`load_state_dict`. ``cluster_sampling``:
    None reads each source as its manifest's layout says (a cluster source draws one member per sample), True
    requires every source to be UniRef50 clusters, False refuses cluster sources (module docstring, "Clusters").
    """

    def __init__(self, shards: str | Path | list[Source], *, rank: int, world_size: int, num_workers: int,
                 micro_batch_size: int, seed: int, transform: SampleTransform, pad_id: int,
                 batches_consumed: int = 0, mixture: MixtureSchedule | None = None, grad_accum_steps: int = 1,
                 max_tokens: int | None = None, pack: bool = False, pack_separator: int | None = None,
                 row_length: int | None = None, shuffle_buffer: int = 0, cluster_sampling: bool | None = None):
        self.rank, self.world_size = rank, world_size
        self.num_streams, self.shuffle_buffer = max(1, num_workers), shuffle_buffer
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self.pad_id, self.grad_accum_steps = pad_id, grad_accum_steps
        self.max_tokens, self.pack, self.pack_separator, self.row_length = max_tokens, pack, pack_separator, row_length
        if pack and (row_length is None or row_length < 2):
            raise ValueError(f"data.context_length: packing needs a row length >= 2, got {row_length}")
        single = not isinstance(shards, list)
        sources = [Source(Path(str(shards)).name, shards)] if single else shards
        if not sources:
            raise ValueError("data.sources: empty")
        self.names = [s.name for s in sources]
        self.mixture = mixture or MixtureSchedule.constant(self.names)
        if self.mixture.names != self.names:
            raise ValueError(f"data.schedule: weights are for sources {self.mixture.names}, loader has {self.names}")
        # The single-source key (seed,) and unprefixed ids keep streams identical to loaders before mixtures.
        self.sources = [SourceStream(s, (seed,) if single else (seed, zlib.crc32(s.name.encode())), rank=rank,
                                     world_size=world_size, num_streams=self.num_streams, transform=transform,
                                     id_prefix="" if single else f"{s.name}:", shuffle_buffer=shuffle_buffer,
                                     cluster_sampling=cluster_sampling)
                        for s in sources]
        self.shard_dir = Path(str(shards)) if single else None
        self.counts = self.sources[0].counts
        self.state = self._fresh_state()
        if batches_consumed:
            self.load_state_dict({"batches_consumed": batches_consumed})

    # -- single-source helpers kept for callers that inspect one source's streams
    def stream_shards(self, stream: int, epoch: int) -> np.ndarray:
        return self.sources[0].stream_shards(stream, epoch)

    def samples(self, stream: int, skip: int) -> Iterator[dict]:
        return self.sources[0].samples(stream, skip)

    # -- state
    def _fresh_state(self) -> dict:
        S = len(self.sources)
        return {"version": STATE_VERSION, "rank": self.rank, "world_size": self.world_size, "sources": self.names,
                "shuffle_buffer": self.shuffle_buffer, "batches_consumed": 0,
                "streams": [StreamState(taken=[0] * S, tokens=[0] * S).as_dict() for _ in range(self.num_streams)]}

    def state_dict(self) -> dict:
        """The position iteration starts from (the loader's :meth:`StreamLoader.state_dict` is the live one)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict):
        """Accepts a full state, or ``{"batches_consumed": N}`` alone for a single-source fixed-size loader."""
        if set(state) == {"batches_consumed"}:
            state = self._legacy_state(int(state["batches_consumed"]))
        state = {"shuffle_buffer": 0, **state}  # states written before the shuffle buffer existed
        for key, ours in (("sources", self.names), ("world_size", self.world_size), ("rank", self.rank),
                          ("shuffle_buffer", self.shuffle_buffer)):
            if state.get(key) != ours:
                raise ValueError(f"loader state: {key} {state.get(key)!r} differs from this loader's {ours!r}")
        if len(state["streams"]) != self.num_streams:
            raise ValueError(f"loader state: {len(state['streams'])} streams, this loader has {self.num_streams} "
                             "(data.num_workers must not change on resume)")
        self.state = copy.deepcopy(state)

    def _legacy_state(self, n: int) -> dict:
        if len(self.sources) > 1 or self.max_tokens or self.pack:
            raise ValueError("loader state: a batches_consumed count alone only resumes a single-source loader with "
                             "fixed-size batches")
        st = self._fresh_state()
        W, mb = self.num_streams, self.micro_batch_size
        for w in range(W):
            b = max(0, -(-(n - w) // W))  # ceil((n - w) / W) batches taken from stream w
            st["streams"][w].update(draws=b * mb, batches=b, taken=[b * mb])
        st["batches_consumed"] = n
        return st

    # -- iteration
    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        physical = info.id if info is not None else 0
        W = self.num_streams
        stream = (physical + self.state["batches_consumed"]) % W
        return self._batches(stream, StreamState(**copy.deepcopy(self.state["streams"][stream])))

    def _batches(self, w: int, st: StreamState) -> Iterator[Batch]:
        chooser = SourceChooser(self.seed, self.rank, w)
        iters: dict[int, Iterator[dict]] = {}
        held: list = []  # [(source, sample)] at most one: drawn, not placed yet
        weights = None

        def draw() -> dict:
            if not held:
                s = st.pending if st.pending >= 0 else chooser.choose(st.draws, weights)
                if s not in iters:  # a source's stream resumes from the count of samples already placed
                    iters[s] = self.sources[s].samples(w, st.taken[s])
                held.append((s, next(iters[s])))
                st.pending = s
            return held[0][1]

        def place() -> dict:
            s, sample = held.pop()
            st.taken[s] += 1
            st.tokens[s] += len(sample["input_ids"])
            st.draws += 1
            st.pending = -1
            return sample

        while True:
            step = (st.batches * self.num_streams + w) // self.grad_accum_steps  # rank-local microbatch -> step
            weights = self.mixture.weights(step)
            if self.pack:
                extra = int(self.pack_separator is not None)
                body = self.row_length - extra  # most document tokens one row holds
                rows = []
                for _ in range(self.micro_batch_size):
                    row, used = [], 0
                    while True:
                        n = min(len(draw()["input_ids"]), body) + extra
                        if row and used + n > self.row_length:
                            break  # the held document opens the next row
                        sample = place()
                        if len(sample["input_ids"]) > body:  # longer than a row: keep its start
                            sample = {**sample, "input_ids": sample["input_ids"][:body],
                                      "labels": sample["labels"][:body]}
                        row.append(sample)
                        used += n
                    rows.append(row)
                batch = pack_rows(rows, self.row_length, self.pad_id, self.pack_separator)
            elif self.max_tokens:
                samples, longest = [], 0
                while True:
                    n = len(draw()["input_ids"])
                    if samples and (len(samples) + 1) * max(longest, n) > self.max_tokens:
                        break  # the held sample opens the next microbatch
                    samples.append(place())
                    longest = max(longest, n)
                batch = collate(samples, self.pad_id)
            else:
                samples = []
                for _ in range(self.micro_batch_size):
                    draw()
                    samples.append(place())
                batch = collate(samples, self.pad_id)
            st.batches += 1
            batch.stream, batch.state = w, st.as_dict()
            yield batch


class StreamLoader:
    """Iterator over a ShardStream's microbatches (through DataLoader workers if any) with a live position.

    ``state_dict()`` is the position after the last batch handed out; ``load_state_dict()`` (before iterating, or to
    restart) makes the next batch the one that followed it.
    """

    def __init__(self, dataset: ShardStream, num_workers: int):
        self.dataset, self.num_workers = dataset, num_workers
        self._it = None
        self._state = dataset.state_dict()

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._it is None:
            self.dataset.load_state_dict(self._state)
            if self.num_workers == 0:
                self._it = iter(self.dataset)
            else:
                self._it = iter(DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers,
                                           prefetch_factor=4, persistent_workers=False))
        batch = next(self._it)
        self._state["batches_consumed"] += 1
        self._state["streams"][batch.stream] = batch.state
        return batch

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict):
        self.dataset.load_state_dict(state)  # validates
        self._state = self.dataset.state_dict()
        self._it = None  # a running DataLoader is dropped; its workers exit with it

    def seen(self) -> dict[str, tuple[int, int]]:
        """Per source (samples, tokens) this rank has consumed, summed over streams."""
        out = {}
        for i, name in enumerate(self._state["sources"]):
            out[name] = (sum(s["taken"][i] for s in self._state["streams"]),
                         sum(s["tokens"][i] for s in self._state["streams"]))
        return out


def make_loader(dataset: ShardStream, num_workers: int) -> StreamLoader:
    return StreamLoader(dataset, num_workers)
