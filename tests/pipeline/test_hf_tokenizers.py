"""The tokenizers an export carries (pipeline/data/hf_tokenizers.py), saved and reloaded with AutoTokenizer, give the
pipeline tokenizers' ids on real data: the nucleotide one on the shipped Rfam sample for each molecule rule, the
sentencepiece one on the golden BabyLM shards' text (and, when ../shared is there, the real text files); and the
shipped modeling code (pipeline/hf_code.py) refuses imports it could not ship."""
import gzip
import itertools

import pytest

from conftest import REPO, SAMPLE_FASTA, SHARED_DATA

pytest.importorskip("transformers")


def saved_and_loaded(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(str(tmp_path))
    return AutoTokenizer.from_pretrained(str(tmp_path))


def fasta_sequences(path, n):
    seqs, cur = [], []
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur))
                cur = []
                if len(seqs) == n:
                    break
            else:
                cur.append(line.strip())
    return seqs


@pytest.mark.parametrize("molecule", ["rna", "dna", None])
def test_the_nucleotide_tokenizer_gives_the_pipelines_ids(molecule, tmp_path):
    from pipeline.data.tokenizer import NucleotideTokenizer
    from pipeline.data.hf_tokenizers import nucleotide_tokenizer

    hf = saved_and_loaded(nucleotide_tokenizer(molecule), tmp_path)
    ours = NucleotideTokenizer(molecule)
    seqs = fasta_sequences(SAMPLE_FASTA, 300)
    seqs += [s.lower() for s in seqs[:20]] + [s.replace("U", "T") for s in seqs[:20]] + ["ACGTUNRYSWKMBDHV-"]
    assert len(seqs) == 341
    for s in seqs:
        assert hf(s)["input_ids"] == ours.encode(s, add_special=True).tolist(), s
        assert hf.decode(hf(s)["input_ids"], skip_special_tokens=True) == ours.decode(ours.encode(s)), s
    assert hf("AC<mask>G")["input_ids"] == [ours.cls_id, *ours.encode("AC").tolist(), ours.mask_id,
                                            *ours.encode("G").tolist(), ours.eos_id]
    assert (hf.mask_token_id, hf.pad_token_id, hf.cls_token_id, hf.eos_token_id, hf.unk_token_id) == (
        ours.mask_id, ours.pad_id, ours.cls_id, ours.eos_id, ours.unk_id)
    assert hf("AC*G")["input_ids"][3] == ours.unk_id  # outside the alphabet: <unk> (encode refuses it)
    batch = ["ACGU<mask>A", "G<mask>"]  # the pipeline tokenizer's call: the same ids, int64, padded
    got, want = ours(batch), hf(batch, padding=True, return_tensors="pt")
    assert got["input_ids"].dtype == want["input_ids"].dtype
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    assert got["attention_mask"].tolist() == want["attention_mask"].tolist()


def babylm_texts(limit):
    """Texts of the golden BabyLM shards, decoded with their own tokenizer (real BabyLM lines)."""
    import sentencepiece as spm

    from pipeline.data.shard_reader import shard_sequences

    sp = spm.SentencePieceProcessor(model_file=str(REPO / "tests/golden/data/text/tokenizer.model"))
    texts = []
    for tokens in shard_sequences(REPO / "tests/golden/data/text"):
        texts += [t for t in sp.decode([int(i) for i in tokens if i > 3]).split("\n") if t]
    assert len(texts) >= limit
    return texts[:limit]


def test_the_sentencepiece_tokenizer_gives_sentencepieces_ids(tmp_path):
    import sentencepiece as spm

    from pipeline.data.hf_tokenizers import sentencepiece_tokenizer

    model = REPO / "tests/golden/data/text/tokenizer.model"
    sp = spm.SentencePieceProcessor(model_file=str(model))
    hf = saved_and_loaded(sentencepiece_tokenizer(model), tmp_path)
    texts = babylm_texts(500)
    texts += ["  two  leading spaces", "tab\there", "digits 2024 and 3.14", "ü ß 漢字 🙂", "<unk> <s> </s> as text"]
    if SHARED_DATA.is_dir():
        for f in sorted((SHARED_DATA / "text").glob("*.txt")):
            texts += [t.rstrip("\n") for t in itertools.islice(open(f, encoding="utf-8"), 2000)]
    for t in texts:
        assert hf(t)["input_ids"] == [1] + sp.encode(t), t
        assert hf.decode(hf(t)["input_ids"], skip_special_tokens=True) == sp.decode(sp.encode(t))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 0, 3)


def test_shipped_code_refuses_what_it_cannot_ship(tmp_path, monkeypatch):
    from pipeline.hf_code import shipped_sources

    pkg = tmp_path / "pipeline_families_x"
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {"a": ("from pipeline.config import RunConfig\n", "imports pipeline.config, which an export does not ship"),
             "b": ("from pipeline.models import eco_rna\n", "imports a module"),
             "c": ("import pipeline.models.layers\n", "shipped code imports names")}
    pkg.mkdir()
    for name, (text, error) in cases.items():
        (pkg / f"{name}.py").write_text("import torch\n\n\ndef f():\n    " + text)
        with pytest.raises(ValueError, match=error):
            shipped_sources(f"pipeline_families_x.{name}")
    files = shipped_sources("pipeline.families.modeling_eco_rna")
    assert sorted(files) == ["attention_ops.py", "eco_rna.py", "heads.py", "hf_base.py", "layers.py",
                            "modeling_eco_rna.py", "norm_op.py"]  # heads.py: the adapted models' classes
    assert "from .eco_rna import EcoRNA, initial_state, state_table\n" in files["modeling_eco_rna.py"]
    package = (REPO / "pipeline/models/eco_rna.py").read_text().splitlines()
    shipped = files["eco_rna.py"].splitlines()
    assert len(shipped) == len(package)
    assert all(a == b or b.startswith("from .") or not b for a, b in zip(package, shipped))
