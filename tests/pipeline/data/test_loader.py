import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from pipeline.config import load_config
from loader_checks import resumed_equals_uninterrupted, same, take
from pipeline.data.loader import ShardStream, make_loader
from pipeline.data.shards import load_manifest
from pipeline.data.tokenizer import NucleotideTokenizer
from pipeline.objectives.eco_rna import make_transform
from pipeline.objectives.masking import IGNORE_INDEX


def stream(shards, rank=0, world=1, workers=0, consumed=0, ctx=64, mb=4, shuffle=0):
    cfg = load_config(None, [f"data.context_length={ctx}"])
    return ShardStream(shards, rank=rank, world_size=world, num_workers=workers, micro_batch_size=mb, seed=7,
                       transform=make_transform(cfg), pad_id=0, batches_consumed=consumed, shuffle_buffer=shuffle)




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


def test_shuffle_buffer_mixes_neighbouring_shards_and_keeps_each_epoch_a_permutation(sample_shards):
    """Windows of 500 samples over a stream's two 300-sample shards: the epoch holds the same samples, reordered
    across the shard boundary; the stream resumes from a mid-window count alone."""
    def epoch(shuffle, skip=0):
        ds = stream(sample_shards, shuffle=shuffle, world=4)  # 8 shards / 4 ranks: 2 shards in the stream's epoch
        total = sum(int(ds.counts[s]) for s in ds.stream_shards(0, 0))
        return list(itertools.islice((s["sample_id"] for s in ds.samples(0, skip)), total - skip))

    plain, mixed = epoch(0), epoch(500)
    assert sorted(plain) == sorted(mixed) and plain != mixed and len(plain) > 500
    shard_of = [sid.split("/")[0] for sid in mixed]
    first, second = plain[0].split("/")[0], plain[-1].split("/")[0]
    assert first != second
    assert {first, second} <= set(shard_of[:100])  # both shards early in the shuffled epoch, not one after the other
    assert epoch(500, skip=321) == mixed[321:]
    with pytest.raises(ValueError, match="shuffle_buffer 0 differs from this loader's 500"):
        stream(sample_shards, shuffle=500).load_state_dict(stream(sample_shards).state_dict())


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
    with pytest.raises(ValueError, match=r"8 shards < 12 loader streams \(3 per rank x 4 ranks\)"):
        stream(sample_shards, world=4, workers=3)


# --------------------------------------------------------------------------------------------------------------------
# state_dict / load_state_dict, mixtures, token budgets, packing, brace URLs
# --------------------------------------------------------------------------------------------------------------------
def mixture(shards, rank=0, world=2, workers=2, mb=4, max_tokens=None, pack=False, separator=None, ctx=64, row=None):
    """Two named sources over the same shards (distinct seeds, so distinct streams) with a step-dependent schedule."""
    from pipeline.data.mixture import MixtureSchedule
    from pipeline.data.streams import Source

    cfg = load_config(None, [f"data.context_length={ctx}"])
    sched = MixtureSchedule.from_stages(["a", "b"], [
        {"until_step": 5, "weights": {"a": 0.7, "b": 0.3}},
        {"until_step": 15, "ramp": "linear", "weights": {"a": 0.7, "b": 0.3}, "end_weights": {"a": 0.1, "b": 0.9}},
        {"weights": {"a": 0.5, "b": 0.5}}])
    return ShardStream([Source("a", shards), Source("b", shards)], rank=rank, world_size=world, num_workers=workers,
                       micro_batch_size=mb, seed=3, transform=make_transform(cfg), pad_id=0, mixture=sched,
                       grad_accum_steps=2, max_tokens=max_tokens, pack=pack, pack_separator=separator,
                       row_length=row or ctx)



@pytest.mark.parametrize("kind", ["single", "shuffle_buffer", "mixture"])
def test_state_dict_resume_2_workers_x_2_ranks_yields_exactly_the_rest(sample_shards, kind):
    """Acceptance 3: resumed mid-epoch from a state_dict, each of 2 ranks x 2 workers continues its exact stream."""
    per_rank = []
    for rank in (0, 1):
        if kind != "mixture":
            def make():  # a 500-sample shuffle window: the cut at batch 37 lies inside the first window
                return stream(sample_shards, rank=rank, world=2, workers=2, shuffle=500 * (kind == "shuffle_buffer"))
        else:
            def make():
                return mixture(sample_shards, rank=rank)
        # ~600 samples per stream-epoch (2 of the 8 shards) at 4 per batch: the cut at 37 is mid-epoch and 2 x 170
        # batches run into the 2nd epoch
        full = resumed_equals_uninterrupted(make, 2, 340, 37)
        ids = [s for b in full for s in b.sample_ids]
        assert any(s.endswith("@1") for s in ids)
        per_rank.append(set(ids))
    assert not per_rank[0] & per_rank[1]  # ranks read disjoint samples


def test_legacy_batches_consumed_equals_the_state_dict(sample_shards):
    loader = make_loader(stream(sample_shards, workers=2), 2)
    list(itertools.islice(loader, 9))
    st = loader.state_dict()
    legacy = stream(sample_shards, workers=2, consumed=9).state_dict()
    for a, b in zip(st["streams"], legacy["streams"]):
        assert (a["draws"], a["batches"], a["taken"], a["pending"]) == (b["draws"], b["batches"], b["taken"], -1)
    assert st["batches_consumed"] == legacy["batches_consumed"] == 9
    with pytest.raises(ValueError, match="loader state: 2 streams of layout"):
        make_loader(stream(sample_shards, workers=0), 0).load_state_dict(st)


def test_token_budget_batches_respect_the_budget_and_resume_exactly(sample_shards):
    budget = 1024  # Rfam lengths vary within the 256-token context, so the row count varies
    full = resumed_equals_uninterrupted(lambda: mixture(sample_shards, max_tokens=budget, ctx=256), 2, 120, 53)
    sizes = [b.input_ids.shape[0] for b in full]
    assert all(b.input_ids.numel() <= budget for b in full)  # padded tokens B x L
    assert len(set(sizes)) > 2 and max(sizes) > 4  # dynamic: more short rows, fewer long ones
    # greedy: the first sample of a stream's next batch would not have fit into its previous batch
    last = {}
    for b in full:
        if b.stream in last:
            prev = last[b.stream]
            first_len = int(b.attention_mask[0].sum())
            assert (prev.input_ids.shape[0] + 1) * max(prev.input_ids.shape[1], first_len) > budget
        last[b.stream] = b


def test_packing_rows_documents_and_resume(sample_shards):
    from pipeline.data.tokenizer import NucleotideTokenizer as tok

    ctx = 256  # row length; documents are cropped to 64 tokens by the transform
    full = resumed_equals_uninterrupted(lambda: mixture(sample_shards, pack=True, row=ctx), 2, 40, 13)
    for b in full:
        assert b.input_ids.shape == (4, ctx) and b.document_ids.shape == b.position_ids.shape == (4, ctx)
        for r in range(4):
            doc, pos, ids = b.document_ids[r], b.position_ids[r], b.input_ids[r]
            n_docs = int(doc.max()) + 1
            assert n_docs >= 1 and torch.equal(b.attention_mask[r], doc >= 0)
            for d in range(n_docs):
                sel = (doc == d).nonzero().flatten()
                assert torch.equal(sel, torch.arange(int(sel[0]), int(sel[-1]) + 1))  # contiguous
                assert torch.equal(pos[sel], torch.arange(len(sel)))  # positions restart per document
                assert ids[sel[0]] == tok.cls_id and ids[sel[-1]] == tok.eos_id  # each framed document ends <eos>
        assert sum(int(b.document_ids[r].max()) + 1 for r in range(4)) == len(b.sample_ids)
    # rows hold several documents and are nearly full
    rows = [int(b.document_ids[r].max()) + 1 for b in full for r in range(4)]
    assert min(rows) >= 4 and np.mean([float(b.attention_mask.float().mean()) for b in full]) > 0.85
    # explicit separator: one extra token after every document, supervised as itself
    b = take(mixture(sample_shards, workers=0, pack=True, separator=tok.sep_id, row=ctx), 0, 1)[0]
    ends = (b.document_ids[:, 1:] != b.document_ids[:, :-1]) & (b.document_ids[:, :-1] >= 0)
    assert torch.all(b.input_ids[:, :-1][ends] == tok.sep_id) and torch.all(b.labels[:, :-1][ends] == tok.sep_id)


def test_brace_urls_without_manifest_give_the_same_stream(sample_shards, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    plain.mkdir()
    for t in sorted(sample_shards.glob("*.tar")):
        shutil.copy(t, plain / t.name)  # no manifest.json: counts come from reading each tar once
    url = str(plain / "rnacentral-{000000..000007}.tar")
    a = take(stream(sample_shards, world=2, workers=2), 2, 30)
    b = take(stream(url, world=2, workers=2), 2, 30)
    assert all(same(x, y) for x, y in zip(a, b))
    with pytest.raises(FileNotFoundError, match="shard .*rnacentral-000008.tar does not exist"):
        stream(str(plain / "rnacentral-{000000..000009}.tar"))


def test_fast_token_decode_equals_np_load_and_rejects_corrupt_members():
    import io

    from pipeline.data.shard_reader import decode_tokens

    def npy(a):
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=False)
        return buf.getvalue()

    for a in (np.array([], np.uint8), np.arange(7, dtype=np.uint8), np.arange(70000) % 65535,
              (np.arange(300) * 7919).astype(np.uint16), np.arange(5, dtype=np.uint32), np.arange(6, dtype=np.int64)):
        got = decode_tokens(npy(a))
        assert got.dtype == a.dtype and np.array_equal(got, a)
    raw = npy(np.arange(100, dtype=np.uint8))
    with pytest.raises(ValueError, match="99 data bytes for 100"):
        decode_tokens(raw[:-1])
    with pytest.raises(ValueError):  # a non-npy member goes to np.load, which refuses it
        decode_tokens(b"garbage, not an array")


def test_a_batch_lost_with_its_worker_is_a_dead_worker():
    """A DataLoader worker killed while the rank receives its batch's shared tensor surfaces as EOFError (or a reset
    connection) from multiprocessing's resource sharer, not as torch's RuntimeError; StreamLoader reads it as the
    dead worker it is (here a second death: WorkerDied, one line). With every worker alive the error is not a death
    and stays as it is."""
    import multiprocessing
    import time

    from pipeline.data.loader import StreamLoader, WorkerDied

    class Data:
        rank = 0

        def state_dict(self):
            return {}

    class Receiving:  # the running DataLoader's iterator, as StreamLoader sees it
        def __init__(self, workers, error):
            self._workers, self.error = workers, error

        def __next__(self):
            raise self.error

    fork = multiprocessing.get_context("fork")
    dead, alive = fork.Process(target=int), fork.Process(target=time.sleep, args=(60,))
    dead.start()
    dead.join()
    alive.start()
    try:
        for error in (EOFError(), ConnectionResetError(104, "Connection reset by peer")):
            loader = StreamLoader(Data(), 2)
            loader.worker_died = "data loader worker 1 of rank 0 (pid 1) was killed by SIGKILL while reading a.tar"
            loader._it = Receiving([alive, dead], error)
            with pytest.raises(WorkerDied, match=f"data loader worker 1 of rank 0 \\(pid {dead.pid}\\) exited with "
                                                 "status 0"):
                next(loader)
            loader._it = Receiving([alive], error)
            with pytest.raises(type(error)):
                next(loader)
    finally:
        alive.kill()
        alive.join()
