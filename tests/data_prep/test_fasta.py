"""FASTA reader on real data: the repo's Rfam sample and the shared RNAcentral test set.

Variants (BOM, no .gz suffix, lowercase, rewrapped, truncated) are byte transformations of the real files; only the
malformed-input cases add a deliberately bad line.
"""
import bz2
import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest

from data_prep import SOURCES
from data_prep.fasta import FastaError, iter_fasta
from pipeline.data.tokenizer import VOCAB, NucleotideTokenizer

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"
SHARED = REPO.parent / "shared" / "data"
RNACENTRAL = SHARED / "rna" / "rnacentral_ncrna6_testset.fasta"
RNA = NucleotideTokenizer("rna")


def reference(raw: bytes) -> list[tuple[str, str]]:
    """(id, sequence) by plain string splitting: an oracle independent of the reader."""
    blocks = raw.decode("ascii").replace("\r\n", "\n").split("\n>")
    out = []
    for block in blocks:
        head, *lines = block.removeprefix(">").split("\n")
        out.append((head.split()[0], "".join(s.strip() for s in lines)))
    return out


def parsed(path, tok=RNA):
    return [(r.id, r.seq.decode()) for r in iter_fasta(path, tok.invalid_positions)]


@pytest.fixture(scope="module")
def sample_raw() -> bytes:
    return gzip.decompress(SAMPLE.read_bytes())


def test_sample_records_and_roundtrip(sample_raw):
    records = list(iter_fasta(SAMPLE, RNA.invalid_positions))
    ref = reference(sample_raw)
    assert len(records) == len(ref) == 2107
    assert [(r.id, r.seq.decode()) for r in records] == ref
    assert sum(len(r.seq) for r in records) == 341_942
    first = records[0]
    assert (first.id, first.description, first.line) == ("RF00001_AF095839_1_346-228", "5S_rRNA", 1)
    for r in records:
        assert RNA.decode(RNA.encode(r.seq)) == r.seq.decode().upper().replace("T", "U")
    digest = hashlib.sha256(b"\n".join(r.seq for r in records)).hexdigest()
    assert digest == hashlib.sha256("\n".join(s for _, s in ref).encode()).hexdigest()


def test_gzip_detected_by_content_not_suffix(tmp_path, sample_raw):
    plain, disguised = tmp_path / "sample.fasta", tmp_path / "sample.txt"
    plain.write_bytes(sample_raw)
    disguised.write_bytes(SAMPLE.read_bytes())
    assert parsed(plain) == parsed(disguised) == parsed(SAMPLE)


def test_bom_and_crlf(tmp_path, sample_raw):
    assert b"\r\n" in sample_raw  # the sample keeps the upstream CRLF line endings
    bom = tmp_path / "bom.fasta"
    bom.write_bytes(b"\xef\xbb\xbf" + sample_raw)
    gz = tmp_path / "bom.fasta.gz"
    gz.write_bytes(gzip.compress(b"\xef\xbb\xbf" + sample_raw))
    assert parsed(bom) == parsed(gz) == reference(sample_raw)


def test_lowercase_any_wrap_width_and_blank_lines(tmp_path, sample_raw):
    ref = reference(sample_raw)
    headers = [h for h in sample_raw.decode().splitlines() if h.startswith(">")]
    for width in (1, 7, 10_000):
        lines = []
        for header, (_, seq) in zip(headers, ref):
            low = seq.lower()  # soft-masked bases
            lines += ["", header, ""] + [low[i:i + width] for i in range(0, len(low), width)]
        path = tmp_path / f"w{width}.fasta"
        path.write_text("\n".join(lines) + "\n\n")
        records = list(iter_fasta(path, RNA.invalid_positions))
        assert [(r.id, r.seq.decode().upper()) for r in records] == ref
        assert [RNA.encode(r.seq).tobytes() for r in records] == [RNA.encode(s).tobytes() for _, s in ref]


@pytest.mark.skipif(not RNACENTRAL.is_file(), reason="needs ../shared/data (RNAcentral test set)")
def test_rnacentral_testset_t_and_u():
    raw = RNACENTRAL.read_bytes()
    assert hashlib.sha256(raw).hexdigest().startswith("abf622e7f9ae4c14")
    records = list(iter_fasta(RNACENTRAL, RNA.invalid_positions))
    assert [(r.id, r.seq.decode()) for r in records] == reference(raw)
    assert len(records) == 6001 and sum(len(r.seq) for r in records) == 3_353_814
    assert sum(b"U" in r.seq for r in records) == 28  # exported mostly with T, a few records with U
    t_id, u_id = VOCAB.index("T"), VOCAB.index("U")
    dna = NucleotideTokenizer("dna")
    rna_ids = np.concatenate([RNA.encode(r.seq) for r in records])
    dna_ids = np.concatenate([dna.encode(r.seq) for r in records])
    assert not (rna_ids == t_id).any() and not (dna_ids == u_id).any()
    assert (rna_ids == u_id).sum() == (dna_ids == t_id).sum()
    assert RNA.decode(rna_ids) == b"".join(r.seq for r in records).decode().upper().replace("T", "U")
    assert SOURCES["rnacentral"].alphabet == "rna"


def first_lines(sample_raw, n):
    return sample_raw.decode().replace("\r\n", "\n").split("\n")[:n]


def test_bad_character_names_file_line_column(tmp_path, sample_raw):
    lines = first_lines(sample_raw, 8)
    assert lines[3].startswith(">RF00001_M28193_1_1-119")
    lines[4] = lines[4][:11] + "X" + lines[4][12:]  # one base of a real sequence line replaced
    path = tmp_path / "bad.fasta"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FastaError, match=rf"^{path}:5:12: character 'X' .*record RF00001_M28193_1_1-119"):
        list(iter_fasta(path, RNA.invalid_positions))
    # Without a validator the same file parses: the check belongs to the alphabet, not the format.
    assert len(list(iter_fasta(path))) == sum(s.startswith(">") for s in lines)


def test_non_ascii_character_column(tmp_path, sample_raw):
    lines = first_lines(sample_raw, 4)
    lines[1] = "ACG\u00e9" + lines[1]
    path = tmp_path / "utf8.fasta"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(FastaError, match=rf"^{path}:2:4: character '\u00e9'"):
        list(iter_fasta(path, RNA.invalid_positions))


def test_sequence_before_header(tmp_path, sample_raw):
    lines = first_lines(sample_raw, 4)
    path = tmp_path / "noheader.fasta"
    path.write_text("\n".join(["", lines[1]] + lines) + "\n")
    with pytest.raises(FastaError, match=rf"^{path}:2: sequence data before the first '>' header"):
        list(iter_fasta(path))


def test_header_without_id(tmp_path, sample_raw):
    lines = first_lines(sample_raw, 4)
    lines[2] = ">"
    path = tmp_path / "noid.fasta"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FastaError, match=rf"^{path}:3: header has no record id"):
        list(iter_fasta(path))


def test_truncated_gzip_and_other_compression(tmp_path):
    truncated = tmp_path / "cut.fasta.gz"
    truncated.write_bytes(SAMPLE.read_bytes()[:5000])
    with pytest.raises(FastaError, match=rf"^{truncated}: corrupt or truncated gzip"):
        list(iter_fasta(truncated))
    bzipped = tmp_path / "sample.fasta.bz2"
    bzipped.write_bytes(bz2.compress(gzip.decompress(SAMPLE.read_bytes())))
    with pytest.raises(FastaError, match="bzip2-compressed input is not supported"):
        list(iter_fasta(bzipped))
