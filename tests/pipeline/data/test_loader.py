import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from pipeline.config import load_config
from pipeline.data.loader import ShardStream, make_loader
from pipeline.data.shards import load_manifest
from pipeline.data.tokenizer import NucleotideTokenizer
from pipeline.objectives.eco_rna import make_transform
from pipeline.objectives.masking import IGNORE_INDEX


def stream(shards, rank=0, world=1, workers=0, consumed=0, ctx=64, mb=4):
    cfg = load_config(None, [f"data.context_length={ctx}"])
    return ShardStream(shards, rank=rank, world_size=world, num_workers=workers, micro_batch_size=mb, seed=7,
                       transform=make_transform(cfg), pad_id=0, batches_consumed=consumed)


def take(ds, workers, n):
    return list(itertools.islice(make_loader(ds, workers), n))


def same(a, b):
    return (a.sample_ids == b.sample_ids and torch.equal(a.input_ids, b.input_ids)
            and torch.equal(a.labels, b.labels) and torch.equal(a.attention_mask, b.attention_mask))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_the_exact_batch_sequence(sample_shards, workers):
    """Batches N.. of a fresh loader equal the batches of a loader resumed at N, across epoch boundaries too."""
    full = take(stream(sample_shards, workers=workers), workers, 40)
    for n in (1, 7, 13):
        resumed = take(stream(sample_shards, workers=workers, consumed=n), workers, 40 - n)
        assert all(same(a, b) for a, b in zip(full[n:], resumed))
    # jump far: two and a half epochs of a 2-rank stream, skipped by manifest counts alone
    far = 2 * 1100 // 4
    a = take(stream(sample_shards, world=2, workers=workers), workers, far + 3)[far:]
    b = take(stream(sample_shards, world=2, workers=workers, consumed=far), workers, 3)
    assert all(same(x, y) for x, y in zip(a, b))


def test_workers_do_not_change_the_sample_content(sample_shards):
    """A sample's crop and mask depend only on (seed, epoch, shard, index), not on which worker read it."""
    by_id = {}
    for workers in (0, 2):
        for b in take(stream(sample_shards, workers=workers), workers, 30):
            for i, sid in enumerate(b.sample_ids):
                row = (b.input_ids[i][b.attention_mask[i]].tolist(), b.labels[i][b.attention_mask[i]].tolist())
                assert by_id.setdefault(sid, row) == row


def test_ranks_partition_each_epoch(sample_shards):
    """In one epoch every sample is read exactly once across ranks."""
    manifest = load_manifest(sample_shards)
    seen = Counter()
    for rank in range(2):
        ds = stream(sample_shards, rank=rank, world=2)
        shards = ds.stream_shards(0, epoch=0)
        total = sum(manifest.shards[s].samples for s in shards)
        it = ds.samples(0, 0)
        seen.update(next(it)["sample_id"] for _ in range(total))
    assert len(seen) == manifest.total_samples and set(seen.values()) == {1}
    assert all(s.endswith("@0") for s in seen)


def test_batch_contents_are_framed_masked_and_cropped(sample_shards):
    tok = NucleotideTokenizer
    for b in take(stream(sample_shards, ctx=32), 0, 20):
        assert b.input_ids.shape[1] <= 32
        lengths = b.attention_mask.sum(1)
        assert torch.all(b.input_ids[:, 0] == tok.cls_id)
        assert torch.all(b.input_ids[torch.arange(len(lengths)), lengths - 1] == tok.eos_id)
        assert torch.all(b.input_ids[~b.attention_mask] == tok.pad_id)
        sup = b.labels != IGNORE_INDEX
        assert torch.all(sup.sum(1) >= 1) and torch.all(b.labels[sup] >= tok.num_special)
        assert not torch.any(b.input_ids == tok.vocab.index("T"))  # RNA source: T written as U
    ids = np.concatenate([b.labels[b.labels != IGNORE_INDEX].numpy() for b in take(stream(sample_shards), 0, 50)])
    mask_frac = np.mean(np.concatenate([
        (b.input_ids[b.labels != IGNORE_INDEX] == tok.mask_id).numpy() for b in take(stream(sample_shards), 0, 50)]))
    assert 0.7 < mask_frac < 0.9 and set(np.unique(ids)) <= set(range(tok.num_special, tok.vocab_size))


def test_too_few_shards_is_a_clear_error(sample_shards):
    with pytest.raises(ValueError, match=r"8 shards < 4 ranks x 3 loader streams"):
        stream(sample_shards, world=4, workers=3)
