"""The records of our shards for a plain ``webdataset.WebDataset`` reader.

WebDataset groups a tar's members by key, so on a data_prep shard it yields one sample per *block* (``__key__``
``block000000`` and the bytes of its ``keys.txt``, ``bounds.npy``, ``tokens.npy``, ``meta.json`` and, for clusters,
``offsets.npy``: up to 2048 records; pipeline/data/shards.py). :func:`records` (a ``.compose`` stage) and
:func:`block_records` (one sample) turn those into one dict per record, decoded and checked by the project's reader
(shard_reader.group_samples), so they hold what read_shard / read_clusters return:

* sequences: ``{"__key__": key, "tokens": uint ndarray [length], "meta": dict}``
* clusters (``offsets.npy`` present): ``{"__key__": key, "members": [uint ndarray [length], ...], "meta": dict}``,
  never the members end to end as one sequence (what read_shard refuses too)

plus the sample's ``__url__`` when it has one (keys restart at 000000000000 in every shard). Format-1 samples (one
record each) pass through the same decoding. Apply them before any ``.decode()``: the members must still be bytes.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from pipeline.data.shard_reader import cluster_members, group_samples
from pipeline.data.shards import ShardError


def block_records(sample: dict) -> list[dict]:
    """The records of one WebDataset sample (a block or a format-1 record), in the shard's order; damage is a
    ShardError naming the URL and the member, as read_shard's errors do."""
    url = sample.get("__url__")
    where = url if url is not None else "webdataset sample"
    key = sample.get("__key__")
    if not isinstance(key, str):
        raise ShardError(f"{where}: a sample without a __key__ (not a WebDataset sample of a shard)")
    parts = {ext: raw for ext, raw in sample.items() if not ext.startswith("__")}
    for ext, raw in parts.items():
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ShardError(f"{where}: member {key}.{ext} is {type(raw).__name__}, not bytes (a .decode() stage "
                             "before the records? they decode the members themselves)")
    clusters = "offsets.npy" in parts
    out = []
    for k, tokens, offsets, meta in group_samples(where, key, parts, clusters=clusters, meta=True):
        if clusters:
            rec = {"__key__": k, "members": cluster_members(tokens, offsets), "meta": meta}
        else:
            rec = {"__key__": k, "tokens": tokens, "meta": meta}
        if url is not None:
            rec["__url__"] = url
        out.append(rec)
    return out


def records(samples: Iterable[dict]) -> Iterator[dict]:
    """``wds.WebDataset(urls).compose(records)``: one dict per record (:func:`block_records`) of every sample."""
    for sample in samples:
        yield from block_records(sample)
