"""The four production sources prepared from the real shared files and read back (acceptance 1), their policies,
and bad inputs (acceptance 5). Runs are in-process (`data_prep.__main__.main`) to import torch once.

Oracles are plain Python over the input text, independent of data_prep's readers.
"""
import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from data_prep.__main__ import main
from data_prep.common import input_fingerprint
from pipeline.data.protein_tokenizer import VOCAB as ESM_VOCAB, ProteinTokenizer
from pipeline.data.shard_reader import read_shard
from pipeline.data.shards import load_manifest, sha256_file
from pipeline.data.tokenizer import SEP_ID, VOCAB

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
pytestmark = pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")
PHIX = SHARED / "genome" / "phiX174_variants_134_genomes.fna"
UNIREF_FULL = SHARED / "protein" / "uniref50_2022_fullheader_100.fasta"
UNIREF_BIONEMO = SHARED / "protein" / "uniref50_202104_esm2_train_5000.fasta"
TEXT = SHARED / "text"


def fasta_records(path: Path) -> list[tuple[str, str, str]]:
    """(id, description, sequence) by string splitting."""
    out = []
    for block in path.read_text().replace("\r\n", "\n").split("\n>"):
        head, *lines = block.removeprefix(">").split("\n")
        rid, _, desc = head.partition(" ")
        out.append((rid, desc, "".join(s.strip() for s in lines)))
    return out


def samples(directory: Path) -> dict:
    m = load_manifest(directory)
    out = {}
    for s in m.shards:
        assert sha256_file(directory / s.path) == s.sha256
        for key, tokens, meta in read_shard(directory / s.path, s.samples):
            out[key] = (tokens, meta)
    return out


def og2_jsonl(path: Path, records) -> list[dict]:
    """Real phiX genomes in the OG2 layout, with the OG2 markup on some records: a taxonomy tag, a soft-masked
    (lowercase) stretch, a contig split '#' and splice markers '@'."""
    objs = []
    for i, (rid, _, seq) in enumerate(records):
        text = seq
        if i % 3 == 0:
            text = f"|d__Viruses;p__Phixviricota;s__Escherichia phage phiX174|{seq[:60].lower()}{seq[60:500]}#" \
                   f"{seq[500:1000]}@{seq[1000:]}@"
        objs.append({"record": rid, "text": text} if i % 2 else {"text": text})
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(o) + "\n" for o in objs)
    return objs


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("sources")


def run(*args) -> int:
    return main([str(a) for a in args])


def test_opengenome2(work, capsys):
    recs = fasta_records(PHIX)
    src = work / "og2" / "json" / "pretraining_or_both_phases" / "phix" / "data_phix_train_chunk1.jsonl.gz"
    src.parent.mkdir(parents=True)
    objs = og2_jsonl(src, recs)
    assert run("opengenome2", "--input", src, "--output", work / "og2_out", "--shard-size", 50) == 0
    m = load_manifest(work / "og2_out")
    texts = [o["text"] for o in objs]
    bases = [t.split("|")[-1].replace("@", "").replace("#", "") for t in texts]
    assert m.total_samples == len(objs) == 134
    assert m.stats["residues"] == sum(map(len, bases)) == sum(len(r[2]) for r in recs)
    assert m.stats["lowercase_residues"] == sum(sum(c.islower() for c in b) for b in bases) == 45 * 60
    assert m.stats["input"] == {"taxonomy_tags": 45, "contig_splits": 45, "splice_markers_dropped": 90}
    assert m.inputs == [{"path": str(src), **input_fingerprint(src), "records": 134, "kept": 134,
                         "residues": m.stats["residues"]}]
    got = samples(work / "og2_out")
    for i, (rid, _, seq) in enumerate(recs):
        tokens, meta = got[f"{i:012d}"]
        assert meta["id"] == (rid if i % 2 else f"{src.name}:{i + 1}") and meta["length"] == len(seq)
        text = "".join(VOCAB[t] if t != SEP_ID else "#" for t in tokens)
        if i % 3 == 0:
            assert meta["taxonomy"] == "d__Viruses;p__Phixviricota;s__Escherichia phage phiX174"
            assert text == f"{seq[:500]}#{seq[500:]}".upper() and int((tokens == SEP_ID).sum()) == 1
        else:
            assert text == seq.upper() and "taxonomy" not in meta


def test_genome_fasta_gz(work):
    path = SHARED / "genome" / "ecoli_O157H7_sakai_GCF_000008865.2.fna.gz"
    assert run("genome", "--input", path, "--output", work / "ecoli") == 0
    raw = gzip.decompress(path.read_bytes()).decode()
    seqs = ["".join(b.split("\n")[1:]) for b in raw.split(">")[1:]]
    m = load_manifest(work / "ecoli")
    assert (m.total_samples, m.stats["residues"], m.total_tokens) == (3, 5_594_605, 5_594_605)
    assert m.stats["residues"] == sum(map(len, seqs))


def test_rnacentral(work):
    path = SHARED / "rna" / "rnacentral_ncrna6_testset.fasta"
    assert run("rnacentral", "--input", path, "--output", work / "rnac", "--min-length", 1) == 0
    recs = fasta_records(path)
    m = load_manifest(work / "rnac")
    assert (m.total_samples, m.stats["residues"]) == (len(recs), sum(len(s) for *_, s in recs)) == (6001, 3_353_814)


def test_uniref_headers_members_and_esm_ids(work):
    recs = fasta_records(UNIREF_FULL) + fasta_records(UNIREF_BIONEMO)
    members = work / "members.tsv"
    mapped = {recs[0][0]: ["UniRef90_A", "UniRef90_B"], recs[150][0]: ["UniRef90_C"]}
    members.write_text("".join(f"{k}\t{','.join(v)}\n" for k, v in mapped.items()))
    assert run("uniref", "--input", UNIREF_FULL, UNIREF_BIONEMO, "--output", work / "uni", "--min-length", 1,
               "--uniref90-members", members) == 0
    m = load_manifest(work / "uni")
    assert m.total_samples == len(recs) == 5101
    assert m.stats["residues"] == m.total_tokens == sum(len(s) for *_, s in recs) == 2_725_393 + 1_505_291
    assert [i["residues"] for i in m.inputs] == [2_725_393, 1_505_291] and m.stats["input"]["with_members"] == 2
    assert m.tokenizer["name"] == "esm" and m.tokenizer["vocab"] == list(ESM_VOCAB)
    got = samples(work / "uni")
    tokens, meta = got[f"{0:012d}"]
    head = "Peptidylprolyl isomerase n=1 Tax=Triplophysa tibetana TaxID=1572043 RepID=A0A5A9P0L4_9TELE"
    assert recs[0][1] == head
    assert meta | {"members": None} == {"id": "UniRef50_A0A5A9P0L4", "source": "uniref", "length": len(recs[0][2]),
                                        "name": "Peptidylprolyl isomerase", "n": 1, "tax": "Triplophysa tibetana",
                                        "taxid": 1572043, "repid": "A0A5A9P0L4_9TELE", "members": None}
    assert meta["members"] == ["UniRef90_A", "UniRef90_B"]
    assert got[f"{150:012d}"][1] == {"id": recs[150][0], "source": "uniref", "length": len(recs[150][2]),
                                     "taxid": int(float(recs[150][1].split("TaxID=")[1].split()[0])),
                                     "repid": recs[150][1].split("RepID=")[1], "members": ["UniRef90_C"]}
    for i, (_, _, seq) in enumerate(recs):
        assert "".join(ESM_VOCAB[t] for t in got[f"{i:012d}"][0]) == seq


def test_esm_ids_equal_hf_esm_tokenizer(tmp_path):
    from transformers import EsmTokenizer
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(ESM_VOCAB) + "\n")
    hf = EsmTokenizer(str(vocab))
    assert hf.get_vocab() == {t: i for i, t in enumerate(ESM_VOCAB)}
    ours = ProteinTokenizer()
    every = [s for *_, s in fasta_records(UNIREF_BIONEMO) + fasta_records(UNIREF_FULL)]
    rare = [s for s in every if set(s) & set("XBUZO")]
    seqs = every[:200] + rare[:50]  # real sequences, including those with rare / ambiguity codes
    assert rare
    for s in seqs:
        assert hf(s)["input_ids"] == ours.encode(s, add_special=True).tolist()
    assert hf.convert_tokens_to_ids(["<mask>", "<pad>", "<null_1>"]) == [32, 1, 31]


def babylm_folder(root: Path) -> dict[str, list[str]]:
    """A BabyLM-style folder from the real text files; returns domain -> the expected records."""
    root.mkdir()
    swda = (TEXT / "switchboard_swda_val_set.txt").read_text().splitlines()
    sw_lines = [f"{ln.split('|')[0]}:\t{ln.split('|')[1]}" for ln in swda if ln.count("|") >= 2]
    # CRLF endings and blank lines between dialogues: neither may reach the tokens
    (root / "switchboard.train").write_bytes(("\r\n".join(sw_lines[:1500]) + "\r\n\r\n").encode())
    (root / "gutenberg.train").write_bytes((TEXT / "gutenberg_pg11_alice_in_wonderland.txt").read_bytes())  # BOM
    (root / "shakespeare.train").write_text("\n".join((TEXT / "tinyshakespeare.txt").read_text().splitlines()[:4000]))
    (root / "notes.txt").write_text("not a .train file\n")
    exp = {}
    for p in sorted(root.glob("*.train")):
        text = p.read_bytes().decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n")
        exp[p.stem] = [ln for ln in text.split("\n") if ln.strip()]
    assert (root / "gutenberg.train").read_bytes().startswith(b"\xef\xbb\xbf")
    return exp


def test_babylm_spm(work):
    exp = babylm_folder(work / "babylm")
    spm = work / "tok" / "spm"
    assert run("train-spm", "--input", work / "babylm", "--output", spm, "--vocab-size", 1000) == 0
    assert run("babylm", "--input", work / "babylm", "--output", work / "bl", "--spm", f"{spm}.model") == 0
    m = load_manifest(work / "bl")
    lines = [ln for d in sorted(exp) for ln in exp[d]]
    assert m.total_samples == len(lines) and m.stats["residues"] == sum(map(len, lines))
    assert m.stats["input"]["bom_stripped"] == 1 and m.stats["input"]["crlf_lines"] == 1501
    assert m.tokenizer["model"] == "tokenizer.model" and m.tokenizer["vocab_size"] == 1000
    assert m.tokenizer["sha256"] == hashlib.sha256((work / "bl" / "tokenizer.model").read_bytes()).hexdigest()
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=str(work / "bl" / "tokenizer.model"))
    got = samples(work / "bl")
    decoded = [(meta["domain"], sp.decode(t.tolist())) for t, meta in got.values()]
    assert decoded == [(d, ln) for d in sorted(exp) for ln in exp[d]]
    assert all(t.dtype == np.uint16 for t, _ in got.values())
    assert not any("\ufeff" in t or "\r" in t for _, t in decoded)
    assert decoded[-1][0] == "switchboard" and decoded[-1][1].startswith(("A:\t", "B:\t"))


def test_filters_skip_strict_and_dedup(work, capsys):
    recs = fasta_records(PHIX)
    path = work / "phix_bad.fasta"
    seqs = [s for *_, s in recs]
    seqs[5] = seqs[5][:30] + "*" + seqs[5][31:]  # invalid character
    seqs[7] = seqs[2]  # exact duplicate
    path.write_text("".join(f">{r[0]}\n{s}\n" for r, s in zip(recs, seqs)))
    lengths = [len(s) for s in seqs]
    cut = sorted(lengths)[100]
    assert run("genome", "--input", path, "--output", work / "filt", "--max-length", cut, "--dedup") == 0
    m = load_manifest(work / "filt")
    longer = sum(n > cut for i, n in enumerate(lengths) if i != 5)
    fits = [s.upper() for i, s in enumerate(seqs) if i != 5 and len(s) <= cut]
    # the real variants file already holds identical genomes; seqs[7] adds one more copy
    assert m.filtered == {"empty": 0, "shorter_than_10": 0, f"longer_than_{cut}": longer,
                          "duplicate": len(fits) - len(set(fits)), "invalid_character": 1}
    assert m.total_samples == 134 - sum(m.filtered.values())
    capsys.readouterr()
    assert run("genome", "--input", path, "--output", work / "strict", "--strict") == 1
    assert capsys.readouterr().err.strip() == (
        f"data_prep: error: {path}:12:31: character '*' is not in the tokenizer alphabet (record {recs[5][0]})")
    assert not (work / "strict").exists() and not (work / "strict.partial").exists()


def test_dedup_two_jobs_equal_one(work):
    recs = fasta_records(PHIX)[:40]
    path = work / "dups.fasta"
    path.write_text("".join(f">{r[0]}\n{r[2]}\n" for r in recs + recs[::3]))
    assert run("genome", "--input", path, "--output", work / "d1", "--dedup", "--shard-size", 7) == 0
    for i in range(2):
        assert run("genome", "--input", path, "--output", work / "d2", "--dedup", "--num-jobs", 2,
                   "--job-index", i, "--shard-size", 7) == 0
    assert run("merge", "--output", work / "d2") == 0
    one, two = samples(work / "d1"), samples(work / "d2")
    assert len(one) == 40 and {k: (t.tobytes(), m) for k, (t, m) in one.items()} == \
        {k: (t.tobytes(), m) for k, (t, m) in two.items()}
    assert load_manifest(work / "d2").filtered["duplicate"] == 14


@pytest.mark.parametrize("case", ["truncated_gzip", "empty", "binary", "no_text", "no_header", "bad_json"])
def test_bad_inputs_one_clear_error(case, tmp_path, capsys):
    phix = PHIX.read_text()
    src = {"no_header": "genome"}.get(case, "opengenome2")
    name = "bad.fna" if src == "genome" else "data_x_train_chunk1.jsonl.gz"
    path = tmp_path / name
    good = json.dumps({"text": fasta_records(PHIX)[0][2]}) + "\n"
    if case == "truncated_gzip":
        blob = gzip.compress((good * 3).encode())
        path.write_bytes(blob[: len(blob) // 2])
        want = f"{path}: corrupt or truncated gzip data"
    elif case == "empty":
        path.write_bytes(b"")
        want = f"input {path} is empty"
    elif case == "binary":
        path.write_bytes(gzip.compress(hashlib.sha256(b"x").digest() * 20 + b"\x00" * 8))
        want = f"{path}: binary data (NUL byte"
    elif case == "no_text":
        path.write_bytes(gzip.compress((good + json.dumps({"record": "r2", "sequence": "ACGT"}) + "\n").encode()))
        want = f"{path}:2: JSON line has no 'text' field"
    elif case == "bad_json":
        path.write_bytes(gzip.compress((good + good[: len(good) // 2] + "\n").encode()))
        want = f"{path}:2: not a JSON object"
    else:
        path.write_text(phix.split("\n", 1)[1])
        want = f"{path}:1: sequence data before the first '>' header"
    out = tmp_path / "out"
    assert run(src, "--input", path, "--output", out, "--shard-size", 1) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"data_prep: error: {want}") and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
