"""Resumable shard loader: deterministic per-rank sample streams with an exact position.

Streams. The shards of epoch ``e`` are permuted with seed (seed, e); with R ranks and W streams per rank (one per
DataLoader worker, or one without workers), stream w of rank r owns the shards at positions r*W + w, r*W + w + R*W,
... of that permutation. Inside a shard the samples are permuted with seed (seed, e, shard). Streams never end: after
its shards a stream continues with the next epoch. Every random choice for a sample (crop, masking) is seeded by
(seed, epoch, shard, index), so a sample's content never depends on who read it or when.

Position. The only state is the number of microbatches this rank has consumed, N. torch's DataLoader takes batches
from its workers in strict rotation, so batch j came from stream j mod W; after N batches stream w has given
ceil((N - w) / W) of them. A resumed loader therefore skips that many batches per stream, using the manifest's
per-shard counts to jump over whole epochs and shards without opening them, and rotates the streams so that the
next batch comes from stream N mod W.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.data.shards import ShardError, load_manifest, read_shard
from pipeline.objectives.masking import IGNORE_INDEX

# (tokens uint8 [n], rng) -> {"input_ids": int64 [L], "labels": int64 [L]}
SampleTransform = Callable[[np.ndarray, np.random.Generator], dict]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64
    labels: torch.Tensor  # [B, L] int64, IGNORE_INDEX where unsupervised
    attention_mask: torch.Tensor  # [B, L] bool, True at real tokens
    sample_ids: list  # B strings "shard/key@epoch"

    @property
    def num_supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device):
        return Batch(self.input_ids.to(device), self.labels.to(device), self.attention_mask.to(device),
                     self.sample_ids)


def collate(samples: list[dict], pad_id: int) -> Batch:
    L = max(len(s["input_ids"]) for s in samples)
    ids = np.full((len(samples), L), pad_id, dtype=np.int64)
    labels = np.full((len(samples), L), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(samples), L), dtype=bool)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], True
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(mask),
                 [s["sample_id"] for s in samples])


class ShardStream(IterableDataset):
    def __init__(self, shard_dir: str | Path, *, rank: int, world_size: int, num_workers: int, micro_batch_size: int,
                 seed: int, transform: SampleTransform, pad_id: int, batches_consumed: int = 0):
        self.shard_dir = Path(shard_dir)
        self.manifest = load_manifest(self.shard_dir)
        self.rank, self.world_size = rank, world_size
        self.num_streams = max(1, num_workers)
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self.transform, self.pad_id = transform, pad_id
        self.batches_consumed = batches_consumed
        n_shards, needed = len(self.manifest.shards), world_size * self.num_streams
        if n_shards < needed:
            raise ShardError(f"{self.shard_dir}: {n_shards} shards < {world_size} ranks x {self.num_streams} "
                             f"loader streams; reshard with a smaller --shard-size or use fewer workers")
        self.counts = np.array([s.samples for s in self.manifest.shards])

    def stream_shards(self, stream: int, epoch: int) -> np.ndarray:
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.counts))
        return perm[self.rank * self.num_streams + stream::self.world_size * self.num_streams]

    def samples(self, stream: int, skip: int) -> Iterator[dict]:
        """Infinite sample stream of ``stream``, starting after its first ``skip`` samples."""
        epoch = 0
        while True:
            shards = self.stream_shards(stream, epoch)
            total = int(self.counts[shards].sum())
            if total == 0:
                raise ShardError(f"{self.shard_dir}: stream {stream} of rank {self.rank} owns only empty shards")
            if skip >= total:  # jump a whole epoch by counts alone
                skip -= total
                epoch += 1
                continue
            for sid in shards:
                n = int(self.counts[sid])
                if skip >= n:
                    skip -= n
                    continue
                info = self.manifest.shards[sid]
                records = read_shard(self.shard_dir / info.path, expected_samples=n)
                order = np.random.default_rng([self.seed, epoch, int(sid)]).permutation(n)
                for j in order[skip:]:
                    key, tokens, _ = records[j]
                    rng = np.random.default_rng([self.seed, epoch, int(sid), int(j)])
                    sample = self.transform(tokens, rng)
                    sample["sample_id"] = f"{info.path}/{key}@{epoch}"
                    yield sample
                skip = 0
            epoch += 1

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        physical = info.id if info is not None else 0
        n, W = self.batches_consumed, self.num_streams
        stream = (physical + n) % W
        already = max(0, -(-(n - stream) // W))  # ceil((n - stream) / W) batches taken from this stream
        it = self.samples(stream, already * self.micro_batch_size)
        while True:
            yield collate([next(it) for _ in range(self.micro_batch_size)], self.pad_id)


def make_loader(dataset: ShardStream, num_workers: int) -> Iterator[Batch]:
    if num_workers == 0:
        return iter(dataset)
    return iter(DataLoader(dataset, batch_size=None, num_workers=num_workers, prefetch_factor=4,
                           persistent_workers=False))
