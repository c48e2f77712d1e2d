"""Shard format shared by every data_prep job and the training loader.

A shard directory holds WebDataset tar files and one ``manifest.json``. Two member layouts exist; readers take both
(even mixed in one tar), telling them apart by the members a key has:

**Blocks** (format ``bioseq-wds/2``, what data_prep writes): one member group per block of up to ``block_samples``
samples (and about ``block_tokens`` tokens), key ``block<NNNNNN>`` (numbered within the shard), members in this
order::

    <block>.keys.txt     the samples' keys, one per line (ASCII, "\n"-separated, no trailing newline)
    <block>.bounds.npy   uint64 [n + 1]: sample i is tokens[bounds[i]:bounds[i + 1]] (bounds[0] = 0, non-decreasing,
                         bounds[n] = len(tokens))
    <block>.offsets.npy  clusters only: uint64 [members + 1], the block's member boundaries (strictly increasing,
                         0 .. len(tokens)); every bound is one of them, so sample i's members are the offsets between
                         bounds[i] and bounds[i + 1]
    <block>.tokens.npy   every sample's token ids end to end (no <cls>/<eos>; the smallest unsigned dtype that holds
                         the vocabulary: uint8 up to 256 tokens, uint16 up to 65536, else uint32)
    <block>.meta.json    JSON array of the n samples' meta objects ({"id": record id, "source": ..., ...}), in order

Why: one WebDataset sample (two tar members, 1-2 KiB of headers and padding) per record made data_prep spend most
of its time in tarfile and made the shards ~4x the size of their tokens; a block costs five members for thousands of
records, keeps the tar a valid WebDataset (a plain WebDataset reader sees one sample per block), and the reader
slices the records out of one array (views, no copy). What a record is (key, tokens, meta) is unchanged.

**One sample per record** (format ``bioseq-wds/1``: shards written before blocks, and ``ShardWriter`` with
``block_samples=None``)::

    <key>.tokens.npy   token ids of the sample (dtype as above)
    <key>.meta.json    its meta object
    <key>.offsets.npy  clusters only: n + 1 offsets into the sample's tokens (below)

Versioning: the manifest's ``format`` is ``bioseq-wds/2`` when written by this code (its shards may hold either
layout); ``bioseq-wds/1`` manifests (per-record shards only) are read as before.

The manifest's ``layout`` says what a sample is:

* ``"sequences"`` (every source; manifests written before the field existed): one sample = one sequence.
* ``"clusters"`` (``data_prep uniref --clusters``): one sample = one UniRef50 cluster holding all of its UniRef90
  members: the members' tokens concatenated in the cluster's member order, with n + 1 offsets (per record: the
  sample's ``<key>.offsets.npy``, uint32, or uint64 past 2**32 - 1 tokens; in blocks: the block's offsets member),
  member i being ``tokens[offsets[i]:offsets[i + 1]]`` (offsets[0] = 0, strictly increasing: no member is empty);
  meta ``members`` lists the member ids in that order. A shard's ``tokens`` count is the residues of all members.
  The training loader draws one member per (seed, epoch, sample) and never sees the concatenation; read such shards
  with ``read_clusters`` (``read_shard`` refuses them rather than hand out the concatenation as one sequence; both
  in pipeline/data/shard_reader.py, the one reader of this format).

The manifest is the contract the loader relies on: per shard its sample and token counts and sha256, so a reader can
jump to any (epoch, position) without opening the tars it skips, and can tell a truncated shard from a short one.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
# webdataset (TarWriter for per-record shards) is imported where used: it pulls in torch
# (~2 s), which data_prep's writer of blocks never needs.

FORMAT = "bioseq-wds/2"  # written by this code: shards of blocks (module docstring)
FORMATS = ("bioseq-wds/1", FORMAT)  # read: /1 manifests list per-record shards only
BLOCK_SAMPLES = 2048  # default samples per block (data_prep)
BLOCK_TOKENS = 1 << 22  # a block is closed once it holds this many tokens (bounds the writer's memory)
LAYOUTS = ("sequences", "clusters")


class ShardError(ValueError):
    """A shard directory or shard that cannot be read as promised; the message names the file."""

MANIFEST = "manifest.json"


@dataclass
class ShardInfo:
    path: str  # relative to the manifest's directory
    samples: int
    tokens: int
    sha256: str


@dataclass
class Manifest:
    source: str
    tokenizer: dict  # {"name": ..., "vocab": [...], "alphabet": ...}
    shards: list[ShardInfo]
    filtered: dict = field(default_factory=dict)  # reason -> count, for every record not written
    inputs: list = field(default_factory=list)  # [{"path", "records", ...}]
    stats: dict = field(default_factory=dict)  # source-specific counters (residues, normalizations, ...)
    layout: str = "sequences"  # what one sample is: a sequence, or a UniRef50 cluster of members (LAYOUTS)
    format: str = FORMAT

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_json(self) -> dict:
        d = asdict(self)
        d["total_samples"], d["total_tokens"] = self.total_samples, self.total_tokens
        return d


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_fingerprint(spec: str | Path) -> dict | None:
    """What a checkpoint records of the shard directory ``spec`` it trained on: the sha256 of its manifest.json (which
    lists every shard with its sample count and digest, so any rebuild changes it), with its shard and sample counts
    for the message; None for a brace-notation URL pattern (no manifest to digest)."""
    path = Path(spec) / MANIFEST
    if not path.is_file():
        return None
    try:
        m = load_manifest(spec)
    except (OSError, ShardError):  # named by the shard checks that follow (pipeline.data.compat)
        return None
    return {"sha256": sha256_file(path), "shards": len(m.shards), "samples": m.total_samples}


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically (temp file + rename), so a reader never sees half of it."""
    path = Path(directory) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# manifest.json's fields: (key, required, check, what it must be). Checked before anything is built from them.
_MANIFEST_SCHEMA = (("format", True, lambda v: v in FORMATS, f"one of {', '.join(map(repr, FORMATS))}"),
                    ("source", True, lambda v: isinstance(v, str), "a string"),
                    ("tokenizer", True, lambda v: isinstance(v, dict), "an object"),
                    ("shards", True, lambda v: isinstance(v, list), "a list"),
                    ("layout", False, lambda v: v in LAYOUTS, f"one of {', '.join(LAYOUTS)}"),
                    ("filtered", False, lambda v: isinstance(v, dict), "an object"),
                    ("inputs", False, lambda v: isinstance(v, list), "a list"),
                    ("stats", False, lambda v: isinstance(v, dict), "an object"))
_SHARD_SCHEMA = (("path", lambda v: isinstance(v, str) and v != "", "a non-empty string"),
                 ("samples", _count, "an integer >= 0"), ("tokens", _count, "an integer >= 0"),
                 ("sha256", lambda v: isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v),
                  "64 lowercase hex digits"))


def check_manifest_doc(raw, path: Path) -> None:
    """ShardError naming ``path`` and the key unless ``raw`` (a parsed manifest.json or job manifest) has the
    manifest's shape: every key of _MANIFEST_SCHEMA of its type, every shard exactly {path, samples, tokens, sha256}
    with counts that are integers >= 0 (not bools, not floats). Checked before anything is allocated from a count:
    a negative, huge or wrongly typed sample count ended in a ValueError, a MemoryError (6.94 EiB) or a TypeError.
    The counts' bound by the shard files' sizes is ``load_manifest``'s (it stats the files)."""
    if not isinstance(raw, dict):
        raise ShardError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    for key, required, ok, want in _MANIFEST_SCHEMA:
        if key not in raw:
            if required:
                raise ShardError(f"{path}: no {key!r} (not a shard manifest)")
            continue
        if not ok(raw[key]):
            raise ShardError(f"{path}: {key} {_shown(raw[key])}, expected {want}")
    for i, shard in enumerate(raw["shards"]):
        if not isinstance(shard, dict):
            raise ShardError(f"{path}: shards[{i}] is {type(shard).__name__}, expected an object")
        extra = sorted(set(shard) - {k for k, _, _ in _SHARD_SCHEMA})
        if extra:
            raise ShardError(f"{path}: shards[{i}] has the unknown key {extra[0]!r}")
        for key, ok, want in _SHARD_SCHEMA:
            if key not in shard:
                raise ShardError(f"{path}: shards[{i}] has no {key!r}")
            if not ok(shard[key]):
                raise ShardError(f"{path}: shards[{i}].{key} {_shown(shard[key])}, expected {want}")


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def load_manifest(directory: str | Path) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise FileNotFoundError(f"shard directory {directory} does not exist (run data_prep first)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest.json in the shard directory (run data_prep first)")
    manifest = parse_manifest(path.read_text(), path)
    for i, s in enumerate(manifest.shards):
        p = directory / s.path
        if not p.is_file():
            raise FileNotFoundError(f"{path}: lists shard {s.path} which is missing")
        check_counts_fit(s, i, p.stat().st_size, path)
    return manifest


def check_counts_fit(s: ShardInfo, i: int, size: int, where) -> None:
    """ShardError unless shard ``i``'s counts fit its ``size`` bytes: every sample and token takes at least one byte
    of its tar, a bound that keeps a corrupt count from allocating (local and remote shard sets alike)."""
    for key in ("samples", "tokens"):
        if getattr(s, key) > size:
            raise ShardError(f"{where}: shards[{i}].{key} {getattr(s, key)} is more than shard {s.path} could hold "
                             f"({size} bytes; each takes at least one)")


def parse_manifest(raw: str | bytes, where) -> Manifest:
    """A manifest from its bytes (``where``, a path or URL, names it in a ShardError): the format and schema
    (check_manifest_doc) and shard paths that stay inside the shard set are checked here; that the shards exist
    and can hold their counts is the caller's (a local directory above, pipeline/data/remote.py for a URL)."""
    try:
        raw = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise ShardError(f"{where}: not a shard manifest (JSON nested too deeply to read)") from None
    check_manifest_doc(raw, where)
    layout = raw.get("layout", "sequences")  # manifests from before clusters existed hold sequences
    shards = [ShardInfo(**s) for s in raw["shards"]]
    for s in shards:
        if Path(s.path).is_absolute() or ".." in Path(s.path).parts:
            raise ShardError(f"{where}: shard path {s.path!r} escapes the shard directory")
    if not shards:
        raise ShardError(f"{where}: lists no shards")
    return Manifest(source=raw["source"], tokenizer=raw["tokenizer"], shards=shards,
                    filtered=raw.get("filtered", {}), inputs=raw.get("inputs", []), stats=raw.get("stats", {}),
                    layout=layout, format=raw["format"])


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds ids 0 .. vocab_size - 1."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"vocabulary of {vocab_size} tokens does not fit in uint32")


def offsets_dtype(total: int) -> np.dtype:
    """uint32 for a cluster's offsets, uint64 when its members hold more tokens than uint32 counts."""
    return np.dtype(np.uint32 if total <= np.iinfo(np.uint32).max else np.uint64)


def check_offsets(offsets: np.ndarray, n_tokens: int) -> str | None:
    """Why ``offsets`` does not split ``n_tokens`` tokens into non-empty members, or None when it does."""
    if offsets.ndim != 1 or offsets.dtype.kind not in "ui":
        return f"offsets must be a 1-D integer array, got {offsets.dtype} {offsets.shape}"
    if len(offsets) < 2:
        return "a cluster needs at least one member (offsets of length >= 2)"
    if int(offsets[0]) != 0 or int(offsets[-1]) != n_tokens:
        return f"offsets run from {int(offsets[0])} to {int(offsets[-1])}, expected 0 to {n_tokens} (the tokens)"
    if not np.all(offsets[1:] > offsets[:-1]):
        return "offsets must be strictly increasing (no empty member)"
    return None


def check_key(key: str) -> None:
    if "/" in key or key.startswith(".") or "." in key or "\n" in key:
        raise ValueError(f"sample key {key!r} may not contain '/', '.' or a line break")


class _HashingFile:
    """The shard file being written, hashed on the way (sha256 without reading the file back)."""

    def __init__(self, path: Path):
        self._f, self.sha = open(path, "wb"), hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()

    def close(self):
        self._f.close()


def _add_member(f: _HashingFile, name: str, parts: list) -> None:
    """One regular tar member (USTAR header: mode 0444, mtime 0, owner bigdata like webdataset's TarWriter; names
    are short ASCII, so no PAX header is needed) whose data is ``parts`` written one after the other: what
    tarfile.addfile writes, without copying the data through a file object."""
    size = sum(len(memoryview(p).cast("B")) for p in parts)
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uname, info.gname = size, 0o444, 0, "bigdata", "bigdata"
    f.write(info.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape"))
    for p in parts:
        f.write(p)
    if size % tarfile.BLOCKSIZE:
        f.write(tarfile.NUL * (tarfile.BLOCKSIZE - size % tarfile.BLOCKSIZE))


def _end_archive(f: _HashingFile) -> None:
    """tarfile's end of archive: two zero blocks, then zeros up to a multiple of the record size (10240)."""
    f.write(tarfile.NUL * (2 * tarfile.BLOCKSIZE))
    rest = f.tell() % tarfile.RECORDSIZE
    if rest:
        f.write(tarfile.NUL * (tarfile.RECORDSIZE - rest))


class ShardWriter:
    """Writes samples into numbered tar shards of at most ``max_samples`` samples each.

    ``block_samples`` N: samples are written in blocks of up to N samples (format 2, the module docstring), a block
    closed early once it holds ``block_tokens`` tokens; None writes one member group per sample (format 1, the layout
    of shards written before blocks). Shards are written as ``.tar.tmp`` and renamed when closed; ``abort()`` removes
    everything written. ``vocab_size`` fixes the stored dtype for the whole directory (default: uint8, the
    nucleotide and protein vocabularies). ``layout`` "clusters" makes every sample a cluster: ``write`` then needs
    the members' offsets. ``completed`` are shards a previous (interrupted) run already wrote and verified:
    numbering continues after them. ``on_close(info)`` is called after each shard is renamed into place (a
    resumable job records it in its progress file).
    """

    def __init__(self, directory: str | Path, prefix: str = "shard", max_samples: int = 10_000,
                 vocab_size: int = 256, completed: list[ShardInfo] | None = None,
                 on_close: Callable[[ShardInfo], None] | None = None, layout: str = "sequences",
                 block_samples: int | None = None, block_tokens: int = BLOCK_TOKENS):
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}, expected one of {', '.join(LAYOUTS)}")
        if block_samples is not None and block_samples < 1:
            raise ValueError(f"block_samples must be >= 1, got {block_samples}")
        self.directory = Path(directory)
        self.prefix, self.max_samples, self.layout = prefix, max_samples, layout
        self.block_samples, self.block_tokens = block_samples, max(1, block_tokens)
        self.dtype, self.vocab_size = token_dtype(vocab_size), vocab_size
        self.shards: list[ShardInfo] = list(completed or [])
        self.on_close = on_close
        self._writer = None
        self._tmp = None
        self._count = self._tokens = 0
        self._new_block()

    @property
    def format(self) -> str:
        return FORMAT if self.block_samples is not None else FORMATS[0]

    def _open(self):
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._tmp = self.directory / (name + ".tmp")
        if self.block_samples is None:
            self._file = open(self._tmp, "wb")
            # mtime fixed so that the same input gives byte-identical shards (and sha256); an int, because a float
            # mtime makes tarfile write an extra PAX header (1 KiB) before every member.
            from webdataset.writer import TarWriter
            self._writer = TarWriter(self._file, encoder=False, mtime=0)
        else:
            self._file = self._writer = _HashingFile(self._tmp)
            self._blocks = 0
        self._count = self._tokens = 0

    def _check_tokens(self, key: str, tokens) -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"sample {key}: token id outside 0..{self.vocab_size - 1}")
        return tokens

    def write(self, key: str, tokens: np.ndarray, meta: dict, offsets: np.ndarray | None = None):
        """One sample; with layout "clusters" ``tokens`` are the members concatenated and ``offsets`` their n + 1
        boundaries (see the module docstring)."""
        check_key(key)
        if (offsets is not None) != (self.layout == "clusters"):
            raise ValueError(f"sample {key}: offsets are given for, and only for, the clusters layout "
                             f"(this writer's layout is {self.layout!r})")
        tokens = self._check_tokens(key, tokens)
        if offsets is not None:
            offsets = np.asarray(offsets)
            why = check_offsets(offsets, len(tokens))
            if why is not None:
                raise ValueError(f"sample {key}: {why}")
        meta_json = json.dumps(meta, separators=(",", ":"))
        if self._writer is None:
            self._open()
        if self.block_samples is None:
            member = {"__key__": key, "tokens.npy": _npy(tokens.astype(self.dtype, copy=False)),
                      "meta.json": meta_json.encode()}
            if offsets is not None:
                member["offsets.npy"] = _npy(offsets.astype(offsets_dtype(len(tokens)), copy=False))
            self._writer.write(member)
        else:
            b = self._block
            b["keys"].append(key)
            b["tokens"].append(tokens)
            b["lengths"].append(len(tokens))
            b["meta"].append(meta_json)
            if offsets is not None:
                b["members"].append(np.diff(offsets.astype(np.int64)))
            self._block_tokens += len(tokens)
        self._added(1, len(tokens))

    def extend(self, keys: list[str], tokens: np.ndarray, bounds: np.ndarray, meta_json: list[str],
               members: np.ndarray | None = None):
        """Several samples at once: sample i is ``keys[i]``, ``tokens[bounds[i]:bounds[i + 1]]`` and meta
        ``meta_json[i]``, one JSON object already encoded as ``json.dumps(meta, separators=(",", ":"))`` would (the
        caller's promise: data_prep's batch path, tested to equal it). ``tokens``: 1-D integer [bounds[-1]];
        ``bounds``: [len(keys) + 1]; layout "clusters": ``members``, the lengths of every sample's members one
        after the other (they add up to each sample's length). Same checks as ``write``, over the whole batch;
        without blocks (format 1), ``write`` per sample."""
        n = len(keys)
        if n == 0:
            return
        if (members is not None) != (self.layout == "clusters"):
            raise ValueError("extend: member lengths are given for, and only for, the clusters layout")
        bounds = np.asarray(bounds, dtype=np.int64)
        if members is not None:
            members = np.asarray(members, dtype=np.int64)
            ends = np.cumsum(members)
            if (members <= 0).any() or (np.diff(bounds) <= 0).any() or not np.isin(bounds[1:], ends).all() \
                    or (len(ends) and ends[-1] != bounds[-1]):
                raise ValueError("extend: member lengths must be positive and add up to each sample's length")
        if self.block_samples is None:
            first = np.concatenate([[0], np.searchsorted(ends, bounds[1:]) + 1]) if members is not None else None
            for i, key in enumerate(keys):
                lo, hi = int(bounds[i]), int(bounds[i + 1])
                offsets = None if members is None else \
                    np.concatenate([[0], ends[first[i]:first[i + 1]] - lo]).astype(np.int64)
                self.write(key, tokens[lo:hi], json.loads(meta_json[i]), offsets)
            return
        joined = "\n".join(keys)
        if "." in joined or "/" in joined or joined.count("\n") != n - 1 or any(not k for k in (keys[0], keys[-1])):
            for k in keys:
                check_key(k)
        if len(bounds) != n + 1 or len(meta_json) != n or bounds[0] != 0 or bounds[-1] != len(tokens):
            raise ValueError(f"extend: {n} keys, {len(meta_json)} metas, bounds [{len(bounds)}] from "
                             f"{bounds[0] if len(bounds) else None} to {bounds[-1] if len(bounds) else None} for "
                             f"{len(tokens)} tokens")
        lengths = np.diff(bounds)
        if (lengths < 0).any():
            raise ValueError("extend: bounds must be non-decreasing")
        tokens = self._check_tokens(keys[0], tokens)
        at = 0
        while at < n:
            if self._writer is None:
                self._open()
            room = min(self.max_samples - self._count, self.block_samples - len(self._block["keys"]), n - at)
            # up to the sample that brings the block to block_tokens, where write() would close it too
            over = np.searchsorted(bounds[at + 1:at + room + 1] - bounds[at],
                                   self.block_tokens - self._block_tokens, side="left")
            take = max(1, min(room, int(over) + 1))
            b = self._block
            lo, hi = int(bounds[at]), int(bounds[at + take])
            b["keys"].extend(keys[at:at + take])
            b["tokens"].append(tokens[lo:hi])
            b["lengths"].extend(lengths[at:at + take].tolist())
            b["meta"].extend(meta_json[at:at + take])
            if members is not None:  # the members of samples at..at+take: those that end in (lo, hi]
                b["members"].append(members[np.searchsorted(ends, lo, "right"):np.searchsorted(ends, hi, "right")])
            self._block_tokens += hi - lo
            at += take
            self._added(take, hi - lo)

    def _added(self, n: int, tokens: int):
        self._count += n
        self._tokens += tokens
        if self.block_samples is not None and (len(self._block["keys"]) >= self.block_samples
                                               or self._block_tokens >= self.block_tokens):
            self._flush_block()
        if self._count >= self.max_samples:
            self._close_current()

    def _new_block(self):
        self._block = {"keys": [], "tokens": [], "lengths": [], "meta": [], "members": []}
        self._block_tokens = 0

    def _flush_block(self):
        b = self._block
        if not b["keys"]:
            return
        name = f"block{self._blocks:06d}"
        self._blocks += 1
        tokens = np.concatenate(b["tokens"]).astype(self.dtype, copy=False) if b["tokens"] else \
            np.zeros(0, self.dtype)
        bounds = np.zeros(len(b["keys"]) + 1, np.uint64)
        np.cumsum(b["lengths"], out=bounds[1:])
        members = [("keys.txt", ["\n".join(b["keys"]).encode("ascii")]), ("bounds.npy", _npy_parts(bounds))]
        if self.layout == "clusters":
            offsets = np.zeros(sum(len(m) for m in b["members"]) + 1, np.uint64)
            np.cumsum(np.concatenate(b["members"]), out=offsets[1:])
            members.append(("offsets.npy", _npy_parts(offsets)))
        members += [("tokens.npy", _npy_parts(tokens)), ("meta.json", [("[" + ",".join(b["meta"]) + "]").encode()])]
        for ext, parts in members:
            _add_member(self._file, f"{name}.{ext}", parts)
        self._new_block()

    def _close_current(self):
        if self._writer is None:
            return
        if self.block_samples is not None:
            self._flush_block()
            _end_archive(self._file)
        self._writer.close()
        self._file.close()
        final = self._tmp.with_suffix("")  # drop .tmp
        os.replace(self._tmp, final)
        digest = self._file.sha.hexdigest() if self.block_samples is not None else sha256_file(final)
        info = ShardInfo(final.name, self._count, self._tokens, digest)
        self.shards.append(info)
        self._writer = None
        if self.on_close is not None:
            self.on_close(info)

    def close(self) -> list[ShardInfo]:
        self._close_current()
        return self.shards

    def abort(self):
        if self._writer is not None:
            self._new_block()
            self._writer.close()
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            self._writer = None
        for s in self.shards:
            (self.directory / s.path).unlink(missing_ok=True)
        self.shards = []


def _npy_parts(array: np.ndarray) -> list:
    """np.save's bytes of a 1-D array as [header, the array's own buffer] (no copy of the data)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(array))
    return [buf.getvalue(), np.ascontiguousarray(array).data]


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()
