"""Checks shared by the loader tests: take batches, compare batches, and resume from a state_dict."""
import itertools
import json

import torch

from pipeline.data.loader import make_loader


def take(ds, workers, n):
    return list(itertools.islice(make_loader(ds, workers), n))


def same(a, b):
    return (a.sample_ids == b.sample_ids and torch.equal(a.input_ids, b.input_ids)
            and torch.equal(a.labels, b.labels) and torch.equal(a.attention_mask, b.attention_mask))


def resumed_equals_uninterrupted(make, workers, total, cut):
    """Take ``cut`` batches, checkpoint the state (through JSON, as in client_state.json), resume in a fresh loader:
    the rest is identical to the uninterrupted stream. Returns the uninterrupted batches."""
    full = take(make(), workers, total)
    loader = make_loader(make(), workers)
    head = list(itertools.islice(loader, cut))
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = make_loader(make(), workers)
    resumed.load_state_dict(state)
    tail = list(itertools.islice(resumed, total - cut))
    assert [b.sample_ids for b in head + tail] == [b.sample_ids for b in full]
    assert all(same(a, b) for a, b in zip(full, head + tail))
    return full
