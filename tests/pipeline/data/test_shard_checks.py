"""Shards that do not fit the model, or changed since data_prep wrote them, are refused with one line naming the shard
(and sample or config key): tokenizer kind and size against the family (compat.check_shards_fit), sha256 on first
read, tar members that escape the shard or are links, token ids outside the vocabulary, errors in loader workers."""
import dataclasses
import itertools
import shutil
import tarfile

import numpy as np
import pytest

from loader_checks import take
from pipeline.config import ConfigError
from pipeline.data import shard_reader
from pipeline.data.compat import KINDS, check_shards_fit
from pipeline.data.loader import ShardStream, make_loader
from pipeline.data.shard_reader import read_shard, read_tokens
from pipeline.data.shards import ShardError
from pipeline.families import get_family
from shard_factory import ESM, add_member, info, random_dir, set_manifest, shard_paths, spm_entry, write_dir


def frame(tokens, rng):
    ids = np.concatenate([[1], tokens, [2]]).astype(np.int64)
    return {"input_ids": ids, "labels": ids}


def stream(shards, workers=0, **kw):
    return ShardStream(str(shards), rank=0, world_size=1, num_workers=workers, micro_batch_size=4, seed=1,
                       transform=frame, pad_id=0, **kw)


def one_line(excinfo, *names):
    msg = str(excinfo.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for n in names:
        assert str(n) in msg, (n, msg)
    return msg


# --------------------------------------------------------------------------------------------------- compatibility
def test_every_family_has_a_tokenizer_kind_and_its_default_model_fits_it():
    from pipeline.data.compat import _VOCABS
    from pipeline.families import FAMILIES

    assert {fam.tokenizer for fam in FAMILIES.values()} <= set(KINDS)
    for name, fam in FAMILIES.items():
        kind = fam.tokenizer
        if kind in _VOCABS:  # character vocabularies: the default model has exactly their size
            assert fam.config_cls().vocab_size == len(_VOCABS[kind]), name


def test_check_shards_fit_accepts_the_right_kind_and_names_key_and_directory_otherwise(sample_shards, tmp_path):
    check_shards_fit(sample_shards, get_family("eco_rna"), 23, "data.train_shards")  # data_prep rnacentral output
    check_shards_fit(sample_shards, get_family("eco_rna_control"), 64, "data.train_shards")  # spare rows are fine
    protein = random_dir(tmp_path / "protein", entry=ESM)
    check_shards_fit(protein, get_family("protlingo"), 33, "data.train_shards")
    with pytest.raises(ConfigError) as e:
        check_shards_fit(protein, get_family("eco_rna"), 23, "data.sources[rna].shards")
    one_line(e, "data.sources[rna].shards", protein, "ESM-2 amino-acid", "eco_rna", "data_prep rnacentral")
    with pytest.raises(ConfigError) as e:
        check_shards_fit(sample_shards, get_family("protlingo"), 33, "data.train_shards")
    one_line(e, "data.train_shards", sample_shards, "nucleotide", "protlingo")
    with pytest.raises(ConfigError) as e:
        check_shards_fit(sample_shards, get_family("eco_rna"), 20, "data.train_shards")
    one_line(e, "data.train_shards", sample_shards, "23 ids", "model.vocab_size 20")

    text = random_dir(tmp_path / "text", entry=spm_entry(4096))
    check_shards_fit(text, get_family("recursive_gpt"), 32768, "data.train_shards")
    check_shards_fit(text, get_family("standard_gpt"), 4096, "data.train_shards")
    with pytest.raises(ConfigError) as e:
        check_shards_fit(text, get_family("recursive_gpt"), 2048, "data.train_shards")
    one_line(e, "data.train_shards", text, "4096 ids", "model.vocab_size 2048", "model.vocab_size=4096")
    with pytest.raises(ConfigError) as e:
        check_shards_fit(text, get_family("eco_rna"), 23, "data.train_shards")
    one_line(e, text, "sentencepiece text", "eco_rna")

    check_shards_fit(str(tmp_path / "plain" / "x-{000000..000003}.tar"), get_family("eco_rna"), 23, "k")  # brace URL: skipped
    with pytest.raises(ConfigError, match="family: eco_rna's tokenizer kind 'nope' is not one the loader knows"):
        check_shards_fit(sample_shards, dataclasses.replace(get_family("eco_rna"), tokenizer="nope"), 23,
                         "data.train_shards")


@pytest.mark.parametrize("entry, want", [
    ({"name": "bpe", "vocab_size": 10}, "tokenizer 'bpe' is not one the loader knows"),
    ({"name": "nucleotide", "vocab": ["<pad>", "A"]}, "vocabulary (2 tokens) differs from the 23-token table"),
    ({"name": "esm", "vocab": list(reversed(ESM["vocab"]))}, "vocabulary (33 tokens) differs from the 33-token"),
    ({**spm_entry(100), "vocab_size": None}, "entry has no vocab_size"),
    ({**spm_entry(100), "eos_id": 7}, "eos_id is 7, the models expect 2"),
])
def test_a_tokenizer_entry_the_code_does_not_number_by_is_a_shard_error(tmp_path, entry, want):
    d = random_dir(tmp_path / "d", n_shards=1, per_shard=2)
    set_manifest(d, tokenizer=entry)
    with pytest.raises(ShardError) as e:
        check_shards_fit(d, get_family("eco_rna"), 23, "data.train_shards")
    one_line(e, d / "manifest.json", want)


# ---------------------------------------------------------------------------------------------------------- sha256
def flip_meta_byte(shard):
    """Change one byte inside a meta.json member: the tar still parses, the loader never decodes it, only the digest
    tells."""
    raw = bytearray(shard.read_bytes())
    at = raw.index(b'{"id":') + 2
    raw[at] = ord("I")
    shard.write_bytes(bytes(raw))


def test_sha256_mismatch_is_one_error_naming_the_shard_and_verify_false_skips_it(tmp_path):
    d = random_dir(tmp_path / "d")
    bad = shard_paths(d)[2]
    flip_meta_byte(bad)
    with pytest.raises(ShardError) as e:
        take(stream(d), 0, 20)  # 4 shards of 12: every shard is read within 12 batches
    one_line(e, bad, "sha256", "differs from the manifest", "data.verify=false")
    assert len(take(stream(d, verify=False), 0, 20)) == 20
    # a brace URL has no manifest and no digest: read, not verified
    plain = tmp_path / "plain"
    plain.mkdir()
    for p in shard_paths(d):
        shutil.copy(p, plain / p.name)
    assert len(take(stream(str(plain / "part{00..03}-000000.tar")), 0, 20)) == 20


def test_each_shard_is_hashed_once_per_process_and_in_the_read_that_decodes_it(tmp_path, monkeypatch):
    d = random_dir(tmp_path / "d")
    hashed, reads = [], []
    real_sha, real_read = shard_reader.hashlib.sha256, shard_reader.Path.read_bytes

    def sha(data=b""):
        hashed.append(len(data))
        return real_sha(data)

    def read_bytes(self):
        reads.append(self.name)
        return real_read(self)

    monkeypatch.setattr(shard_reader.hashlib, "sha256", sha)
    monkeypatch.setattr(shard_reader.Path, "read_bytes", read_bytes)
    take(stream(d), 0, 12 * 3)  # three epochs of 48 samples, 4 per batch
    assert len(reads) == 12 and len(hashed) == 4  # each shard read once per epoch, hashed on its first read only
    assert sorted(hashed) == sorted(p.stat().st_size for p in shard_paths(d))


# ---------------------------------------------------------------------------------------------------- tar members
@pytest.mark.parametrize("member, want", [
    (info("../escape.tokens.npy", size=0), "member '../escape.tokens.npy' escapes the shard"),
    (info("/abs/000000000099.tokens.npy", size=0), "member '/abs/000000000099.tokens.npy' escapes the shard"),
    (info("000000000099.tokens.npy", type=tarfile.SYMTYPE, linkname="/etc/passwd"),
     "member 000000000099.tokens.npy is a symbolic link (to '/etc/passwd')"),
    (info("000000000099.tokens.npy", type=tarfile.LNKTYPE, linkname="000000000000.tokens.npy"),
     "member 000000000099.tokens.npy is a hard link"),
    (info("fifo", type=tarfile.FIFOTYPE), "member fifo is not a regular file"),
])
def test_members_that_escape_or_link_are_refused_by_the_loader_and_read_shard_alike(tmp_path, member, want):
    d = random_dir(tmp_path / "d", n_shards=1, per_shard=3)
    shard = shard_paths(d)[0]
    add_member(shard, member, b"" if member.isreg() else None)
    for read in (read_tokens, read_shard):
        with pytest.raises(ShardError) as e:
            read(shard)
        one_line(e, shard, want)
    with pytest.raises(ShardError) as e:
        take(stream(d), 0, 1)
    one_line(e, shard, want)


# ------------------------------------------------------------------------------------------------------- token ids
def test_a_token_id_outside_the_vocabulary_names_shard_and_sample(tmp_path):
    good = np.arange(6, 16, dtype=np.uint8)
    d = write_dir(tmp_path / "d", [[("000000000000", good), ("000000000001", good)],
                                   [("000000000000", good), ("000000000001", np.array([6, 7, 40, 8], np.uint8))]])
    bad = shard_paths(d)[1]
    with pytest.raises(ShardError) as e:
        take(stream(d, vocab_size=23), 0, 2)
    one_line(e, bad, "sample 000000000001", "token id 40 at position 3", "vocabulary 0..22", "model.vocab_size 23")
    assert len(take(stream(d, vocab_size=41), 0, 2)) == 2  # 40 fits a 41-row embedding
    assert len(take(stream(d), 0, 2)) == 2  # no vocab_size: unchecked, as before
    # a dtype that cannot hold an id >= vocab_size is not scanned at all
    assert shard_reader._token_ids(bad, "k", good, 256) is good


@pytest.mark.parametrize("damage", ["token_id", "truncated", "sha256"])
def test_worker_errors_reach_the_main_process_as_the_same_one_line_shard_error(tmp_path, damage):
    d = random_dir(tmp_path / "d")
    bad = shard_paths(d)[1]
    if damage == "token_id":
        d = write_dir(tmp_path / "t", [[(f"{j:012d}", np.full(5, 6 + 20 * (i == 1 and j == 4), np.uint8))
                                        for j in range(12)] for i in range(4)])
        bad = shard_paths(d)[1]
        want = ["sample 000000000004", "token id 26"]
    elif damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:3000])
        want = ["truncated or corrupt shard"]
    else:
        flip_meta_byte(bad)
        want = ["sha256"]
    loader_ = make_loader(stream(d, workers=2, vocab_size=23), 2)
    with pytest.raises(ShardError) as e:
        list(itertools.islice(loader_, 40))
    one_line(e, bad, *want)
    assert "DataLoader worker" not in str(e.value)


def test_an_unreadable_header_mid_shard_is_an_error_even_without_a_manifest(tmp_path):
    """tarfile ends an archive silently at a bad header past the first: without a manifest to count against, a
    damaged shard would pass for a shorter one. The loader requires the archive to end in zero blocks."""
    d = random_dir(tmp_path / "d", n_shards=1, per_shard=12)
    shard = shard_paths(d)[0]
    raw = bytearray(shard.read_bytes())
    raw[5 * 2048:5 * 2048 + 512] = b"\x01" * 512  # sample 5's first header (meta.json; 2 members of 2 blocks a sample)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x-0.tar").write_bytes(bytes(raw))
    with pytest.raises(ShardError) as e:
        read_tokens(plain / "x-0.tar")
    one_line(e, plain / "x-0.tar", "truncated or corrupt shard after member 000000000004.tokens.npy",
             "unreadable tar header at byte 10240")
    with pytest.raises(ShardError) as e:  # read_shard (tools/inspect_shards.py, evaluation) shares the check
        read_shard(plain / "x-0.tar")
    one_line(e, plain / "x-0.tar", "unreadable tar header at byte 10240")
