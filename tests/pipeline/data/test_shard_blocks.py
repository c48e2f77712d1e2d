"""Shards of blocks (format bioseq-wds/2, pipeline/data/shards.py): every reader returns what the per-record layout
returns for the same samples, and a damaged block is one ShardError naming the file and the member or sample."""
import io
import json
import tarfile

import numpy as np
import pytest

from pipeline.data.shard_reader import (read_cluster_tokens, read_clusters, read_shard, read_tokens,
                                        shard_layout)
from pipeline.data.shards import ShardError, ShardWriter, sha256_file


def samples(n=57, seed=0, vocab=23):
    rng = np.random.default_rng(seed)
    return [(f"{i:012d}", rng.integers(0, vocab, int(rng.integers(0, 40))).astype(np.uint8), {"id": f"r{i}", "i": i})
            for i in range(n)]


def write(tmp_path, prefix, recs, block_samples, extend=False, **kw):
    w = ShardWriter(tmp_path, prefix=prefix, max_samples=20, vocab_size=kw.pop("vocab_size", 23),
                    block_samples=block_samples, **kw)
    if extend:  # in uneven batches
        for a, b in ((0, 3), (3, 30), (30, len(recs))):
            part = recs[a:b]
            bounds = np.concatenate([[0], np.cumsum([len(t) for _, t, _ in part])])
            w.extend([k for k, _, _ in part], np.concatenate([t for _, t, _ in part]), bounds,
                     [json.dumps(m, separators=(",", ":")) for _, _, m in part])
    else:
        for k, t, m in recs:
            w.write(k, t, m)
    return w.close()


def test_blocks_read_as_per_record_shards(tmp_path):
    recs = samples()
    old = write(tmp_path, "old", recs, None)
    new = write(tmp_path, "new", recs, 4, block_tokens=50)
    ext = write(tmp_path, "ext", recs, 4, extend=True, block_tokens=50)
    # extend() cuts the same blocks as write(): byte-identical shards
    assert [s.sha256 for s in new] == [s.sha256 for s in ext] and [s.sha256 for s in new] != [s.sha256 for s in old]
    expect = [(k, t.tolist(), m) for k, t, m in recs]
    for infos in (old, new):
        got, tokens = [], []
        for s in infos:
            assert sha256_file(tmp_path / s.path) == s.sha256 and shard_layout(tmp_path / s.path) == "sequences"
            got += read_shard(tmp_path / s.path, s.samples)
            tokens += read_tokens(tmp_path / s.path, s.samples, sha256=s.sha256, vocab_size=23)
        assert [(k, t.tolist(), m) for k, t, m in got] == expect
        assert [(k, t.tolist()) for k, t in tokens] == [(k, t) for k, t, _ in expect]
    with tarfile.open(tmp_path / new[0].path) as tf:  # 20 samples, <= 4 per block and closed at 50 tokens
        names = tf.getnames()
    blocks = len(names) // 4
    assert blocks > 5 and names == [f"block{b:06d}.{e}" for b in range(blocks)
                                    for e in ("keys.txt", "bounds.npy", "tokens.npy", "meta.json")]


def test_cluster_blocks_read_as_per_record_shards(tmp_path):
    rng = np.random.default_rng(1)
    clusters = []
    for i in range(23):
        members = [rng.integers(4, 31, int(rng.integers(1, 9))).astype(np.uint8) for _ in range(int(rng.integers(1, 4)))]
        clusters.append((f"{i:012d}", members, {"id": f"c{i}", "members": [f"m{j}" for j in range(len(members))]}))
    infos = {}
    for name, bs in (("old", None), ("new", 3), ("ext", 3), ("old_ext", None)):
        w = ShardWriter(tmp_path, prefix=name, max_samples=10, vocab_size=33, block_samples=bs, layout="clusters",
                        block_tokens=40)
        if name.endswith("ext"):  # extend() in uneven batches, the members' lengths one after the other
            for a, b in ((0, 2), (2, 17), (17, len(clusters))):
                part = clusters[a:b]
                sizes = [sum(len(x) for x in ms) for _, ms, _ in part]
                w.extend([k for k, _, _ in part], np.concatenate([x for _, ms, _ in part for x in ms]),
                         np.concatenate([[0], np.cumsum(sizes)]), [json.dumps(m, separators=(",", ":"))
                                                                   for _, _, m in part],
                         np.array([len(x) for _, ms, _ in part for x in ms]))
        else:
            for k, ms, m in clusters:
                w.write(k, np.concatenate(ms), m, np.concatenate([[0], np.cumsum([len(x) for x in ms])]))
        infos[name] = w.close()
    # extend() writes the bytes write() does, with blocks (format 2) and without (format 1)
    for a, b in (("new", "ext"), ("old", "old_ext")):
        assert [(tmp_path / s.path).read_bytes() for s in infos[a]] == [(tmp_path / s.path).read_bytes()
                                                                          for s in infos[b]], (a, b)
    with pytest.raises(ValueError, match="member lengths must be positive and add up"):
        ShardWriter(tmp_path, prefix="bad", layout="clusters", block_samples=3).extend(
            ["000000000000"], np.zeros(5, np.uint8), np.array([0, 5]), ["{}"], np.array([2, 2]))
    expect = [(k, [x.tolist() for x in ms], m) for k, ms, m in clusters]
    for name, shards in infos.items():
        got, loader = [], []
        for s in shards:
            assert shard_layout(tmp_path / s.path) == "clusters"
            got += read_clusters(tmp_path / s.path, s.samples)
            loader += read_cluster_tokens(tmp_path / s.path, s.samples, sha256=s.sha256, vocab_size=33)
        assert [(k, [x.tolist() for x in ms], m) for k, ms, m in got] == expect, name
        assert [(k, [t[int(a):int(b)].tolist() for a, b in zip(o[:-1], o[1:])]) for k, t, o in loader] == \
            [(k, ms) for k, ms, _ in expect], name
    shard = tmp_path / infos["new"][0].path
    with pytest.raises(ShardError, match="is a UniRef50 cluster block .*read the shard with read_clusters"):
        read_shard(shard)
    with pytest.raises(ShardError, match="offsets.npy: a UniRef50 cluster shard, read by cluster sampling only"):
        read_tokens(shard)


def rewrite(path, change):
    """The shard with member ``name`` replaced by ``change(name, data)`` (None drops it)."""
    with tarfile.open(path) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for m, data in members:
            data = change(m.name, data)
            if data is not None:
                m.size = len(data)
                tf.addfile(m, io.BytesIO(data))


def npy(a):
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


@pytest.mark.parametrize("damage, message", [
    (lambda n, d: npy(np.array([0, 5, 3], np.uint64)) if n == "block000001.bounds.npy" else d,
     r"corrupt member block000001\.bounds\.npy: 3 bounds for 4 keys"),
    (lambda n, d: None if n == "block000000.keys.txt" else d, r"block block000000 lacks block000000\.keys\.txt"),
    (lambda n, d: d.replace(b"000000000002", b"000000000002\nx") if n == "block000000.keys.txt" else d,
     r"corrupt member block000000\.bounds\.npy: 5 bounds for 5 keys \(expected keys \+ 1\)"),
    (lambda n, d: npy(np.full(np.load(io.BytesIO(d)).shape, 30, np.uint8)) if n == "block000002.tokens.npy" else d,
     r"sample 000000000008: token id 30 at position 1 is outside the model's vocabulary 0\.\.22"),
])
def test_damaged_block_is_one_error(tmp_path, damage, message):
    recs = samples(20)
    for k, t, m in recs:
        t[:] = np.maximum(t, 1)  # no empty sample: every block has tokens to damage
    recs = [(k, t if len(t) else np.ones(3, np.uint8), m) for k, t, m in recs]
    info, = write(tmp_path, "d", recs, 4)
    path = tmp_path / info.path
    rewrite(path, damage)
    with pytest.raises(ShardError, match=message) as e:
        read_tokens(path, info.samples, vocab_size=23)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)
    if "vocabulary" not in message:
        with pytest.raises(ShardError):
            read_shard(path, info.samples)


def test_truncated_block_shard(tmp_path):
    info, = write(tmp_path, "t", samples(20), 20)
    path = tmp_path / info.path
    path.write_bytes(path.read_bytes()[:1500])
    with pytest.raises(ShardError, match="truncated or corrupt shard"):
        read_tokens(path, info.samples)
    with pytest.raises(ShardError, match="truncated or corrupt shard"):
        read_shard(path, info.samples)
