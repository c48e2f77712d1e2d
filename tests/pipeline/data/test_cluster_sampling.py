"""The loader's cluster sampling (ESM-2's UniRef50/90 scheme): a cluster sample trains on one member drawn uniformly
per (seed, epoch, sample), the same whatever the rank / worker count and across resume.

Shards: the UniRef sample shipped in data/samples (400 real UniRef50 clusters, 771 UniRef90 members), prepared by
the real data_prep CLI; no ../shared needed.
"""
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2

from data_prep.__main__ import main as prep
from loader_checks import resumed_equals_uninterrupted, same, take
from pipeline.data.loader import ShardStream
from pipeline.data.protein_tokenizer import CLS_ID, EOS_ID, PAD_ID
from pipeline.data.shard_reader import read_cluster_tokens, read_clusters
from pipeline.data.shards import ShardError, load_manifest
from pipeline.data.streams import Source

REPO = Path(__file__).resolve().parents[3]
SAMPLE_FASTA = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"
SAMPLE_TSV = REPO / "data" / "samples" / "uniref50_to_uniref90_sample.tsv"
CROP = 48  # residues kept by the test transform: a crop drawn from the sample's generator after the member


def crop_and_frame(tokens: np.ndarray, rng) -> dict:
    """(tokens, rng) -> dict like the families' transforms: a random crop (uses the generator after the member
    draw), then <cls> ... <eos>, every position supervised."""
    if len(tokens) > CROP:
        start = int(rng.integers(0, len(tokens) - CROP + 1))
        tokens = tokens[start:start + CROP]
    framed = np.concatenate([[CLS_ID], tokens, [EOS_ID]]).astype(np.int64)
    return {"input_ids": framed, "labels": framed}


def frame(tokens: np.ndarray, rng) -> dict:
    framed = np.concatenate([[CLS_ID], tokens, [EOS_ID]]).astype(np.int64)
    return {"input_ids": framed, "labels": framed}


def build(out: Path, rows=None, shard_size=25) -> Path:
    tsv = SAMPLE_TSV
    if rows is not None:  # a subset of the sample's clusters (its real lines, header first)
        lines = SAMPLE_TSV.read_text().splitlines(keepends=True)
        tsv = out.parent / f"{out.name}.tsv"
        tsv.write_text(lines[0] + "".join(lines[1 + r] for r in rows))
    assert prep(["uniref", "--input", str(SAMPLE_FASTA), "--clusters", str(tsv), "--output", str(out),
                 "--shard-size", str(shard_size)]) == 0
    return out


@pytest.fixture(scope="module")
def clusters(tmp_path_factory) -> Path:
    """All 400 clusters in 16 shards of 25."""
    return build(tmp_path_factory.mktemp("clusters") / "uniref")


@pytest.fixture(scope="module")
def multi(tmp_path_factory) -> Path:
    """The 47 clusters with 3 or more members (3 to 61), 16 a shard."""
    sizes = [len(ln.split("\t")[1].split(",")) for ln in SAMPLE_TSV.read_text().splitlines()[1:]]
    rows = [r for r, n in enumerate(sizes) if n >= 3]
    assert len(rows) == 47 and max(sizes) == 61
    return build(tmp_path_factory.mktemp("multi") / "multi", rows, shard_size=16)


def contents(directory: Path) -> dict:
    """'shard/key' -> (member token arrays, meta)."""
    out = {}
    for s in load_manifest(directory).shards:
        for key, members, meta in read_clusters(directory / s.path, s.samples):
            out[f"{s.path}/{key}"] = (members, meta)
    return out


def stream(shards, rank=0, world=1, workers=0, seed=11, mb=4, shuffle=0, transform=crop_and_frame, **kw):
    return ShardStream(shards, rank=rank, world_size=world, num_workers=workers, micro_batch_size=mb, seed=seed,
                       transform=transform, pad_id=PAD_ID, shuffle_buffer=shuffle, **kw)


def split(sample_id: str) -> tuple[str, int, int]:
    """'shard/key@epoch#member' -> ('shard/key', epoch, member)."""
    base, rest = sample_id.split("@")
    epoch, member = rest.split("#")
    return base, int(epoch), int(member)




def test_member_draw_is_uniform_over_epochs_and_redrawn_each_epoch(multi):
    """400 epochs over the 47 clusters of 3-61 members: each cluster's member counts pass a chi-square test of
    uniformity (p > 1e-4 each, about 0.5% for one of 47 true-uniform clusters to fail by chance; the test is
    deterministic for its seed), and so do all clusters pooled. A draw without the epoch in its seed (the same
    member every epoch) or one skewed to the first member fails it: p would be ~0."""
    info = contents(multi)
    n_members = {k: len(m) for k, (m, _) in info.items()}
    epochs = 400
    counts = defaultdict(Counter)
    it = stream(multi).samples(0, 0)
    for _ in range(epochs * len(info)):
        base, epoch, member = split(next(it)["sample_id"])
        counts[base][member] += 1
    assert set(counts) == set(info) and all(sum(c.values()) == epochs for c in counts.values())
    stats, dof = 0.0, 0
    for base, c in counts.items():
        k = n_members[base]
        assert set(c) <= set(range(k))
        observed = np.array([c[i] for i in range(k)], dtype=float)
        stat = float(((observed - epochs / k) ** 2).sum() / (epochs / k))
        assert chi2.sf(stat, k - 1) > 1e-4, (base, k, observed)
        if k <= 10:  # few members: every one of them is drawn in 400 epochs
            assert min(observed) > 0
        stats, dof = stats + stat, dof + k - 1
    assert chi2.sf(stats, dof) > 1e-3
    # the degenerate draws the docstring names would be rejected by this very statistic
    k = 5
    assert chi2.sf(((np.array([epochs, 0, 0, 0, 0]) - epochs / k) ** 2).sum() / (epochs / k), k - 1) < 1e-100


def test_the_transform_sees_the_drawn_member_and_a_single_member_cluster_always_gives_it(clusters):
    info = contents(clusters)
    singles = {k for k, (m, _) in info.items() if len(m) == 1}
    assert len(singles) == 305  # 400 clusters, 95 with 2 or more members
    seen_member = defaultdict(set)
    it = stream(clusters, transform=frame).samples(0, 0)
    for _ in range(3 * len(info)):  # three epochs
        s = next(it)
        base, epoch, m = split(s["sample_id"])
        members, meta = info[base]
        assert np.array_equal(s["input_ids"][1:-1], members[m])  # exactly the member's tokens, uncropped
        assert s["input_ids"][0] == CLS_ID and s["input_ids"][-1] == EOS_ID
        seen_member[base].add(m)
        assert meta["members"][m]  # the id of the drawn member is in the cluster's meta
    assert all(seen_member[b] == {0} for b in singles)
    assert any(len(seen_member[b]) > 1 for b in set(info) - singles)


def test_member_depends_on_seed_epoch_and_sample_only(clusters):
    """Same member for the same (epoch, sample) in fresh loaders and under any rank x worker split, with or without
    a shuffle window; another seed draws other members. The crop drawn after the member agrees too."""
    def draws(world, workers, shuffle=0, seed=11, epochs=3):
        out = {}
        for rank in range(world):
            ds = stream(clusters, rank=rank, world=world, workers=workers, shuffle=shuffle, seed=seed)
            per_stream_epoch = 400 // (world * max(1, workers))  # 16 equal shards dealt to world x workers streams
            n_batches = epochs * per_stream_epoch * max(1, workers) // 4
            for b in take(ds, workers, n_batches):
                for i, sid in enumerate(b.sample_ids):
                    base, epoch, member = split(sid)
                    row = b.input_ids[i][b.attention_mask[i]].tolist()
                    assert out.setdefault((base, epoch), (member, row)) == (member, row)
        return out

    ref = draws(1, 0)
    assert len(ref) == 3 * 400 and {e for _, e in ref} == {0, 1, 2}
    for world, workers, shuffle in ((1, 0, 0), (1, 2, 0), (2, 2, 0), (4, 1, 50), (2, 2, 120)):
        got = draws(world, workers, shuffle)
        assert len(got) == 3 * 400
        assert got == ref, (world, workers, shuffle)
    other = draws(1, 0, seed=12)
    multi = [k for k in ref if len(contents_cache(clusters)[k[0]][0]) > 1]
    assert sum(ref[k][0] != other[k][0] for k in multi) > len(multi) // 4
    # a new epoch draws again: per multi-member cluster the three epochs do not always agree
    by_cluster = defaultdict(set)
    for (base, _), (member, _) in ref.items():
        by_cluster[base].add(member)
    assert sum(len(v) > 1 for v in by_cluster.values()) > 50


_CACHE = {}


def contents_cache(directory: Path) -> dict:
    if directory not in _CACHE:
        _CACHE[directory] = contents(directory)
    return _CACHE[directory]



@pytest.mark.parametrize("kind", ["single", "shuffle_buffer", "mixture_token_budget"])
def test_resume_2_ranks_x_2_workers_draws_the_same_members(clusters, sample_shards, kind):
    """Resumed mid-epoch from a state_dict, each rank continues with exactly the batches, members and crops it
    would have produced; the run crosses into the second epoch (members drawn again). The mixture puts the cluster
    source beside an ordinary sequence source (the Rfam sample) under a token budget, so held samples resume too."""
    from pipeline.data.mixture import MixtureSchedule

    per_rank = []
    for rank in (0, 1):
        if kind == "mixture_token_budget":
            def make():
                sched = MixtureSchedule.constant(["uniref", "rfam"], {"uniref": 0.6, "rfam": 0.4})
                return ShardStream([Source("uniref", clusters), Source("rfam", sample_shards)], rank=rank,
                                   world_size=2, num_workers=2, micro_batch_size=4, seed=5, transform=crop_and_frame,
                                   pad_id=PAD_ID, mixture=sched, max_tokens=6 * (CROP + 2))
        else:
            def make():
                return stream(clusters, rank=rank, world=2, workers=2, shuffle=60 * (kind == "shuffle_buffer"))
        # 100 clusters per stream-epoch at 4 a batch: 25 batches a stream, so 2 x 40 batches reach the 2nd epoch (the
        # mixture's batches hold 6 or more samples of at most 50 tokens, ~60% clusters)
        total = 120 if kind == "mixture_token_budget" else 80
        full = resumed_equals_uninterrupted(make, 2, total, 23)
        ids = [s for b in full for s in b.sample_ids]
        cluster_ids = [s for s in ids if "#" in s]
        assert any("@1#" in s for s in cluster_ids)
        if kind == "mixture_token_budget":
            assert all(s.startswith("uniref:") for s in cluster_ids) and any(s.startswith("rfam:") for s in ids)
        per_rank.append({s.split("#")[0] for s in cluster_ids})
    assert not per_rank[0] & per_rank[1]  # in each epoch the ranks read disjoint clusters


def test_cluster_sampling_switch_and_brace_urls(clusters, sample_shards, tmp_path):
    import shutil

    stream(clusters, cluster_sampling=True)
    stream(sample_shards, cluster_sampling=False)
    with pytest.raises(ValueError, match=r"cluster sampling \(data.cluster_sampling\) is on but these shards hold "
                                         r"sequences"):
        stream(sample_shards, cluster_sampling=True)
    with pytest.raises(ValueError, match=r"holds UniRef50 clusters .* cluster sampling \(data.cluster_sampling\) "
                                         r"is off"):
        stream(clusters, cluster_sampling=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    for t in sorted(clusters.glob("*.tar")):
        shutil.copy(t, plain / t.name)  # no manifest: the layout comes from the tars themselves
    a = take(stream(clusters, world=2, workers=2), 2, 20)
    b = take(stream(str(plain / "uniref-{000000..000015}.tar"), world=2, workers=2), 2, 20)
    assert all(same(x, y) for x, y in zip(a, b)) and "#" in a[0].sample_ids[0]
    shutil.copy(sorted(sample_shards.glob("*.tar"))[0], plain / "uniref-000016.tar")
    with pytest.raises(ShardError, match="uniref-000016.tar holds sequences but uniref-000000.tar holds clusters"):
        stream(str(plain / "uniref-{000000..000016}.tar"))


def test_damaged_cluster_members_are_named(tmp_path):
    import io

    from webdataset.writer import TarWriter

    def npy(a):
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=False)
        return buf.getvalue()

    tokens = np.arange(4, 14, dtype=np.uint8)
    cases = {
        "no_offsets": ({}, r"sample 000000000001 lacks 000000000001.offsets.npy"),
        "short": ({"offsets.npy": npy(np.array([0, 4, 9], np.uint32))},
                  r"corrupt member 000000000001.offsets.npy \(offsets run from 0 to 9, expected 0 to 10"),
        "empty_member": ({"offsets.npy": npy(np.array([0, 4, 4, 10], np.uint32))},
                         r"corrupt member 000000000001.offsets.npy \(offsets must be strictly increasing"),
    }
    for name, (extra, want) in cases.items():
        path = tmp_path / f"{name}.tar"
        with open(path, "wb") as f:
            w = TarWriter(f, encoder=False, mtime=0)
            w.write({"__key__": "000000000000", "tokens.npy": npy(tokens), "meta.json": b"{}",
                     "offsets.npy": npy(np.array([0, 10], np.uint32))})
            w.write({"__key__": "000000000001", "tokens.npy": npy(tokens), "meta.json": b"{}", **extra})
            w.close()
        with pytest.raises(ShardError, match=rf"{path}: {want}"):
            read_cluster_tokens(path)
        with pytest.raises(ShardError, match=str(path)):
            read_clusters(path)
