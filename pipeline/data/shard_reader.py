"""The one reader of the shard format (pipeline/data/shards.py's docstring): the training loader, evaluation and
validation sets, tools/inspect_shards.py, data_prep's checks and the tests all read shards through it.

One way into a tar (:class:`_ShardFile`): the shard is read whole in one call and its members are sliced out of
that buffer as views (the arrays decoded from them share it: no copy per member). Members are grouped by key as a
WebDataset reader groups them (consecutive members whose names share the part before the first dot of the base
name), and a group is a block (``keys.txt`` / ``bounds.npy``: many samples) or one sample (format 1). Every caller
gets the same checks, in this order: each member passes :func:`member_problem`, the archive ends in zero blocks
(:func:`end_problem`), each group has its members and the layout the caller asked for (sequences or clusters),
each array decodes as 1-D unsigned, a block's keys, bounds and offsets agree, (with ``vocab_size``) every token id
is below it, (when asked for) each meta decodes, the sample count is the manifest's, and (with ``sha256``) the
buffer's digest is the manifest's. Damage is one ShardError line naming the file and the member or sample.

What differs per caller is only what is returned: the loader's hot path (:func:`read_tokens`,
:func:`read_cluster_tokens`) skips ``meta.json`` (not needed to train); :func:`read_shard` and
:func:`read_clusters` decode it.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline.data.shards import ShardError, check_offsets, load_manifest

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


def member_problem(member: tarfile.TarInfo) -> str | None:
    """Why a tar member may not be read from a shard, or None. Every read of a shard asks: a name that is absolute
    or has a ``..`` part would escape the shard if extracted, a symbolic or hard link points at data outside the
    member, and a device, FIFO or other special member is no sample. ShardWriter writes none of these."""
    name = member.name
    if member.issym() or member.islnk():
        return f"member {name} is a {'symbolic' if member.issym() else 'hard'} link (to {member.linkname!r})"
    if name.startswith("/") or ".." in name.split("/"):
        return f"member {name!r} escapes the shard"
    if not (member.isreg() or member.isdir()):
        return f"member {name} is not a regular file"
    return None


def end_problem(rest, offset: int) -> str | None:
    """Why the bytes after the last member tarfile read (from ``offset`` on) are not the end of the archive, or None.
    tarfile ends an archive silently at a truncated or unreadable header past the first one, so a damaged shard
    would pass for a shorter one: what follows the last member must be zero blocks (or nothing)."""
    if np.frombuffer(rest, np.uint8).any():
        return f"unreadable tar header at byte {offset} of {offset + len(rest)}"
    return None


class _ShardFile:
    """One shard read whole, in one call: the one way into a tar.

    :meth:`members` yields (member, its bytes) of every regular member in file order, the bytes being views of the
    buffer (the arrays decoded from them share it: no copy per member). Every member passes :func:`member_problem`,
    and the archive must end in zero blocks or at the end of the file (:func:`end_problem`: tarfile silently stops
    at a truncated or unreadable header past the first, which would pass for a shorter shard). :meth:`verify` then
    compares the buffer's sha256 with the manifest's: one pass of hashlib over bytes already in memory, not a
    second read. Damage is one ShardError naming the file.
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

    def groups(self) -> Iterator[tuple[str, dict]]:
        """(key, {extension: bytes}) of every member group in file order: consecutive members whose names share the
        key (the name up to the first dot of its base name, as WebDataset's group_by_keys splits it; a name with no
        dot there is no sample's member and is skipped). A key's extension twice in one group is a ShardError."""
        key, parts = None, {}
        for m, raw in self.members():
            k, dot, ext = m.name.partition(".")
            if "/" in ext or "/" in k:  # a folder in the name (rare): split the base name
                head, slash, base = m.name.rpartition("/")
                stem, dot, ext = base.partition(".")
                k = head + slash + stem if stem else ""
            if not (dot and k) or k.endswith("/"):
                continue
            if k != key:
                if key is not None:
                    yield key, parts
                key, parts = k, {}
            if ext in parts:
                raise ShardError(f"{self.path}: member {m.name} appears twice in sample {key}")
            parts[ext] = raw
        if key is not None:
            yield key, parts

    def verify(self, sha256: str | None):
        if sha256 is not None:
            digest = hashlib.sha256(self.data).hexdigest()
            if digest != sha256:
                raise ShardError(f"{self.path}: sha256 {digest[:16]}... differs from the manifest's {sha256[:16]}... "
                                 "(the shard changed after data_prep wrote it; rebuild it, or set data.verify=false)")


def _truncated(path: Path, last: str | None, error: Exception) -> ShardError:
    after = f" after member {last}" if last else " at its first member"
    return ShardError(f"{path}: truncated or corrupt shard{after} ({error})")


# --------------------------------------------------------------------------------------------------------------------
# Callers
# --------------------------------------------------------------------------------------------------------------------
def read_tokens(path: Path, expected_samples: int | None = None, *, sha256: str | None = None,
                vocab_size: int | None = None) -> list[tuple[str, np.ndarray]]:
    """(key, tokens) of every sample of a shard, in file order: the loader's hot path.

    Tar iteration of the one buffer + decode of the ``tokens``, ``bounds`` and ``keys`` members only (``meta.json``
    is not needed to train and is not decoded; read_shard and tools/inspect_shards.py check it); a block's samples
    are views of its one tokens array. About 3x faster than webdataset's tar_file_iterator + group_by_keys, which
    bench/data.py measures against the bare read floor. A truncated tar, a corrupt tokens, bounds or keys member, a
    member that is a link or escapes the shard, a token id >= ``vocab_size``, a count differing from the manifest or
    a digest differing from ``sha256`` (checked in that order) is a ShardError naming the file (and member or
    sample). A cluster shard (offsets members) is refused: its tokens are several proteins end to end.
    """
    return _read(Path(path), expected_samples, clusters=False, meta=False, sha256=sha256, vocab_size=vocab_size)


def read_cluster_tokens(path: Path, expected_samples: int | None = None, *, sha256: str | None = None,
                        vocab_size: int | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(key, members' tokens end to end, offsets) of every sample of a cluster shard, in file order.

    The cluster counterpart of read_tokens (same errors and checks), plus: a sample without both members, or offsets
    that do not split its tokens into non-empty members, is a ShardError naming the member. A block's samples are
    views of its tokens, their offsets relative to each sample.
    """
    return _read(Path(path), expected_samples, clusters=True, meta=False, sha256=sha256, vocab_size=vocab_size)


def read_records(path: Path, expected_samples: int | None = None, *, sha256: str | None = None,
                 vocab_size: int | None = None) -> list[tuple[str, np.ndarray, dict]]:
    """:func:`read_tokens` with each sample's meta.json decoded, (key, tokens, meta) in file order: the loader's read
    of a source whose transform needs the meta (a supervised task's labels, pipeline/tasks), with the same checks."""
    return [(key, tokens, meta) for key, tokens, _, meta in
            _read(Path(path), expected_samples, clusters=False, meta=True, sha256=sha256, vocab_size=vocab_size)]


def read_shard(path: str | Path, expected_samples: int | None = None) -> list[tuple[str, np.ndarray, dict]]:
    """All samples of one shard as (key, tokens, meta), in file order; tokens keep their stored unsigned dtype.

    A truncated or corrupt tar, a member that escapes the shard or is a link (:func:`member_problem`), an unreadable
    member (named), or fewer samples than the manifest promises is one ShardError naming the file. So is a cluster
    shard (``<key>.offsets.npy``): its tokens are several proteins end to end, which no caller should take for one
    sequence; use read_clusters.
    """
    return [(key, tokens, meta) for key, tokens, _, meta in
            _read(Path(path), expected_samples, clusters=False, meta=True)]


def read_clusters(path: str | Path, expected_samples: int | None = None
                  ) -> list[tuple[str, list[np.ndarray], dict]]:
    """All samples of a cluster shard as (key, member token arrays in the cluster's order, meta), in file order;
    the errors of read_shard, plus a sample without offsets or with offsets that do not split its tokens."""
    return [(key, cluster_members(tokens, offsets), meta)
            for key, tokens, offsets, meta in _read(Path(path), expected_samples, clusters=True, meta=True)]


def cluster_members(tokens: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """A cluster's member token arrays (views of ``tokens``), split at its checked ``offsets`` [members + 1]."""
    return [tokens[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:])]


def shard_sequences(directory: str | Path, limit: int | None = None) -> list[np.ndarray]:
    """Every sequence of a shard directory in manifest order (a clusters layout: every member of every cluster),
    the first ``limit`` of them when given: the held-out sets of evaluation and validation."""
    directory = Path(directory)
    manifest = load_manifest(directory)
    out: list[np.ndarray] = []
    for s in manifest.shards:
        if limit is not None and len(out) >= limit:
            break
        if manifest.layout == "clusters":
            out += [t for _, members, _ in read_clusters(directory / s.path, s.samples) for t in members]
        else:
            out += [t for _, t, _ in read_shard(directory / s.path, s.samples)]
    return out if limit is None else out[:limit]


def shard_layout(path: Path) -> str:
    """'clusters' when the first sample of a tar has an offsets member, else 'sequences' (brace URLs, no manifest)."""
    for _, parts in _ShardFile(path).groups():
        return "clusters" if "offsets.npy" in parts else "sequences"
    return "sequences"


# --------------------------------------------------------------------------------------------------------------------
# Samples of a member group
# --------------------------------------------------------------------------------------------------------------------
def _read(path: Path, expected_samples: int | None, *, clusters: bool, meta: bool, sha256: str | None = None,
          vocab_size: int | None = None) -> list:
    """Every sample of a shard, in file order, checked as the module docstring says: (key, tokens) (``clusters``
    False) or (key, tokens, offsets) (True); with ``meta`` (key, tokens, offsets or None, meta)."""
    out, shard = [], _ShardFile(path)
    for key, parts in shard.groups():
        out += group_samples(path, key, parts, clusters=clusters, meta=meta, vocab_size=vocab_size)
    if expected_samples is not None and len(out) != expected_samples:
        raise ShardError(f"{path}: holds {len(out)} samples but the manifest says {expected_samples} "
                         "(truncated shard?)")
    shard.verify(sha256)
    return out


def group_samples(path: Path | str, key: str, parts: dict, *, clusters: bool, meta: bool,
                  vocab_size: int | None = None) -> list:
    """The samples of one member group ``key`` ({extension: bytes}, as a WebDataset reader groups a tar), a block
    (format 2) or one sample (format 1), each checked and shaped as :func:`_read` returns it; ``path`` (a file or a
    URL) only names the shard in a ShardError. pipeline/data/wds_compat.py decodes WebDataset's samples with it."""
    if "keys.txt" in parts or "bounds.npy" in parts:
        return _block(path, key, parts, clusters, meta, vocab_size)
    return [_record(path, key, parts, clusters, meta, vocab_size)]


def _check_layout(path: Path, what: str, key: str, parts: dict, clusters: bool, meta: bool) -> None:
    """A cluster where sequences were asked for, or the reverse, is a ShardError saying which reader fits."""
    if ("offsets.npy" in parts) == clusters:
        return
    if clusters:
        raise ShardError(f"{path}: {what} {key} lacks {key}.offsets.npy: not a cluster shard"
                         + (" (use read_shard)" if meta else " (a cluster shard holds offsets for every sample)"))
    if meta:
        raise ShardError(f"{path}: {what} {key!r} is a UniRef50 cluster{' block' if what == 'block' else ''} "
                         f"({key}.offsets.npy): read the shard with read_clusters")
    # never hand out a cluster's members end to end
    raise ShardError(f"{path}: member {key}.offsets.npy: a UniRef50 cluster shard, read by cluster sampling only "
                     "(its manifest must say layout 'clusters')")


def _lacks(path: Path, what: str, key: str, parts: dict, needed: tuple) -> None:
    missing = [f"{key}.{ext}" for ext in needed if ext not in parts]
    if missing:
        raise ShardError(f"{path}: {what} {key} lacks {', '.join(missing)}")


def _unsigned(path: Path, key: str, ext: str, raw) -> np.ndarray:
    """Member ``key.ext``'s 1-D unsigned array (tokens, bounds, offsets), or a ShardError naming it."""
    try:
        array = decode_tokens(raw)
        if array.ndim != 1 or array.dtype.kind != "u":
            raise ValueError(f"holds {array.dtype} {array.shape}, expected 1-D unsigned ids")
    except (ValueError, EOFError, OSError) as e:
        raise ShardError(f"{path}: corrupt member {key}.{ext} ({e})") from None
    return array


def _json(path: Path, key: str, ext: str, raw):
    try:
        return json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardError(f"{path}: corrupt member {key}.{ext} ({e})") from None


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


def _record(path: Path, key: str, parts: dict, clusters: bool, meta: bool, vocab_size: int | None) -> tuple:
    """The sample of a one-sample group (format 1), shaped as :func:`_read` returns it."""
    if "tokens.npy" not in parts or (meta and "meta.json" not in parts):
        _lacks(path, "sample", key, parts, ("tokens.npy", "meta.json") if meta else ("tokens.npy",))
    if ("offsets.npy" in parts) != clusters:
        _check_layout(path, "sample", key, parts, clusters, meta)
    tokens = _unsigned(path, key, "tokens.npy", parts["tokens.npy"])
    offsets = None
    if clusters:
        offsets = _unsigned(path, key, "offsets.npy", parts["offsets.npy"])
        why = check_offsets(offsets, len(tokens))
        if why is not None:
            raise ShardError(f"{path}: corrupt member {key}.offsets.npy ({why})")
    tokens = _token_ids(path, key, tokens, vocab_size)
    if meta:
        return key, tokens, offsets, _json(path, key, "meta.json", parts["meta.json"])
    return (key, tokens, offsets) if clusters else (key, tokens)


def block_index(keys_txt: bytes | memoryview, bounds: np.ndarray, n_tokens: int,
                offsets: np.ndarray | None = None) -> tuple[list[str], np.ndarray | None]:
    """A block's keys, checked against its bounds (and, for clusters, the position of every bound among the member
    offsets: sample i's members are offsets[idx[i]:idx[i + 1] + 1]); ValueError naming the member at fault.
    ``bounds`` [n + 1] and ``offsets`` [members + 1] are the decoded .npy arrays."""
    try:
        keys = bytes(keys_txt).decode("ascii").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"keys.txt: not ASCII ({e})") from None
    if bounds.ndim != 1 or bounds.dtype.kind != "u":
        raise ValueError(f"bounds.npy: holds {bounds.dtype} {bounds.shape}, expected 1-D unsigned")
    if len(bounds) != len(keys) + 1:
        raise ValueError(f"bounds.npy: {len(bounds)} bounds for {len(keys)} keys (expected keys + 1)")
    if int(bounds[0]) != 0 or int(bounds[-1]) != n_tokens or (bounds[1:] < bounds[:-1]).any():
        raise ValueError(f"bounds.npy: bounds run from {int(bounds[0])} to {int(bounds[-1])} (non-decreasing "
                         f"expected, 0 to {n_tokens}, the tokens)")
    idx = None
    if offsets is not None:
        why = check_offsets(offsets, n_tokens)
        if why is not None:
            raise ValueError(f"offsets.npy: {why}")
        idx = np.searchsorted(offsets, bounds)
        if (idx >= len(offsets)).any() or (offsets[np.minimum(idx, len(offsets) - 1)] != bounds).any():
            raise ValueError("offsets.npy: a sample bound is not a member boundary")
    return keys, idx


def _block(path: Path, key: str, parts: dict, clusters: bool, meta: bool, vocab_size: int | None) -> list:
    """The samples of block ``key`` (format 2), shaped as :func:`_read` returns them: views of the block's tokens
    [bounds[-1]], a cluster's offsets relative to its sample."""
    _lacks(path, "block", key, parts, ("keys.txt", "bounds.npy", "tokens.npy") + (("meta.json",) if meta else ()))
    _check_layout(path, "block", key, parts, clusters, meta)
    tokens = _unsigned(path, key, "tokens.npy", parts["tokens.npy"])
    bounds = _unsigned(path, key, "bounds.npy", parts["bounds.npy"])  # uint64 [n + 1]
    offsets = _unsigned(path, key, "offsets.npy", parts["offsets.npy"]) if clusters else None  # [members + 1]
    try:
        keys, idx = block_index(parts["keys.txt"], bounds, len(tokens), offsets)
    except ValueError as e:
        raise ShardError(f"{path}: corrupt member {key}.{e}") from None
    if vocab_size is not None and tokens.size and np.iinfo(tokens.dtype).max >= vocab_size \
            and int(tokens.max()) >= vocab_size:  # one max per block; past the vocabulary, name the sample
        i = int(np.searchsorted(bounds, int(np.argmax(tokens)), side="right")) - 1
        _token_ids(path, keys[i], tokens[int(bounds[i]):int(bounds[i + 1])], vocab_size)
    b = bounds.tolist()
    if clusters:
        offs = [offsets[idx[i]:idx[i + 1] + 1] - np.uint64(b[i]) for i in range(len(keys))]
    if meta:
        metas = _json(path, key, "meta.json", parts["meta.json"])
        if not isinstance(metas, list) or len(metas) != len(keys):
            raise ShardError(f"{path}: corrupt member {key}.meta.json (expected a JSON array of {len(keys)} "
                             "objects)")
        return [(k, tokens[b[i]:b[i + 1]], offs[i] if clusters else None, metas[i]) for i, k in enumerate(keys)]
    if clusters:
        return [(k, tokens[b[i]:b[i + 1]], offs[i]) for i, k in enumerate(keys)]
    return [(k, tokens[b[i]:b[i + 1]]) for i, k in enumerate(keys)]
