"""Bad shard directories, tested at the loader and check functions (the CLI-level cases come once the engine wires
them): each is one exception whose message is a single line naming the shard file (or manifest) and the sample,
member or config key at fault.

Directories are written with the real ShardWriter / manifest code (tests/pipeline/data/shard_factory.py), then
damaged one way each.
"""
from __future__ import annotations

import itertools
import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline" / "data"))

from pipeline.config import ConfigError  # noqa: E402
from pipeline.data.compat import check_shards_fit  # noqa: E402
from pipeline.families import get_family  # noqa: E402
from pipeline.data.loader import ShardStream, make_loader  # noqa: E402
from pipeline.data.shards import ShardError  # noqa: E402
from pipeline.data.streams import resolve_shards  # noqa: E402
from shard_factory import ESM, add_member, info, random_dir, set_manifest, shard_paths, spm_entry, write_dir  # noqa

VOCAB = 23  # the Eco-RNA model's


def frame(tokens, rng):
    ids = np.concatenate([[1], tokens, [2]]).astype(np.int64)
    return {"input_ids": ids, "labels": ids}


def read_all(directory: Path, workers: int = 0):
    """Build the loader for ``directory`` and take two epochs of batches (every shard read, every digest checked)."""
    ds = ShardStream(str(directory), rank=0, world_size=1, num_workers=workers, micro_batch_size=4, seed=0,
                     transform=frame, pad_id=0, vocab_size=VOCAB, verify=True)
    list(itertools.islice(make_loader(ds, workers), 24))


def fit(directory: Path):
    resolve_shards.cache_clear()  # the manifest is read once per process and spec; these tests rewrite it in place
    check_shards_fit(directory, get_family("eco_rna"), VOCAB, "data.train_shards")
    read_all(directory)


# ------------------------------------------------------------------------------------------------------ the damage
def missing_manifest(d):
    (d / "manifest.json").unlink()
    return d / "manifest.json", ["no manifest.json"]


def manifest_not_json(d):
    (d / "manifest.json").write_text('{"format": "bioseq-wds/1", "shards": [')
    return d / "manifest.json", ["not valid JSON"]


def manifest_lists_a_missing_shard(d):
    bad = shard_paths(d)[1]
    bad.unlink()
    return d / "manifest.json", [f"lists shard {bad.name} which is missing"]


def truncated_tar(d):
    bad = shard_paths(d)[2]
    raw = bad.read_bytes()
    bad.write_bytes(raw[:len(raw) // 3 // 512 * 512 + 100])  # inside a header or a member's data
    return bad, ["truncated or corrupt shard after member"]


def truncated_at_a_block_boundary(d):
    bad = shard_paths(d)[2]
    raw = bad.read_bytes()
    # every member here is one header + one data block: the cut ends the file right before a header, with no
    # end-of-archive marker, which tarfile reads as a shorter archive; the manifest's count tells
    bad.write_bytes(raw[:len(raw) // 3 // 1024 * 1024])
    return bad, ["but the manifest says 12 (truncated shard?)"]


def garbage_header(d):
    bad = shard_paths(d)[1]
    raw = bytearray(bad.read_bytes())
    at = len(raw) // 3 // 1024 * 1024  # a header block (see above): tarfile would stop there without a word
    raw[at:at + 512] = b"\x5a" * 512
    bad.write_bytes(bytes(raw))
    return bad, ["truncated or corrupt shard after member", "unreadable tar header at byte"]


def fewer_samples_than_the_manifest(d):
    bad = shard_paths(d)[0]
    shards = json.loads((d / "manifest.json").read_text())["shards"]
    set_manifest(d, shards=[{**s, "samples": s["samples"] + (i == 0)} for i, s in enumerate(shards)])
    return bad, ["holds 12 samples but the manifest says 13"]


def sha256_mismatch(d):
    bad = shard_paths(d)[3]
    raw = bytearray(bad.read_bytes())
    at = raw.index(b'{"id":') + 2  # inside a meta.json member: the tar parses, only the digest tells
    raw[at] = ord("X")
    bad.write_bytes(bytes(raw))
    return bad, ["sha256", "differs from the manifest"]


def dotdot_member(d):
    bad = shard_paths(d)[1]
    add_member(bad, info("../../etc/000000000099.tokens.npy", size=3), b"abc")
    return bad, ["member '../../etc/000000000099.tokens.npy' escapes the shard"]


def absolute_member(d):
    bad = shard_paths(d)[1]
    add_member(bad, info("/tmp/000000000099.tokens.npy", size=3), b"abc")
    return bad, ["member '/tmp/000000000099.tokens.npy' escapes the shard"]


def symlink_member(d):
    bad = shard_paths(d)[0]
    add_member(bad, info("000000000099.tokens.npy", type=tarfile.SYMTYPE, linkname="/etc/shadow"))
    return bad, ["member 000000000099.tokens.npy is a symbolic link (to '/etc/shadow')"]


def hardlink_member(d):
    bad = shard_paths(d)[0]
    add_member(bad, info("000000000099.tokens.npy", type=tarfile.LNKTYPE, linkname="000000000000.tokens.npy"))
    return bad, ["member 000000000099.tokens.npy is a hard link"]


def corrupt_tokens_member(d):
    bad = shard_paths(d)[2]
    add_member(bad, info("000000000099.tokens.npy", size=8), b"notnumpy")
    return bad, ["corrupt member 000000000099.tokens.npy"]


def token_id_out_of_vocab(d):
    rng = np.random.default_rng(1)
    shards = [[(f"{j:012d}", rng.integers(6, 22, 9).astype(np.uint8)) for j in range(12)] for _ in range(4)]
    shards[2][7] = ("000000000007", np.array([6, 7, 8, 9, 33, 6], np.uint8))  # an ESM id in nucleotide shards
    write_dir(d, shards)
    return shard_paths(d)[2], ["sample 000000000007", "token id 33", "model.vocab_size 23"]


def tokenizer_of_another_family(d):
    set_manifest(d, tokenizer=ESM)
    return d, ["data.train_shards", "ESM-2 amino-acid", "eco_rna"]


def vocabulary_larger_than_the_model(d):
    set_manifest(d, tokenizer=spm_entry(4096))
    return d, ["data.train_shards", "sentencepiece"]  # the family check fires first (text under Eco-RNA)


def unknown_tokenizer(d):
    set_manifest(d, tokenizer={"name": "bpe", "vocab_size": 50000})
    return d / "manifest.json", ["tokenizer 'bpe' is not one the loader knows"]


CASES = [missing_manifest, manifest_not_json, manifest_lists_a_missing_shard, truncated_tar,
         truncated_at_a_block_boundary, garbage_header, fewer_samples_than_the_manifest, sha256_mismatch,
         dotdot_member, absolute_member, symlink_member, hardlink_member, corrupt_tokens_member,
         token_id_out_of_vocab, tokenizer_of_another_family, vocabulary_larger_than_the_model, unknown_tokenizer]
ERRORS = (ShardError, ConfigError, FileNotFoundError)


@pytest.mark.parametrize("damage", CASES, ids=[c.__name__ for c in CASES])
def test_a_bad_shard_directory_is_one_line_naming_the_file_and_the_sample_or_key(tmp_path, damage):
    d = random_dir(tmp_path / "shards", n_shards=4, per_shard=12)
    fit(d)  # undamaged: fits the model and reads
    where, names = damage(d)
    with pytest.raises(ERRORS) as e:
        fit(d)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for s in [str(where), *names]:
        assert s in msg, f"the error does not name {s!r}: {msg}"


def test_a_model_smaller_than_the_shards_vocabulary_names_the_key(tmp_path):
    d = random_dir(tmp_path / "text", n_shards=1, per_shard=2, entry=spm_entry(4096))
    with pytest.raises(ConfigError) as e:
        check_shards_fit(d, get_family("recursive_gpt"), 2048, "data.sources[babylm].shards")
    msg = str(e.value)
    assert "\n" not in msg
    for s in ("data.sources[babylm].shards", str(d), "4096 ids", "model.vocab_size 2048"):
        assert s in msg, msg


@pytest.mark.parametrize("damage", [sha256_mismatch, token_id_out_of_vocab, symlink_member],
                         ids=["sha256_mismatch", "token_id_out_of_vocab", "symlink_member"])
def test_the_same_line_from_a_loader_worker_process(tmp_path, damage):
    d = random_dir(tmp_path / "shards", n_shards=4, per_shard=12)
    where, names = damage(d)
    with pytest.raises(ShardError) as e:
        read_all(d, workers=2)
    msg = str(e.value)
    assert "\n" not in msg and "DataLoader worker" not in msg, msg
    for s in [str(where), *names]:
        assert s in msg, msg
