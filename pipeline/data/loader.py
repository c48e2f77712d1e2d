"""Resumable shard loader: deterministic per-rank sample streams with an exact, small position.

Sources. A loader reads one source (``data.train_shards``) or a mixture of named sources (``data.sources``), each a
shard directory with manifest.json or brace-notation tar paths (``data/x/x-{000000..000007}.tar``). Without a
manifest the per-shard sample and token counts are obtained by reading every tar once when the loader is built (one
full read + decode of the source, per process; cached for the process) -- use a manifest for large sources.

Streams. The data is dealt into S sample streams fixed for the whole run (StreamLayout; ``data.loader_streams``,
default R ranks x max(1, workers) at the run's start, kept in the loader state). Rank r reads the contiguous block
of streams r*S/R .. (r+1)*S/R - 1, shared among its DataLoader workers (or read in turn by the rank itself), so a
checkpoint continues on any number of ranks dividing S with every stream where it stood (reshard_states): each
step then reads the samples of the uninterrupted run, with no sample repeated or skipped. The shards of a source in
epoch ``e`` are permuted with seed (key, e), key = (seed,) for the single-source loader and (seed, crc32(name)) for
a mixture source; stream g owns the shards at positions g, g + S, ... of that permutation. Every seed below that
names a "rank, stream" uses the stream's coordinates (g // w0, g % w0), w0 the streams per rank of the run's first
layout, so a stream's order does not depend on who reads it. Inside a shard the samples are permuted with seed (key, e, shard). Shard mixing (``mix_shards`` K,
default 4): the stream's n shards of the epoch, in that order, form ceil(n / K) groups of consecutive shards (sizes
differing by at most one; no group of one when K > 1), and a group's samples are a uniformly random interleaving of
its shards' permuted samples, seeded (key, e, rank, stream, group, K, tag), so a corpus written one domain per shard
still gives batches that mix domains; a stream holds one group's shards (about K) in memory. K = 1 reads the shards
one after the other (the order before mixing existed); a stream that owns a single shard in an epoch cannot mix
(more shards: ``data_prep --shard-size``). With ``shuffle_buffer`` N the stream's epoch is then cut into consecutive
windows of N samples, each permuted with seed (key, e, rank, stream, window, N), so samples of neighbouring groups
mix as in a shuffle buffer; unlike a reservoir buffer neither holds state to checkpoint (a position is still one
count) and every group and window is a uniform permutation. The order of a stream is thus a function of (seed,
rank, stream, K, N) and the manifest counts alone; resuming needs the same K and N (both are in the state and
checked). Every source is an infinite stream: after its shards it continues with its next epoch, independently of
the other sources (sampling with replacement across epochs). Every random choice for a sample (crop, masking) is
seeded by (key, epoch, shard, index), so a sample's content never depends on who read it or when.

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

Length windows. With ``length_window`` M (not with ``pack``: packed rows are full already) a stream's draws are cut
into consecutive windows of M (window i: draws i*M .. i*M + M - 1, each picking its source as above). The window's M
samples, after the transform (so crops count), are sorted by len(input_ids), stably, and cut in that order into
microbatches by the rules above (token budget, else groups of ``micro_batch_size``; M must then be a multiple of it);
the window's batches are then emitted in a random order seeded (seed, rank, stream, i, M, tag), so a step does not
walk from short to long sequences. A microbatch thus holds sequences of about one length and padding nearly vanishes
(bench/padding.py), while every sample of a window is still emitted exactly once, whole, with the content it has
without windows. Mixture weights: every draw of a window uses the weights of the optimizer step of the window's
first microbatch (the samples are drawn before any of the window's batches exists), so a schedule moves in steps of
one window; ``seen()`` still counts exactly the samples and tokens of the emitted batches. Memory: M transformed
samples per stream.

Position. Per stream the state is a handful of integers: draws made, microbatches emitted, samples and tokens taken
from each source, and the source of a drawn-but-held sample (-1 if none). A source's sample stream resumes from its
count alone (the manifest counts jump over whole epochs and shards without opening them), and the held sample is
re-read from its source's position. With length windows, ``draws`` is the position of the current window's start,
``window_taken`` the samples drawn from each source before it and ``window_batches`` how many of its batches were
emitted: a resumed stream draws the window again from those counts (a sample is a pure function of its position),
sorts and permutes it the same way and skips the emitted batches; once a window's last batch is out, the state names
the next window's start (without windows ``window_taken`` equals ``taken`` and ``window_batches`` is 0). Each Batch
carries its stream's state after it and its origin (global stream, index in it); the loader in the main process
keeps the state of the last batch it handed out per stream plus N, the microbatches consumed. A rank takes its L
streams in rotation (batch j from stream j mod L); torch's DataLoader takes batches from its P workers in strict
rotation, so worker p serves streams p, p + P, ... (P divides L); a resumed loader rotates the streams so that the
next batch comes from stream N mod L. State size: L x (4 + 3 x sources) integers per rank. States of version 1 (before length windows) load as
length_window 0; ``length_window`` must not change on resume.

Checks while reading. Every shard passes the tar-member check all shard readers share (shards.member_problem: no
``..`` or absolute names, no links), its sample count is the manifest's, with ``vocab_size`` every token id is below
it (one max per sample), and with ``verify`` (default) its sha256 is compared with the manifest the first time a
process reads it, hashed from the same in-memory read that decodes it (brace URLs have no manifest: no digest). Each
failure is one ShardError line naming the shard file (and the member or sample); raised in a DataLoader worker, it
reaches the main process as the same one-line error (WorkerError), not a worker traceback. Whether a source's
tokenizer fits the model at all is checked before training by pipeline/data/compat.py.
"""
from __future__ import annotations

import copy
import hashlib
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

from pipeline.data.length_window import length_window_problem
from pipeline.data.mixture import MixtureSchedule, SourceChooser
from pipeline.data.shards import ShardError, check_offsets, end_problem, load_manifest, member_problem
from pipeline.data.tokenizer import IGNORE_INDEX

# (tokens uint8 [n], rng) -> {"input_ids": int64 [L], "labels": int64 [L]}
SampleTransform = Callable[[np.ndarray, np.random.Generator], dict]
STATE_VERSION = 2  # 2: length windows (window_taken, window_batches per stream; length_window)
_MIX_TAG = 0x6D6978  # "mix": last seed entry of a group's interleaving, apart from every other seed key
_LEN_TAG = 0x6C656E  # "len": last seed entry of a length window's batch order


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64
    labels: torch.Tensor  # [B, L] int64, IGNORE_INDEX where unsupervised
    attention_mask: torch.Tensor  # [B, L] bool, True at real tokens
    sample_ids: list  # "[source:]shard/key@epoch" (clusters: "...@epoch#member"), one per sample (packed: several)
    sources: list | None = None  # source name per sample, aligned with sample_ids
    document_ids: torch.Tensor | None = None  # [B, L] int64 packed rows: document index in its row, -1 at padding
    position_ids: torch.Tensor | None = None  # [B, L] int64 packed rows: position within its document, 0 at padding
    stream: int = 0  # this rank's loader stream that produced it
    state: dict | None = None  # that stream's position after this batch (see the module docstring)
    # (global stream, its microbatch index): who made it, whatever rank reads the stream; seeds per-batch draws
    origin: tuple[int, int] = (0, 0)

    @property
    def num_supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device):
        opt = [t.to(device) if t is not None else None for t in (self.document_ids, self.position_ids)]
        return Batch(self.input_ids.to(device), self.labels.to(device), self.attention_mask.to(device),
                     self.sample_ids, self.sources, *opt, self.stream, self.state, self.origin)


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


def decode_tokens(raw: bytes | memoryview) -> np.ndarray:
    """A ``.tokens.npy`` member's array. The 1-D unsigned arrays of our shards are decoded (as views of ``raw``) from a
    regex match of the header (np.load parses every header with ast.literal_eval: about 40% of the loader's time on
    short records); anything else, and any header the regex does not match exactly, goes through np.load with its
    checks."""
    if len(raw) >= 10 and raw[:8] == b"\x93NUMPY\x01\x00":
        end = 10 + int.from_bytes(raw[8:10], "little")
        m = _NPY_1D_UNSIGNED.fullmatch(bytes(raw[10:end]))
        if m is not None:
            dtype, n = np.dtype(m.group(1).decode()), int(m.group(2))
            if len(raw) - end != n * dtype.itemsize:
                raise ValueError(f"{len(raw) - end} data bytes for {n} x {dtype}")
            return np.frombuffer(raw, dtype, n, end)
    return np.load(io.BytesIO(raw), allow_pickle=False)


class _ShardFile:
    """One shard read whole, in one call: the loader's one way into a tar.

    :meth:`members` yields (member, its bytes) of every regular member in file order, the bytes being views of the
    buffer (the arrays decoded from them share it: no copy per member). Every member passes the check all shard
    readers share (shards.member_problem: no ``..`` or absolute names, no links), and the archive must end in zero
    blocks or at the end of the file (shards.end_problem: tarfile silently stops at a truncated or unreadable header
    past the first, which would pass for a shorter shard). :meth:`verify` then compares the buffer's sha256 with
    the manifest's: one pass of hashlib over bytes already in memory, not a second read. Damage is one ShardError
    naming the file.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = path.read_bytes()
        except OSError as e:
            raise ShardError(f"{path}: cannot be read ({e})") from None

    def members(self) -> Iterator[tuple[tarfile.TarInfo, memoryview]]:
        path, data, last = self.path, self.data, None
        view = memoryview(data)
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
                for m in tf:
                    why = member_problem(m)
                    if why is not None:
                        raise ShardError(f"{path}: {why}")
                    if not m.isreg():
                        continue
                    if m.offset_data + m.size > len(data):
                        raise tarfile.ReadError("unexpected end of data")
                    yield m, view[m.offset_data:m.offset_data + m.size]
                    last = m.name
                why = end_problem(view[tf.offset:], tf.offset)
                if why is not None:
                    raise tarfile.ReadError(why)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise _truncated(path, last, e) from None

    def verify(self, sha256: str | None):
        if sha256 is not None:
            digest = hashlib.sha256(self.data).hexdigest()
            if digest != sha256:
                raise ShardError(f"{self.path}: sha256 {digest[:16]}... differs from the manifest's {sha256[:16]}... "
                                 "(the shard changed after data_prep wrote it; rebuild it, or set data.verify=false)")


def read_tokens(path: Path, expected_samples: int | None = None, *, sha256: str | None = None,
                vocab_size: int | None = None) -> list[tuple[str, np.ndarray]]:
    """(key, tokens) of every sample of a shard, in file order: the loader's hot path.

    Plain tar iteration + decode of the ``.tokens.npy`` members only (``meta.json`` is not needed to train and is
    skipped; shards.read_shard and tools/inspect_shards.py check it); a block (shards.py: ``keys.txt`` and
    ``bounds.npy`` before its ``tokens.npy``) yields its samples as views of its one tokens array. About 3x faster
    than webdataset's tar_file_iterator + group_by_keys, which bench/data.py measures against the bare read floor. A
    truncated tar, a corrupt tokens, bounds or keys member, a member that is a link or escapes the shard, a token id
    >= ``vocab_size``, a count differing from the manifest or a digest differing from ``sha256`` (see _ShardFile;
    checked in that order) is a ShardError naming the file (and member or sample).
    """
    out, shard, blocks = [], _ShardFile(path), {}
    for m, raw in shard.members():
        name = m.name
        if not name.endswith(".tokens.npy"):
            if name.endswith(".offsets.npy"):  # never hand out a cluster's members end to end
                raise ShardError(f"{path}: member {name}: a UniRef50 cluster shard, read by cluster "
                                 "sampling only (its manifest must say layout 'clusters')")
            _block_part(blocks, name, raw)
            continue
        key = name[:-len(".tokens.npy")]
        tokens = _unsigned_member(path, m, raw)
        if key in blocks:
            keys, bounds, _, _ = _block(path, key, blocks.pop(key), tokens, False)
            _block_token_ids(path, keys, bounds, tokens, vocab_size)
            b = bounds.tolist()
            out += [(k, tokens[b[i]:b[i + 1]]) for i, k in enumerate(keys)]
        else:
            out.append((key, _token_ids(path, key, tokens, vocab_size)))
    _no_partial_block(path, blocks)
    _checked_count(path, out, expected_samples)
    shard.verify(sha256)
    return out


_BLOCK_PARTS = (".keys.txt", ".bounds.npy")


def _block_part(blocks: dict, name: str, raw) -> None:
    """Keep a block's keys / bounds member until its tokens member arrives (members of a block are adjacent)."""
    for ext in _BLOCK_PARTS:
        if name.endswith(ext):
            blocks.setdefault(name[:-len(ext)], {})[ext] = raw


def _block(path: Path, key: str, parts: dict, tokens: np.ndarray, clusters: bool):
    """(keys, bounds [n + 1], index of each bound among the offsets, offsets [members + 1]; both None without
    clusters) of block ``key``."""
    from pipeline.data.shards import block_index

    missing = [f"{key}{ext}" for ext in _BLOCK_PARTS + ((".offsets.npy",) if clusters else ()) if ext not in parts]
    if missing:
        raise ShardError(f"{path}: block {key} lacks {', '.join(missing)} before its tokens member")
    bounds = _unsigned_member(path, _Named(f"{key}.bounds.npy"), parts[".bounds.npy"])
    offsets = _unsigned_member(path, _Named(f"{key}.offsets.npy"), parts[".offsets.npy"]) if clusters else None
    try:
        keys, idx = block_index(parts[".keys.txt"], bounds, len(tokens), offsets)
    except ValueError as e:
        raise ShardError(f"{path}: corrupt member {key}.{e}") from None
    return keys, bounds, idx, offsets


@dataclass(frozen=True)
class _Named:  # the member name _unsigned_member reports
    name: str


def _no_partial_block(path: Path, blocks: dict) -> None:
    if blocks:
        key = next(iter(blocks))
        raise ShardError(f"{path}: block {key} has no {key}.tokens.npy member")


def _block_token_ids(path: Path, keys: list, bounds: np.ndarray, tokens: np.ndarray, vocab_size: int | None):
    """_token_ids over a whole block: one max; past the vocabulary, the sample holding the id is named."""
    if vocab_size is not None and tokens.size and np.iinfo(tokens.dtype).max >= vocab_size \
            and int(tokens.max()) >= vocab_size:
        i = int(np.searchsorted(bounds, int(np.argmax(tokens)), side="right")) - 1
        _token_ids(path, keys[i], tokens[int(bounds[i]):int(bounds[i + 1])], vocab_size)


def _truncated(path: Path, last: str | None, error: Exception) -> ShardError:
    after = f" after member {last}" if last else " at its first member"
    return ShardError(f"{path}: truncated or corrupt shard{after} ({error})")


def _checked_count(path: Path, samples: list, expected: int | None) -> list:
    if expected is not None and len(samples) != expected:
        raise ShardError(f"{path}: holds {len(samples)} samples but the manifest says {expected} (truncated shard?)")
    return samples


def _unsigned_member(path: Path, m: tarfile.TarInfo, raw) -> np.ndarray:
    try:
        array = decode_tokens(raw)
        if array.ndim != 1 or array.dtype.kind != "u":
            raise ValueError(f"holds {array.dtype} {array.shape}, expected 1-D unsigned ids")
    except (ValueError, EOFError) as e:
        raise ShardError(f"{path}: corrupt member {m.name} ({e})") from None
    return array


def _token_ids(path: Path, key: str, tokens: np.ndarray, vocab_size: int | None) -> np.ndarray:
    """``tokens`` once every id is below ``vocab_size`` (None: unchecked). Ids are unsigned, so one max suffices, and
    a dtype that cannot hold an id >= vocab_size needs none: an out-of-range id would otherwise surface as an index
    error inside the embedding, far from the shard."""
    if vocab_size is not None and tokens.size and np.iinfo(tokens.dtype).max >= vocab_size:
        top = int(tokens.max())
        if top >= vocab_size:
            raise ShardError(f"{path}: sample {key}: token id {top} at position {int(np.argmax(tokens)) + 1} is "
                             f"outside the model's vocabulary 0..{vocab_size - 1} (model.vocab_size {vocab_size}; "
                             "shards from another tokenizer?)")
    return tokens


def read_cluster_tokens(path: Path, expected_samples: int | None = None, *, sha256: str | None = None,
                        vocab_size: int | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(key, members' tokens end to end, offsets) of every sample of a cluster shard, in file order.

    The cluster counterpart of read_tokens (same errors and checks), plus: a sample without both members, or offsets
    that do not split its tokens into non-empty members, is a ShardError naming the member. A block's samples are
    views of its tokens, their offsets relative to each sample.
    """
    out, shard, blocks = [], _ShardFile(path), {}
    key = tokens = offsets = None

    def finish():
        if tokens is None or offsets is None:
            raise ShardError(f"{path}: sample {key} lacks {key}.{'tokens' if tokens is None else 'offsets'}.npy "
                             "(a cluster shard holds both per sample)")
        why = check_offsets(offsets, len(tokens))
        if why is not None:
            raise ShardError(f"{path}: corrupt member {key}.offsets.npy ({why})")
        out.append((key, _token_ids(path, key, tokens, vocab_size), offsets))

    for m, raw in shard.members():
        name = m.name
        if name.endswith(".tokens.npy"):
            k, kind = name[:-len(".tokens.npy")], "tokens"
        elif name.endswith(".offsets.npy"):
            k, kind = name[:-len(".offsets.npy")], "offsets"
        else:
            _block_part(blocks, name, raw)
            continue
        if k in blocks:  # a block: its offsets are kept until its tokens arrive
            if kind == "offsets":
                blocks[k][".offsets.npy"] = raw
                continue
            if key is not None:  # a per-sample cluster before the block: file order
                finish()
                key = tokens = offsets = None
            block_tokens = _unsigned_member(path, m, raw)
            keys, bounds, idx, block_offsets = _block(path, k, blocks.pop(k), block_tokens, True)
            _block_token_ids(path, keys, bounds, block_tokens, vocab_size)
            b = bounds.tolist()
            out += [(kk, block_tokens[b[i]:b[i + 1]], block_offsets[idx[i]:idx[i + 1] + 1] - np.uint64(b[i]))
                    for i, kk in enumerate(keys)]
            continue
        if k != key:  # the members of a sample are adjacent in a WebDataset tar
            if key is not None:
                finish()
            key, tokens, offsets = k, None, None
        if kind == "tokens":
            tokens = _unsigned_member(path, m, raw)
        else:
            offsets = _unsigned_member(path, m, raw)
    if key is not None:
        finish()
    _no_partial_block(path, blocks)
    _checked_count(path, out, expected_samples)
    shard.verify(sha256)
    return out


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
    sha256: str | None = None  # the manifest's digest of the file; None for brace URLs (no manifest: not verified)


def is_url_pattern(spec: str) -> bool:
    return "{" in spec or spec.endswith(".tar")


@lru_cache(maxsize=None)
def resolve_shards(spec: str) -> tuple[ShardRef, ...]:
    """A manifest directory, or brace-notation tar paths counted by reading each tar once (no manifest)."""
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
        layout = _tar_layout(p)
        if refs and layout != refs[0].layout:
            raise ShardError(f"{spec}: {p.name} holds {layout} but {refs[0].name} holds {refs[0].layout}")
        # read_tokens refuses cluster members; read_cluster_tokens refuses samples without offsets
        records = read_cluster_tokens(p) if layout == "clusters" else read_tokens(p)
        refs.append(ShardRef(p, p.name, len(records), sum(len(r[1]) for r in records), layout))
    if not refs:
        raise ShardError(f"{spec}: the pattern names no shards")
    return tuple(refs)


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
                 verify: bool = True):
        self.name, self.spec = source.name, str(source.shards)
        self.shuffle_buffer, self.mix_shards = shuffle_buffer, mix_shards
        self.vocab_size, self.verify = vocab_size, verify
        self._verified: set[int] = set()  # shards whose digest this process has checked
        self.shards = resolve_shards(self.spec)
        self.clusters = self.shards[0].layout == "clusters"
        if cluster_sampling is True and not self.clusters:
            raise ValueError(f"{self.spec}: cluster sampling (data.cluster_sampling) is on but these shards hold "
                             "sequences, not UniRef50 clusters; prepare them with `python -m data_prep uniref "
                             "--clusters TSV` or turn cluster sampling off")
        if cluster_sampling is False and self.clusters:
            raise ValueError(f"{self.spec}: holds UniRef50 clusters (manifest layout 'clusters'), which are only "
                             "read by drawing a member; cluster sampling (data.cluster_sampling) is off")
        self.key, self.layout = key, layout
        self.transform, self.id_prefix = source.transform or transform, id_prefix
        if len(self.shards) < layout.streams:
            raise ShardError(f"{self.spec}: {len(self.shards)} shards < {layout.streams} loader streams "
                             f"({layout.describe()}); reshard with a smaller --shard-size or use fewer streams")
        self.counts = np.array([s.samples for s in self.shards])

    def stream_shards(self, stream: int, epoch: int) -> np.ndarray:
        """The shards global stream ``stream`` (of layout.streams) reads in ``epoch``."""
        perm = np.random.default_rng([*self.key, epoch]).permutation(len(self.counts))
        return perm[stream::self.layout.streams]

    def read(self, sid: int) -> list:
        """Shard ``sid``'s records, checked (counts, member names, token ids; the digest on its first read here)."""
        ref = self.shards[sid]
        sha256 = ref.sha256 if self.verify and sid not in self._verified else None
        read = read_cluster_tokens if self.clusters else read_tokens
        records = read(ref.path, expected_samples=int(self.counts[sid]), sha256=sha256, vocab_size=self.vocab_size)
        if sha256 is not None:
            self._verified.add(sid)
        return records

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
            for window, live in self._epoch_windows(stream, epoch, shards, skip):
                for sid in set(records) - live:
                    del records[sid]
                for sid, j in window:
                    if sid not in records:
                        records[sid] = self.read(sid)
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
    # length windows: [S] samples drawn per source before the current window, and the window's batches emitted
    window_taken: list = field(default_factory=list)
    window_batches: int = 0

    def as_dict(self) -> dict:
        return {"draws": self.draws, "batches": self.batches, "pending": self.pending, "taken": list(self.taken),
                "tokens": list(self.tokens), "window_taken": list(self.window_taken),
                "window_batches": self.window_batches}


class ShardStream(IterableDataset):
    """Microbatch stream of one rank. ``shards``: a shard spec (one source) or a list of :class:`Source`.

    ``mixture`` (required for several sources) gives the weights per optimizer step; ``grad_accum_steps`` maps
    microbatches to steps. ``max_tokens`` turns on token-budget batching, ``pack`` packing into rows of
    ``row_length`` (optionally with ``pack_separator`` after each document), ``shuffle_buffer`` the cross-shard
    window shuffle, ``length_window`` length-sorted batching within windows of that many draws (module docstring,
    "Length windows"); ``mix_shards`` K interleaves the samples of K shards at a time in every stream (1: one shard
    after the other, the order before shard mixing existed; holds about K shards per source and stream in memory).
    ``vocab_size`` (the model's) makes a token id at or above it a ShardError naming the shard and sample;
    ``verify`` checks each shard's sha256 against its manifest on its first read by a stream (sources given as
    brace URLs have no manifest and are not verified). ``batches_consumed`` resumes a single-source, fixed-size
    loader from that count alone (what checkpoints before loader state_dicts stored); otherwise use
    :meth:`load_state_dict`. ``cluster_sampling``: None reads each source as its manifest's layout says (a cluster
    source draws one member per sample), True requires every source to be UniRef50 clusters, False refuses cluster
    sources (module docstring, "Clusters"). Errors in the data (ShardError, a missing file) raised in a DataLoader
    worker reach the main process as the same exception with the same one-line message."""

    def __init__(self, shards: str | Path | list[Source], *, rank: int, world_size: int, num_workers: int,
                 micro_batch_size: int, seed: int, transform: SampleTransform, pad_id: int,
                 batches_consumed: int = 0, mixture: MixtureSchedule | None = None, grad_accum_steps: int = 1,
                 max_tokens: int | None = None, pack: bool = False, pack_separator: int | None = None,
                 row_length: int | None = None, shuffle_buffer: int = 0, cluster_sampling: bool | None = None,
                 mix_shards: int = 4, vocab_size: int | None = None, verify: bool = True, length_window: int = 0,
                 streams: int | None = None, seed_width: int | None = None):
        self.rank, self.world_size = rank, world_size
        self.layout = (StreamLayout.fresh(world_size, rank, num_workers, streams) if seed_width is None else
                       StreamLayout(streams, seed_width, world_size, rank))
        # num_streams: this rank's streams; the iterating processes (its workers, or itself) share them
        self.num_streams, self.shuffle_buffer = self.layout.local, shuffle_buffer
        self.processes = max(1, num_workers)
        if self.num_streams % self.processes:
            raise ValueError(f"data.num_workers: {num_workers} workers cannot share this rank's {self.num_streams} "
                             f"loader streams ({self.layout.describe()}); use a number that divides "
                             f"{self.num_streams}")
        if mix_shards < 1:
            raise ValueError(f"data.mix_shards: must be >= 1, got {mix_shards}")
        self.mix_shards = mix_shards
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self.pad_id, self.grad_accum_steps = pad_id, grad_accum_steps
        self.max_tokens, self.pack, self.pack_separator, self.row_length = max_tokens, pack, pack_separator, row_length
        if pack and (row_length is None or row_length < 2):
            raise ValueError(f"data.context_length: packing needs a row length >= 2, got {row_length}")
        why = length_window_problem(length_window, pack=pack, max_tokens=max_tokens,
                                    micro_batch_size=micro_batch_size)
        if why:
            raise ValueError(f"data.length_window: {why}")
        self.length_window = length_window
        single = not isinstance(shards, list)
        sources = [Source(Path(str(shards)).name, shards)] if single else shards
        if not sources:
            raise ValueError("data.sources: empty")
        self.names = [s.name for s in sources]
        self.mixture = mixture or MixtureSchedule.constant(self.names)
        if self.mixture.names != self.names:
            raise ValueError(f"data.schedule: weights are for sources {self.mixture.names}, loader has {self.names}")
        # The single-source key (seed,) and unprefixed ids keep streams identical to loaders before mixtures.
        self.sources = [SourceStream(s, (seed,) if single else (seed, zlib.crc32(s.name.encode())),
                                     layout=self.layout, transform=transform,
                                     id_prefix="" if single else f"{s.name}:", shuffle_buffer=shuffle_buffer,
                                     cluster_sampling=cluster_sampling, mix_shards=mix_shards,
                                     vocab_size=vocab_size, verify=verify)
                        for s in sources]
        self.shard_dir = Path(str(shards)) if single else None
        self.counts = self.sources[0].counts
        self.state = self._fresh_state()
        if batches_consumed:
            self.load_state_dict({"batches_consumed": batches_consumed})

    # -- single-source helpers kept for callers that inspect one source's streams (``stream``: this rank's)
    def stream_shards(self, stream: int, epoch: int) -> np.ndarray:
        return self.sources[0].stream_shards(self.layout.global_stream(stream), epoch)

    def samples(self, stream: int, skip: int) -> Iterator[dict]:
        return self.sources[0].samples(self.layout.global_stream(stream), skip)

    # -- state
    def _fresh_state(self) -> dict:
        S = len(self.sources)
        return {"version": STATE_VERSION, "rank": self.rank, "world_size": self.world_size, "sources": self.names,
                "shuffle_buffer": self.shuffle_buffer, "mix_shards": self.mix_shards,
                "length_window": self.length_window, "batches_consumed": 0, "layout": self.layout.as_dict(),
                "streams": [StreamState(taken=[0] * S, tokens=[0] * S, window_taken=[0] * S).as_dict()
                            for _ in range(self.num_streams)]}

    def state_dict(self) -> dict:
        """The position iteration starts from (the loader's :meth:`StreamLoader.state_dict` is the live one)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict):
        """Accepts a full state, or ``{"batches_consumed": N}`` alone for a single-source fixed-size loader."""
        if set(state) == {"batches_consumed"}:
            state = self._legacy_state(int(state["batches_consumed"]))
        # states written before the shuffle buffer / shard mixing / length windows existed read their shards one
        # after the other and batch in draw order
        state = {"shuffle_buffer": 0, "mix_shards": 1, "length_window": 0, **state}
        if int(state.get("version", 1)) > STATE_VERSION:
            raise ValueError(f"loader state: version {state['version']} is newer than this loader's {STATE_VERSION}")
        tunables = ("shuffle_buffer", "mix_shards", "length_window")
        for key, ours in (("sources", self.names), ("world_size", self.world_size), ("rank", self.rank),
                          *((k, getattr(self, k)) for k in tunables)):
            if state.get(key) != ours:
                hint = (f" (data.{key} must not change on resume; set data.{key}={state.get(key)!r} to continue "
                        "this run)" if key in tunables else "")
                raise ValueError(f"loader state: {key} {state.get(key)!r} differs from this loader's {ours!r}{hint}")
        if len(state["streams"]) != self.num_streams or saved_layout(state) != self.layout.as_dict():
            raise ValueError(f"loader state: {len(state['streams'])} streams of layout {saved_layout(state)}, this "
                             f"loader has {self.num_streams} of {self.layout.as_dict()} (reshard_states deals a "
                             "checkpoint's streams to another world size)")
        state = copy.deepcopy(state)
        state["layout"] = self.layout.as_dict()
        for st in state["streams"]:  # version 1: no windows, so the window starts where the stream stands
            st.setdefault("window_taken", list(st["taken"]))
            st.setdefault("window_batches", 0)
        state["version"] = STATE_VERSION
        self.state = state

    def _legacy_state(self, n: int) -> dict:
        if len(self.sources) > 1 or self.max_tokens or self.pack or self.length_window:
            raise ValueError("loader state: a batches_consumed count alone only resumes a single-source loader with "
                             "fixed-size batches in draw order (no length windows)")
        st = self._fresh_state()
        W, mb = self.num_streams, self.micro_batch_size
        for w in range(W):
            b = max(0, -(-(n - w) // W))  # ceil((n - w) / W) batches taken from stream w
            st["streams"][w].update(draws=b * mb, batches=b, taken=[b * mb], window_taken=[b * mb])
        st["batches_consumed"] = n
        return st

    # -- iteration
    def __iter__(self) -> Iterator[Batch]:
        # The rank's batch j (after N consumed) comes from its stream (N + j) mod L; torch's DataLoader takes batch j
        # from worker j mod P, so worker p serves streams (N + p + i P) mod L in that order (P divides L).
        info = get_worker_info()
        physical = info.id if info is not None else 0
        L, P, N = self.num_streams, self.processes, self.state["batches_consumed"]
        mine = [(N + physical + i * P) % L for i in range(L // P)]
        streams = [self._batches(w, StreamState(**copy.deepcopy(self.state["streams"][w]))) for w in mine]
        batches = streams[0] if len(streams) == 1 else _round_robin(streams)
        return batches if info is None else _reporting(batches)

    def _batches(self, w: int, st: StreamState) -> Iterator[Batch]:
        if self.length_window:
            return self._window_batches(w, st)
        return self._draw_order_batches(w, st)

    def _draw_order_batches(self, w: int, st: StreamState) -> Iterator[Batch]:
        """Microbatches of this rank's stream ``w``, filled in draw order (no length windows)."""
        g = self.layout.global_stream(w)
        chooser = SourceChooser(self.seed, *self.layout.seed_coords(g))
        iters: dict[int, Iterator[dict]] = {}
        held: list = []  # [(source, sample)] at most one: drawn, not placed yet
        weights = None

        def draw() -> dict:
            if not held:
                s = st.pending if st.pending >= 0 else chooser.choose(st.draws, weights)
                if s not in iters:  # a source's stream resumes from the count of samples already placed
                    iters[s] = self.sources[s].samples(g, st.taken[s])
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
            st.window_taken = list(st.taken)  # no windows: "the window" starts where the stream stands
            batch.stream, batch.state, batch.origin = w, st.as_dict(), (g, st.batches - 1)
            yield batch

    def _window_batches(self, w: int, st: StreamState) -> Iterator[Batch]:
        """Microbatches of length-sorted windows of ``length_window`` draws (module docstring, "Length windows").

        ``st`` names a window's start (draws, window_taken, the batches before it = batches - window_batches) and
        how many of its batches are out; the window is drawn again from there and those batches are skipped.
        """
        M, S = self.length_window, len(self.sources)
        g = self.layout.global_stream(w)
        chooser = SourceChooser(self.seed, *self.layout.seed_coords(g))
        iters = [self.sources[s].samples(g, st.window_taken[s]) for s in range(S)]  # lazy: nothing read yet
        while True:
            k0 = st.draws
            first = st.batches - st.window_batches  # this stream's microbatches before the window
            weights = self.mixture.weights((first * self.num_streams + w) // self.grad_accum_steps)
            drawn = []  # [M] (source, sample) in draw order
            for k in range(k0, k0 + M):
                s = chooser.choose(k, weights)
                drawn.append((s, next(iters[s])))
            lengths = np.array([len(x["input_ids"]) for _, x in drawn])
            groups = self._cut(lengths, np.argsort(lengths, kind="stable"))  # [n] lists of indices into drawn
            order = np.random.default_rng([self.seed, *self.layout.seed_coords(g), k0 // M, M,
                                           _LEN_TAG]).permutation(len(groups))
            for j in range(st.window_batches, len(groups)):
                group = groups[order[j]]
                for i in group:
                    s = drawn[i][0]
                    st.taken[s] += 1
                    st.tokens[s] += int(lengths[i])
                st.batches += 1
                st.window_batches = j + 1
                if st.window_batches == len(groups):  # the window is out: the state names the next one's start
                    st.draws, st.window_batches, st.window_taken = k0 + M, 0, list(st.taken)
                batch = collate([drawn[i][1] for i in group], self.pad_id)
                batch.stream, batch.state, batch.origin = w, st.as_dict(), (g, st.batches - 1)
                yield batch

    def _cut(self, lengths: np.ndarray, order: np.ndarray) -> list[list[int]]:
        """``order`` (indices by ascending length) cut into microbatches: with a token budget a sample joins unless
        (rows + 1) x its length (the longest so far: ascending) would exceed it, else groups of micro_batch_size."""
        if not self.max_tokens:
            mb = self.micro_batch_size
            return [order[a:a + mb].tolist() for a in range(0, len(order), mb)]
        groups, cur = [], []
        for i in order.tolist():
            if cur and (len(cur) + 1) * int(lengths[i]) > self.max_tokens:
                groups.append(cur)
                cur = []
            cur.append(i)
        return groups + [cur]


@dataclass
class WorkerError:
    """A data error raised in a DataLoader worker, sent to the main process as an item of the stream: torch would
    re-raise it as ``ShardError("Caught ShardError in DataLoader worker process 0. Original Traceback ...")``, many
    lines with the message at the end; the main process re-raises the original type and one-line message."""

    kind: type
    message: str

    def error(self) -> Exception:
        return self.kind(self.message)


_WORKER_ERRORS = (ShardError, FileNotFoundError)  # errors in the data, not in the code: their message is the report


def _round_robin(streams: list[Iterator[Batch]]) -> Iterator[Batch]:
    """One batch of each (infinite) stream in turn."""
    while True:
        for it in streams:
            yield next(it)


def _reporting(batches: Iterator[Batch]) -> Iterator:
    """A worker's batches, ending with a WorkerError item when the data it reads is bad."""
    try:
        yield from batches
    except _WORKER_ERRORS as e:
        yield WorkerError(type(e), str(e))


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
                                           prefetch_factor=4, persistent_workers=False,
                                           worker_init_fn=_ignore_stop_signals))
        batch = next(self._it)
        if isinstance(batch, WorkerError):
            self._it = None  # the DataLoader and its workers go with it; a retry restarts from the last batch
            raise batch.error() from None
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


def _ignore_stop_signals(worker_id: int):
    """Loader workers ignore SIGTERM/SIGUSR1: a scheduler or DeepSpeed's launch.py signals the whole process tree,
    and the rank above them must keep its batches coming while it finishes its step and checkpoint (the engine's
    StopRequest). They end with the rank's DataLoader."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def make_loader(dataset: ShardStream, num_workers: int) -> StreamLoader:
    return StreamLoader(dataset, num_workers)
