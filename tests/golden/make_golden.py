#!/usr/bin/env python
"""Regenerate the golden data (only to re-pin on purpose: the point of it is that it does not change):

    .venv/bin/python tests/golden/make_golden.py

1. tests/golden/data/{rna,protein,text}: small shard directories built by data_prep from the shipped samples (the
   first 400 Rfam records, the first 300 UniRef90 members) and, for the text families, from the first 4,000 lines
   of this repository's own Python sources with a 512-piece sentencepiece model; committed, so later data_prep
   changes cannot move them.
2. For every case in cases.py: 5 steps on 2 processes through the launcher; tests/golden/CASE.json holds each step's
   loss and grad norm. The CHECKPOINTED cases also keep their step-3 checkpoint, together in
   tests/golden/checkpoints.tar.
"""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: conftest's launch helpers
from conftest import read_jsonl, run_pretrain  # noqa: E402
from golden.cases import CASES, CHECKPOINTED, HERE, REPO, SAVED, STEPS, overrides  # noqa: E402


def prep(*args) -> None:
    subprocess.run([sys.executable, "-m", "data_prep", *map(str, args)], cwd=REPO, check=True, capture_output=True)


def first_records(src: Path, n: int, out: Path) -> Path:
    text = gzip.decompress(src.read_bytes()).decode()
    out.write_text(">" + ">".join(text.split(">")[1:n + 1]))
    return out


def build_data(tmp: Path) -> None:
    data = HERE / "data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir()
    samples = REPO / "data" / "samples"
    prep("rnacentral", "--input", first_records(samples / "rfam_nrc_train_sample.fasta.gz", 400, tmp / "rna.fa"),
         "--output", data / "rna", "--shard-size", 100)
    prep("uniref", "--input", first_records(samples / "uniref90_clusters_sample.fasta.gz", 300, tmp / "p.fa"),
         "--output", data / "protein", "--shard-size", 75, "--max-length", 1000)
    corpus = tmp / "corpus.txt"
    text = "".join(p.read_text() for p in sorted((REPO / "pipeline").glob("*.py")))
    corpus.write_text("\n".join(text.splitlines()[:4000]) + "\n")
    prep("train-spm", "--input", corpus, "--output", data / "spm", "--vocab-size", 512)
    prep("babylm", "--spm", data / "spm.model", "--input", corpus, "--output", data / "text", "--shard-size", 1000)
    (data / "spm.model").unlink()
    (data / "spm.vocab").unlink()


def main() -> int:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        build_data(tmp)
        saved = tmp / "checkpoints"
        for name, (config, ds_config, _) in CASES.items():
            run_dir = tmp / name
            r = run_pretrain(2, ds_config, overrides(name, str(run_dir)), ["--config", config])
            if r.returncode != 0:
                print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
                return 1
            steps = read_jsonl(run_dir / "metrics.jsonl")
            assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
            doc = {"config": config, "ds_config": ds_config, "steps": [
                {"step": m["step"], "loss": m["loss"], "grad_norm": m["grad_norm"]} for m in steps]}
            (HERE / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
            if name in CHECKPOINTED:
                dest = saved / name
                shutil.copytree(run_dir / "checkpoints" / f"step{SAVED:08d}", dest / f"step{SAVED:08d}")
                (dest / "latest").write_text(f"step{SAVED:08d}")
            print(f"{name}: losses {[round(m['loss'], 4) for m in steps]}")
        with tarfile.open(HERE / "checkpoints.tar", "w") as tar:
            for name in CHECKPOINTED:
                tar.add(saved / name, arcname=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
