"""Our shards through other readers (docs/data.md, "Reading shards with other tools"): the real webdataset with
pipeline.data.wds_compat, and the real Hugging Face datasets with pipeline.data.hf_view, yield exactly the records
of the project's reader (read_shard / read_clusters over the manifest's shards, in order). The two snippets run here
are the ones docs/data.md shows, read from the page."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from data_prep.__main__ import main as prep
from pipeline.data.shard_reader import read_clusters, read_shard
from pipeline.data.shards import Manifest, ShardError, ShardWriter, load_manifest, write_manifest
from pipeline.data.wds_compat import block_records, records

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "data.md"
SECTION = "## Reading shards with other tools"
UNIREF_FASTA = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"
UNIREF_TSV = REPO / "data" / "samples" / "uniref50_to_uniref90_sample.tsv"


def snippets() -> list[str]:
    """The python code blocks of the docs/data.md section, as written there."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC} lost its section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run_snippet(i: int, directory: Path) -> dict:
    """Snippet ``i`` executed with ``directory`` (a Path) defined, as the page says; its variables."""
    namespace = {"directory": directory}
    exec(compile(snippets()[i], f"{DOC}:snippet{i}", "exec"), namespace)
    return namespace


def reference(directory: Path) -> list[tuple[str, str, object, dict]]:
    """(shard path, key, tokens or member list, meta) of every record, by the project's reader."""
    m = load_manifest(directory)
    read = read_clusters if m.layout == "clusters" else read_shard
    return [(s.path, key, tokens, meta) for s in m.shards for key, tokens, meta in read(directory / s.path, s.samples)]


def same_tokens(a, b) -> bool:
    if isinstance(b, list):  # a cluster's members
        return isinstance(a, list) and len(a) == len(b) and all(same_tokens(x, y) for x, y in zip(a, b))
    return isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)


def assert_wds_equals_reader(got: list[dict], directory: Path):
    ref = reference(directory)
    assert len(got) == len(ref)
    field = "members" if load_manifest(directory).layout == "clusters" else "tokens"
    for rec, (path, key, tokens, meta) in zip(got, ref):
        assert (rec["__key__"], rec["__url__"], rec["meta"]) == (key, str(directory / path), meta)
        assert same_tokens(rec[field], tokens), key


def assert_hf_equals_reader(got: list[dict], directory: Path):
    ref = reference(directory)
    assert len(got) == len(ref)
    field = "members" if load_manifest(directory).layout == "clusters" else "input_ids"
    for ex, (path, key, tokens, meta) in zip(got, ref):
        assert (ex["id"], ex["meta"]) == (f"{path}/{key}", meta)
        assert same_tokens(ex[field], tokens), key


def urls(directory: Path) -> list[str]:
    return [str(directory / s.path) for s in load_manifest(directory).shards]


@pytest.fixture(scope="module")
def cluster_shards(tmp_path_factory) -> Path:
    """The shipped UniRef sample (400 clusters, 771 members) as 4 shards of one block each, by the real CLI."""
    out = tmp_path_factory.mktemp("wds") / "uniref"
    assert prep(["uniref", "--input", str(UNIREF_FASTA), "--clusters", str(UNIREF_TSV), "--output", str(out),
                 "--shard-size", "100"]) == 0
    return out


@pytest.fixture(scope="module", params=[4, None], ids=["blocks-of-4", "format-1"])
def small_blocks(request, tmp_path_factory) -> Path:
    """57 random records (some empty) in 3 shards, blocks of 4 (several blocks a shard, the last one short) or one
    member group per record (format 1)."""
    out = tmp_path_factory.mktemp("wds")
    rng = np.random.default_rng(0)
    w = ShardWriter(out, prefix="part", max_samples=20, vocab_size=23, block_samples=request.param)
    for i in range(57):
        w.write(f"{i:012d}", rng.integers(0, 23, int(rng.integers(0, 40))).astype(np.uint8), {"id": f"r{i}", "i": i})
    write_manifest(out, Manifest(source="test", tokenizer={"name": "nucleotide"}, shards=w.close()))
    return out


def test_doc_snippet_webdataset_yields_the_readers_records(sample_shards):
    dataset = run_snippet(0, sample_shards)["dataset"]
    assert_wds_equals_reader(list(dataset), sample_shards)


def test_doc_snippet_hf_datasets_yields_the_readers_records(sample_shards):
    import datasets

    ds = run_snippet(1, sample_shards)["ds"]
    assert isinstance(ds, datasets.IterableDataset) and ds.n_shards == len(load_manifest(sample_shards).shards)
    assert_hf_equals_reader(list(ds), sample_shards)


def test_a_plain_webdataset_reader_sees_one_sample_per_block(sample_shards):
    """Why the decoder exists: without it WebDataset yields 8 blocks (one per shard here) for 2,107 records."""
    plain = list(wds.WebDataset(urls(sample_shards), shardshuffle=False))
    assert [s["__key__"] for s in plain] == ["block000000"] * 8
    assert len(reference(sample_shards)) == 2107


def test_cluster_shards_yield_clusters_of_members(cluster_shards):
    got = list(wds.WebDataset(urls(cluster_shards), shardshuffle=False).compose(records))
    assert_wds_equals_reader(got, cluster_shards)
    assert "tokens" not in got[0] and sum(len(r["members"]) for r in got) == 771  # never members end to end
    from pipeline.data.hf_view import shard_dataset

    assert_hf_equals_reader(list(shard_dataset(cluster_shards)), cluster_shards)


def test_several_blocks_a_shard_and_format_1(small_blocks):
    """Block boundaries inside a shard (and empty records), per sample with block_records as with the stage."""
    per_sample = [r for s in wds.WebDataset(urls(small_blocks), shardshuffle=False) for r in block_records(s)]
    assert_wds_equals_reader(per_sample, small_blocks)
    assert_wds_equals_reader(list(wds.WebDataset(urls(small_blocks), shardshuffle=False).compose(records)),
                             small_blocks)


def test_hf_view_splits_whole_shards_across_ranks(small_blocks):
    from datasets.distributed import split_dataset_by_node

    from pipeline.data.hf_view import shard_dataset

    ds = shard_dataset(small_blocks)
    ranks = [[ex["id"] for ex in split_dataset_by_node(ds, rank, 3)] for rank in range(3)]
    assert [{i.split("/")[0] for i in r} for r in ranks] == [{"part-000000.tar"}, {"part-000001.tar"},
                                                             {"part-000002.tar"}]
    assert sum(ranks, []) == [f"{p}/{k}" for p, k, _, _ in reference(small_blocks)]


def test_damaged_samples_are_one_shard_error_naming_url_and_member(sample_shards):
    sample = next(iter(wds.WebDataset(urls(sample_shards), shardshuffle=False)))
    url = sample["__url__"]
    with pytest.raises(ShardError, match=rf"^{re.escape(url)}: block block000000 lacks block000000\.bounds\.npy$"):
        block_records({k: v for k, v in sample.items() if k != "bounds.npy"})
    metas = json.loads(sample["meta.json"])
    with pytest.raises(ShardError, match=rf"^{re.escape(url)}: corrupt member block000000\.meta\.json \(expected"):
        block_records({**sample, "meta.json": json.dumps(metas[:-1]).encode()})
    with pytest.raises(ShardError, match=rf"^{re.escape(url)}: corrupt member block000000\.tokens\.npy"):
        block_records({**sample, "tokens.npy": sample["tokens.npy"][:-1]})
    decoded = next(iter(wds.WebDataset(urls(sample_shards), shardshuffle=False).decode()))
    with pytest.raises(ShardError, match=r"member block000000\.keys\.txt is str, not bytes \(a \.decode\(\)"):
        list(records([decoded]))
