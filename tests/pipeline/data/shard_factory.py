"""Small shard directories written with the real ShardWriter and manifest code (no data_prep run), and the damage
the bad-input tests do to them. Shared by tests/pipeline/data and tests/reliability/test_bad_inputs_shards.py."""
from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np

from pipeline.data import protein_tokenizer, tokenizer
from pipeline.data.shards import Manifest, ShardWriter, sha256_file, write_manifest

REPO = Path(__file__).resolve().parents[3]
RFAM = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"

NUCLEOTIDE = {"name": "nucleotide", "vocab": list(tokenizer.VOCAB), "alphabet": "rna"}
ESM = {"name": "esm", "vocab": list(protein_tokenizer.VOCAB)}


def spm_entry(vocab_size: int) -> dict:
    return {"name": "sentencepiece", "model": tokenizer.SPM_NAME, "sha256": "0" * 64, "vocab_size": vocab_size,
            "pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}


def write_dir(directory: Path, shards: list[list[tuple[str, np.ndarray]]], entry: dict = NUCLEOTIDE,
              vocab_size: int = 256, source: str = "test") -> Path:
    """One tar per inner list of (key, tokens), then manifest.json; every shard's sha256 recorded."""
    directory.mkdir(parents=True, exist_ok=True)
    infos = []
    for i, samples in enumerate(shards):
        w = ShardWriter(directory, prefix=f"part{i:02d}", max_samples=len(samples) + 1, vocab_size=vocab_size)
        for key, tokens in samples:
            w.write(key, tokens, {"id": key})
        infos += w.close()
    write_manifest(directory, Manifest(source=source, tokenizer=entry, shards=infos))
    return directory


def random_dir(directory: Path, n_shards: int = 4, per_shard: int = 12, entry: dict = NUCLEOTIDE,
               seed: int = 0) -> Path:
    """Random nucleotide ids (6..21) of 5-40 tokens, keys 000000000000.. per shard."""
    rng = np.random.default_rng(seed)
    shards = [[(f"{j:012d}", rng.integers(6, 22, int(rng.integers(5, 41))).astype(np.uint8))
               for j in range(per_shard)] for _ in range(n_shards)]
    return write_dir(directory, shards, entry)


def rfam_by_class(directory: Path) -> Path:
    """The shipped Rfam train sample (2,107 real ncRNAs) with one shard per nRC class: 13 shards of one domain each
    (tRNA, miRNA, riboswitch, ...), the situation of a text corpus sharded file by file."""
    from pipeline.data.tokenizer import NucleotideTokenizer

    tok = NucleotideTokenizer("rna")
    by_class: dict[str, list] = {}
    name, seq = None, []
    with gzip.open(RFAM, "rt") as f:
        for line in list(f) + [">"]:
            line = line.strip()
            if line.startswith(">"):
                if name is not None:
                    by_class.setdefault(name.split()[1], []).append(tok.encode("".join(seq)))
                name, seq = line[1:], []
            elif line:
                seq.append(line)
    shards = [[(f"{j:012d}", ids) for j, ids in enumerate(by_class[c])] for c in sorted(by_class)]
    return write_dir(directory, shards, NUCLEOTIDE, vocab_size=len(tokenizer.VOCAB), source="rnacentral")


def shard_paths(directory: Path) -> list[Path]:
    return [directory / s["path"] for s in json.loads((directory / "manifest.json").read_text())["shards"]]


def rehash(directory: Path):
    """Record the current sha256 of every shard in the manifest (damage that should fail on its own, not on the
    digest)."""
    path = directory / "manifest.json"
    doc = json.loads(path.read_text())
    for s in doc["shards"]:
        s["sha256"] = sha256_file(directory / s["path"])
    path.write_text(json.dumps(doc))


def add_member(shard: Path, info: tarfile.TarInfo, data: bytes | None = None):
    """Append a member (a link, a name with '..') after the shard's samples, then record the new digest."""
    with tarfile.open(shard, "a") as tf:
        tf.addfile(info, io.BytesIO(data) if data is not None else None)
    rehash(shard.parent)


def set_manifest(directory: Path, **fields):
    path = directory / "manifest.json"
    doc = json.loads(path.read_text())
    doc.update(fields)
    path.write_text(json.dumps(doc))


def info(name: str, **kw) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti

