"""A checkpoint's loader position continues on another world size (reshard_states): the same microbatches make each
optimizer step, and an epoch is read exactly once across the change, checked by sample ids on the real Rfam shards."""
import itertools
import json
from collections import Counter

import pytest

from pipeline.config import load_config
from pipeline.data.loader import ShardStream, make_loader
from pipeline.data.streams import reshard_states, resolve_shards
from pipeline.objectives.eco_rna import make_transform


def dataset(shards, rank, world, ga, streams=None, seed_width=None, workers=0, window=0, budget=None):
    cfg = load_config(None, ["data.context_length=64"])
    return ShardStream(shards, rank=rank, world_size=world, num_workers=workers, micro_batch_size=4, seed=11,
                       transform=make_transform(cfg), pad_id=0, grad_accum_steps=ga, max_tokens=budget,
                       length_window=window, streams=streams, seed_width=seed_width)


def run(shards, world, ga, steps, states=None, streams=None, **kw):
    """``steps`` optimizer steps of ``world`` ranks x ``ga`` microbatches -> (sample ids per step, loader states)."""
    loaders = []
    for r in range(world):
        layout = states[r]["layout"] if states else {}
        loader = make_loader(dataset(shards, r, world, ga, layout.get("streams", streams), layout.get("seed_width"),
                                     **kw), kw.get("workers", 0))
        if states:
            loader.load_state_dict(json.loads(json.dumps(states[r])))  # as client_state.json holds it
        loaders.append(loader)
    per_step = [sorted(i for ld in loaders for b in itertools.islice(ld, ga) for i in b.sample_ids)
                for _ in range(steps)]
    return per_step, [ld.state_dict() for ld in loaders]


@pytest.mark.parametrize("kind", ["fixed", "windows"])
def test_two_ranks_continue_on_one_with_the_same_steps_and_one_epoch_exactly_once(sample_shards, kind):
    kw = {"window": 24, "budget": 256} if kind == "windows" else {}
    full, _ = run(sample_shards, 2, 2, 12, **kw)
    head, states = run(sample_shards, 2, 2, 5, **kw)
    tail, _ = run(sample_shards, 1, 4, 7, reshard_states(states, 1, 0), **kw)
    assert head + tail == full  # every step: the uninterrupted run's samples (token normalization: its loss)

    # A whole epoch across the change: each of the 2 streams reads its shards once before any sample repeats.
    total = int(sum(sh.samples for sh in resolve_shards(str(sample_shards))))
    head, states = run(sample_shards, 2, 2, 40, **kw)
    # >= 4 samples per microbatch, 2 per stream and step: each stream reads >= total samples, past its epoch 0
    tail, _ = run(sample_shards, 1, 4, total // 8, reshard_states(states, 1, 0), **kw)
    ids = [i for step in head + tail for i in step]
    epoch0 = Counter(i.rsplit("@", 1)[0] for i in ids if i.endswith("@0"))
    assert len(epoch0) == total and set(epoch0.values()) == {1}


def test_one_rank_with_two_streams_continues_on_two_ranks_and_workers_may_change(sample_shards):
    full, _ = run(sample_shards, 1, 4, 10, streams=2)
    head, states = run(sample_shards, 1, 4, 4, streams=2)
    tail, _ = run(sample_shards, 2, 2, 6, reshard_states(states, 2, 0))
    assert head + tail == full
    # the same world size with 2 DataLoader workers instead of none reads the same streams
    tail, _ = run(sample_shards, 1, 4, 6, reshard_states(states, 1, 2), workers=2)
    assert head + tail == full


def test_streams_that_cannot_be_divided_are_one_clear_error(sample_shards):
    _, states = run(sample_shards, 1, 4, 2)  # the default layout: 1 stream
    with pytest.raises(ValueError, match=r"dealt into 1 loader streams .* cannot be divided among 2 ranks"):
        reshard_states(states, 2, 0)
    _, states = run(sample_shards, 2, 2, 2)
    with pytest.raises(ValueError, match=r"3 workers cannot share the 2 loader streams"):
        reshard_states(states, 1, 3)


def test_a_state_from_before_layouts_reshards_with_its_implied_layout(sample_shards):
    full, _ = run(sample_shards, 2, 2, 8)
    head, states = run(sample_shards, 2, 2, 3)
    for st in states:  # what checkpoints of format 2 hold: no layout entry
        del st["layout"]
    tail, _ = run(sample_shards, 1, 4, 5, reshard_states(states, 1, 0))
    assert head + tail == full
