"""Length-aware batching (data.length_window): windows of W draws sorted by length, cut into microbatches, emitted in
a seeded order; exact resume at every batch, every sample once, the budget kept, and the padding it removes.

Shards: the shipped Rfam sample as 8 shards (conftest.sample_shards, real data_prep CLI); the padding test also uses
the RNAcentral test set from ../shared when present.
"""
import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loader_checks import same, take
from pipeline.config import ConfigError, load_config
from pipeline.data.loader import ShardStream, make_loader
from pipeline.data.mixture import MixtureSchedule
from pipeline.data.streams import Source
from pipeline.objectives.eco_rna import make_transform

REPO = Path(__file__).resolve().parents[3]
RNACENTRAL = REPO.parent / "shared" / "data" / "rna" / "rnacentral_ncrna6_testset.fasta"


def stream(shards, *, window=0, mb=4, budget=None, ctx=128, workers=0, rank=0, world=1, mixture=False, seed=7,
           shuffle=0, mix=4):
    transform = make_transform(load_config(None, [f"data.context_length={ctx}"]))
    kw = dict(rank=rank, world_size=world, num_workers=workers, micro_batch_size=mb, seed=seed, transform=transform,
              pad_id=0, max_tokens=budget, length_window=window, shuffle_buffer=shuffle, grad_accum_steps=2,
              mix_shards=mix)
    if not mixture:
        return ShardStream(shards, **kw)
    # a schedule that moves every few steps: the window's weights are those of its first microbatch's step
    sched = MixtureSchedule.from_stages(["a", "b"], [
        {"until_step": 3, "weights": {"a": 0.8, "b": 0.2}},
        {"until_step": 9, "ramp": "linear", "weights": {"a": 0.8, "b": 0.2}, "end_weights": {"a": 0.1, "b": 0.9}},
        {"weights": {"a": 0.5, "b": 0.5}}])
    return ShardStream([Source("a", shards), Source("b", shards)], mixture=sched, **kw)


def ratio(batches) -> float:
    """Tokens computed (rows x padded length) / real tokens."""
    return sum(b.input_ids.numel() for b in batches) / sum(int(b.attention_mask.sum()) for b in batches)


def reference_window_batches(ds, n_windows: int) -> list[list[str]]:
    """Sample ids per batch of stream 0's first windows, built straight from the spec on the loader's sample stream
    (single source: draw k is sample k of the source's stream): sort by length (stable), cut greedily, permute with
    the window's seed."""
    W, samples = ds.length_window, ds.samples(0, 0)
    out = []
    for i in range(n_windows):
        window = [next(samples) for _ in range(W)]
        ranked = sorted(window, key=lambda s: len(s["input_ids"]))  # sorted() is stable
        groups, cur = [], []
        for s in ranked:
            n = len(s["input_ids"])
            full = len(cur) == ds.micro_batch_size if not ds.max_tokens else (len(cur) + 1) * n > ds.max_tokens
            if cur and full:
                groups.append(cur)
                cur = []
            cur.append(s["sample_id"])
        groups.append(cur)
        perm = np.random.default_rng([ds.seed, ds.rank, 0, i, W, 0x6C656E]).permutation(len(groups))
        out += [groups[j] for j in perm]
    return out


@pytest.mark.parametrize("kind", ["fixed", "budget"])
def test_batches_equal_a_straightforward_reference_and_keep_the_budget(sample_shards, kind):
    budget = 2048 if kind == "budget" else None  # Rfam lengths vary across the 512-token context
    ds = stream(sample_shards, window=192, budget=budget, ctx=512)
    expected = reference_window_batches(ds, 3)
    got = take(ds, 0, len(expected))
    assert [b.sample_ids for b in got] == expected
    if budget:
        assert all(b.input_ids.numel() <= budget for b in got)  # rows x padded length
        assert len({len(b.sample_ids) for b in got}) > 3  # many short rows, fewer long ones
    else:
        assert {len(b.sample_ids) for b in got} == {4}  # 192 = 48 x 4: no short microbatch
    # a microbatch holds neighbours in length order: a fraction of the draw-order batches' padding
    plain = take(stream(sample_shards, budget=budget, ctx=512), 0, len(got))
    assert ratio(got) - 1 < 0.25 * (ratio(plain) - 1), (ratio(got), ratio(plain))


def test_every_sample_once_with_the_content_it_has_in_draw_order(sample_shards):
    """Over whole windows the windowed loader emits exactly the samples of the draw-order loader (length_window 0),
    each once per epoch, each with identical tokens, labels and mask."""
    W, n_windows = 120, 6  # 720 draws: a stream-epoch of the 8 x ~263-sample shards on one rank is ~2100
    for budget in (None, 3000):
        plain = take(stream(sample_shards), 0, W * n_windows // 4)
        rows = {sid: (b.input_ids[i][b.attention_mask[i]], b.labels[i][b.attention_mask[i]])
                for b in plain for i, sid in enumerate(b.sample_ids)}
        loader, windowed = make_loader(stream(sample_shards, window=W, budget=budget), 0), []
        while not windowed or windowed[-1].state["draws"] < W * n_windows or windowed[-1].state["window_batches"]:
            windowed.append(next(loader))
        ids = [s for b in windowed for s in b.sample_ids]
        assert Counter(ids) == Counter(list(rows)) and len(set(ids)) == len(ids) == W * n_windows
        for b in windowed:
            for i, sid in enumerate(b.sample_ids):
                m = b.attention_mask[i]
                assert (b.input_ids[i][m].equal(rows[sid][0]) and b.labels[i][m].equal(rows[sid][1])
                        and bool(m[:int(m.sum())].all()))
        assert windowed[-1].state["taken"] == windowed[-1].state["window_taken"] == [W * n_windows]
    # one full pass: every sample of the rank's epoch exactly once
    ds = stream(sample_shards, window=W, world=2)
    epoch = int(sum(ds.counts[s] for s in ds.stream_shards(0, 0)))
    ids = [s for b in take(ds, 0, 2 * epoch // 4) for s in b.sample_ids]
    first = [s for s in ids if s.endswith("@0")]
    assert len(first) == len(set(first)) == epoch


def states_and_batches(make, workers, n):
    loader = make_loader(make(), workers)
    batches, states = [], [json.loads(json.dumps(loader.state_dict()))]
    for b in itertools.islice(loader, n):
        batches.append(b)
        states.append(json.loads(json.dumps(loader.state_dict())))  # as client_state.json stores it
    return batches, states


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["fixed", "budget", "mixture"])
def test_resume_at_every_batch_inside_and_across_windows(sample_shards, workers, kind):
    """Resumed from the state after each of the first n batches (through JSON, as client_state.json stores it), the
    loader continues with the identical batches (ids, tokens, labels, mask) and states, for at least a window and a
    half of every stream. Windows of 24 draws: 6 batches of 4, or about 3-8 with a 512-token budget."""
    def make():  # one shard at a time (mix_shards 1): a resume reads one shard per source, not four
        return stream(sample_shards, window=24, workers=workers, budget=512 if kind == "budget" else None,
                      mixture=kind == "mixture", mix=1)

    ahead = 10 * max(1, workers)
    n = 20 * max(1, workers)  # >= 3 windows per stream
    full, states = states_and_batches(make, workers, n + ahead)
    assert len({(b.stream, b.state["draws"]) for b in full[:n]}) >= 3 * max(1, workers)
    if kind == "mixture":
        assert {s for b in full for s in b.sources} == {"a", "b"}
    for cut in range(0, n + 1, 1 if workers == 0 else 3):  # 2 workers: every 3rd cut (each starts 2 processes)
        resumed = make_loader(make(), workers)
        resumed.load_state_dict(states[cut])
        tail = list(itertools.islice(resumed, ahead))
        assert all(same(a, b) for a, b in zip(full[cut:cut + ahead], tail)), cut
        assert resumed.state_dict() == states[cut + ahead], cut


def test_seen_counts_exactly_the_emitted_samples_under_a_moving_mixture(sample_shards):
    """seen() is exact per batch; each window draws its sources with the weights of its first microbatch's step."""
    from pipeline.data.mixture import SourceChooser

    ds = stream(sample_shards, window=48, budget=1024, mixture=True)
    loader, counts, windows = make_loader(ds, 0), Counter(), [Counter()]
    firsts = [0]  # index of each window's first microbatch
    for j, b in enumerate(itertools.islice(loader, 60)):
        for src, n in zip(b.sources, b.attention_mask.sum(1).tolist()):
            counts[src, "samples"] += 1
            counts[src, "tokens"] += n
            windows[-1][src] += 1
        assert loader.seen() == {s: (counts[s, "samples"], counts[s, "tokens"]) for s in ("a", "b")}
        if b.state["window_batches"] == 0:  # the window's last batch
            windows.append(Counter())
            firsts.append(j + 1)
    chooser = SourceChooser(ds.seed, 0, 0)
    names = ["a", "b"]
    for i, (got, first) in enumerate(zip(windows[:-1], firsts)):
        weights = ds.mixture.weights(first // 2)  # grad_accum_steps 2, one stream
        assert got == Counter(names[chooser.choose(k, weights)] for k in range(48 * i, 48 * i + 48)), i
    assert len(windows) > 4 and windows[0]["a"] > windows[0]["b"] and windows[-2]["b"] > windows[-2]["a"]


def test_state_format_old_states_and_a_changed_window(sample_shards):
    old = make_loader(stream(sample_shards), 0)
    list(itertools.islice(old, 5))
    v1 = old.state_dict()
    v1["version"] = 1  # what a checkpoint of the loader before length windows holds
    del v1["length_window"]
    for st in v1["streams"]:
        del st["window_taken"], st["window_batches"]
    plain = make_loader(stream(sample_shards), 0)
    plain.load_state_dict(v1)
    assert all(same(a, b) for a, b in zip(take(stream(sample_shards), 0, 12)[5:], itertools.islice(plain, 7)))
    with pytest.raises(ValueError, match=r"length_window 0 differs from this loader's 48 \(data.length_window must "
                                         r"not change on resume; set data.length_window=0"):
        make_loader(stream(sample_shards, window=48), 0).load_state_dict(v1)
    windowed = make_loader(stream(sample_shards, window=48), 0)
    list(itertools.islice(windowed, 3))
    st = windowed.state_dict()
    assert st["version"] == 2 and st["length_window"] == 48 and st["streams"][0]["window_batches"] == 3
    with pytest.raises(ValueError, match=r"length_window 48 differs from this loader's 96.*data.length_window=48"):
        make_loader(stream(sample_shards, window=96), 0).load_state_dict(st)
    with pytest.raises(ValueError, match="batches_consumed count alone"):
        stream(sample_shards, window=48).load_state_dict({"batches_consumed": 3})


def test_bad_windows_are_one_error_naming_the_field(sample_shards):
    with pytest.raises(ValueError, match=r"^data.length_window: 50 is not a multiple of train.micro_batch_size 4"):
        stream(sample_shards, window=50)
    with pytest.raises(ValueError, match=r"^data.length_window: must be >= 0"):
        stream(sample_shards, window=-1)
    with pytest.raises(ConfigError, match=r"^data.length_window: must be >= 0"):
        load_config(None, ["data.length_window=-2"])
    with pytest.raises(ConfigError, match=r"data.length_window: cannot be combined with data.pack"):
        load_config(REPO / "launchers" / "configs" / "recursive_gpt_demo.yaml", ["data.length_window=64"])
    with pytest.raises(ConfigError, match=r"^data.length_window: 12 < 16, the rows of one full microbatch of "
                                          r"train.max_tokens_per_microbatch 2048 at data.context_length 128"):
        load_config(None, ["train.max_tokens_per_microbatch=2048", "data.length_window=12"])
    assert load_config(None, ["train.max_tokens_per_microbatch=2048", "data.length_window=100"]).data.length_window


def rnacentral_shards(tmp_path) -> Path:
    out = tmp_path / "rnacentral"
    subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(RNACENTRAL), "--output", str(out),
                    "--shard-size", "1000"], cwd=REPO, check=True, capture_output=True)
    return out


def test_padding_ratio_on_the_shipped_sample(sample_shards):
    """Rfam ncRNAs (mostly 60-400 nt) at context 512, 32 rows or a 16,384-token budget: sorted windows of 2,048
    draws compute a few percent of padding instead of about half."""
    n = 2048 // 32  # one window
    before = ratio(take(stream(sample_shards, mb=32, ctx=512), 0, n))
    fixed = ratio(take(stream(sample_shards, mb=32, ctx=512, window=2048), 0, n))
    after = take(stream(sample_shards, ctx=512, budget=16384, window=2048), 0, 40)
    assert before > 1.5 and fixed < 1.05 and ratio(after) < 1.08, (before, fixed, ratio(after))


@pytest.mark.skipif(not RNACENTRAL.is_file(), reason=f"real RNAcentral test set not found at {RNACENTRAL} "
                                                      "(../shared/data is not mounted)")
def test_padding_ratio_on_rnacentral_at_context_1024(tmp_path):
    """6,001 RNAcentral ncRNAs of 16-11,420 nt at context 1024 with a 16,384-token budget: the draw order computes
    over 3 tokens per real one; sorted windows of 4,096 draws bring it to within 5%."""
    shards = rnacentral_shards(tmp_path)

    def one_window(ds):  # the batches of the first 4,096 draws
        loader, out = make_loader(ds, 0), []
        while sum(len(b.sample_ids) for b in out) < 4096:
            out.append(next(loader))
        return out

    before = ratio(one_window(stream(shards, ctx=1024, budget=16384)))
    after = ratio(one_window(stream(shards, ctx=1024, budget=16384, window=4096)))
    assert before > 2.5 and after < 1.05, (before, after)
