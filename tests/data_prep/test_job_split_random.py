"""Randomized cases of the job split against one job: the shipped real samples cut into one to three inputs (some
gzipped, some CRLF, one without its last line end), records damaged the ways corpora are (lowercase, a character
outside the alphabet, no sequence, too short, very long, a blank inside, odd line widths, headers without a
description), read in chunks from 300 bytes to the default; for --clusters, the TSV parsed in blocks from 64 bytes
(less than a line) to the default, joined in many hash buckets or one.

Each case runs one job, then N = 2..4 jobs and ``merge``, then ``--workers N``: the same records (keys, tokens,
meta), manifest counts and filtered.tsv rows. Plain inputs on the byte-range split must also keep the one job's
order; a split by record index (gzip, --dedup, --window) and --clusters' split by cluster group the records by job
(same keys; docs/data.md "Jobs"). 300 + 230 seeds of such cases found nothing wrong before this was added; the
seeds here guard the option combinations that the other tests pin one at a time."""
import contextlib
import gzip
import io
import random

import pytest

from data_prep import cluster_write, clusters, cut

from test_job_split import RFAM, UR90, UR_TSV, content, run  # same folder

RNA = [r.lstrip(">") for r in gzip.decompress(RFAM.read_bytes()).decode().replace("\r\n", "\n").split("\n>")]
PROTEIN = [r.lstrip(">") for r in gzip.decompress(UR90.read_bytes()).decode().split("\n>")]


def damaged(rng: random.Random, record: str, invalid: str) -> str:
    """One record of a FASTA text (header line, sequence lines), perhaps damaged, rewrapped at a random width."""
    head, *lines = record.split("\n")
    seq = "".join(lines)
    r = rng.random()
    if r < 0.05:
        seq = seq.lower()
    elif r < 0.08:
        seq = seq[:len(seq) // 2] + invalid + seq[len(seq) // 2:]
    elif r < 0.10:
        seq = ""
    elif r < 0.12:
        seq = seq[:6]
    elif r < 0.13:
        seq = seq * 30
    elif r < 0.14:
        seq = seq[:5] + " " + seq[5:]
    if rng.random() < 0.05:
        head = head.split()[0]
    width = rng.choice([60, 10 ** 9, rng.randint(1, 200)])
    body = "\n".join(seq[i:i + width] for i in range(0, len(seq), width))
    return ">" + head + "\n" + (body + "\n" if body else "")


def inputs(rng: random.Random, tmp_path, texts: list, gz: bool = True) -> list:
    """``texts`` (whole records) cut into 1-3 files, each perhaps CRLF and (``gz``) perhaps gzipped; the last one
    may lack its final line end."""
    cuts = sorted(rng.sample(range(1, len(texts)), rng.randint(0, 2)))
    paths = []
    for f, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(texts)])):
        text = "".join(texts[a:b])
        if rng.random() < 0.2:
            text = text.replace("\n", "\r\n")
        if f == len(cuts) and rng.random() < 0.2:
            text = text.rstrip("\r\n")
        data = text.encode()
        path = tmp_path / f"in{f}.fa"
        if gz and rng.random() < 0.4:
            path, data = tmp_path / f"in{f}.fa.gz", gzip.compress(data)
        path.write_bytes(data)
        paths.append(path)
    return paths


def quiet(*args) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = run(*args)
    assert rc == 0, (args, err.getvalue())


def same_as_one_job(args: list, tmp_path, n: int, layout: str, ordered: bool) -> None:
    quiet(*args, "--output", tmp_path / "one")
    for i in range(n):
        quiet(*args, "--output", tmp_path / "jobs", "--num-jobs", n, "--job-index", i)
    quiet("merge", "--output", tmp_path / "jobs")
    quiet(*args, "--output", tmp_path / "workers", "--workers", n)
    one = content(tmp_path / "one", layout, ordered)
    assert content(tmp_path / "jobs", layout, ordered) == one
    assert content(tmp_path / "workers", layout, False) == content(tmp_path / "one", layout, False)


@pytest.mark.parametrize("seed", range(8))
def test_rnacentral_jobs_equal_one_job(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(cut, "CHUNK", rng.choice([300, 2000, 1 << 16, cut.CHUNK]))
    start = rng.randrange(len(RNA) - 300)
    records = [damaged(rng, r, "X") for r in RNA[start:start + rng.randint(20, 300)]]
    paths = inputs(rng, tmp_path, records, gz=seed % 2 == 1)  # even seeds: plain inputs, split by bytes
    args = ["rnacentral", "--input", *paths, "--shard-size", rng.choice([3, 50, 2000]),
            "--max-filtered-fraction", 1, "--min-length", rng.choice([1, 10, 40])]
    extra = rng.choice([[], [], [], ["--dedup"], ["--window", 50, "--stride", 20], ["--replace-invalid", "N"]])
    split_by_bytes = not any(p.suffix == ".gz" for p in paths) and not {"--dedup", "--window"} & set(extra)
    same_as_one_job(args + extra, tmp_path, rng.randint(2, 4), "sequences", ordered=split_by_bytes)


@pytest.mark.parametrize("seed", range(6))
def test_cluster_jobs_equal_one_job(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(cut, "CHUNK", rng.choice([300, 5000, 1 << 16, cut.CHUNK]))
    monkeypatch.setattr(cluster_write.Slots, "BATCH", rng.choice([5, 300, cluster_write.Slots.BATCH]))  # joined rows read at a time
    monkeypatch.setattr(cluster_write.Writer, "BATCH", rng.choice([3, 50, cluster_write.Writer.BATCH]))
    monkeypatch.setattr(clusters.ClusterMap, "BATCH", rng.choice([1, 7, clusters.ClusterMap.BATCH]))  # TSV rows a time
    members = [damaged(rng, r, "J") for r in PROTEIN if rng.random() > 0.05]  # some members missing
    rng.shuffle(members)
    head, *rows = UR_TSV.read_text().splitlines()
    tsv = tmp_path / "clusters.tsv"
    tsv.write_text("\n".join([head, *rng.sample(rows, rng.randint(len(rows) // 2, len(rows)))]) + "\n")
    args = ["uniref", "--input", *inputs(rng, tmp_path, members), "--clusters", tsv, "--max-filtered-fraction", 1,
            "--shard-size", rng.choice([3, 50, 2000]), "--min-length", rng.choice([1, 10, 40])]
    same_as_one_job(args, tmp_path, rng.randint(2, 4), "clusters", ordered=False)
