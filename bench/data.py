#!/usr/bin/env python
"""Benchmark: the data pipeline against the floor of its own I/O, as ratios measured in one run.

    python bench/data.py [--quick] [--input FASTA(.gz)] [--shard-size 2000] [--repeats 3] [--workers 0]

(a) Loader: tokens/s of ShardStream over one epoch of the shards (shard and in-shard permutation, per-sample seeded
    transform, <cls>/<eos> framing, collate into padded microbatches, position bookkeeping) against a bare read +
    decode of the same tars (tarfile iteration + np.load of every .npy member: a block's tokens and bounds, split
    into its records by the bounds; a per-record shard's tokens; nothing else). A second ratio uses the loader's own
    faster npy decode in the bare read too, so it isolates everything else the loader does. The ratio uses a
    framing-only transform, so it measures the loader; the line below it adds Eco-RNA's span masking (objective
    work, reported for scale). Tokens are stored sequence tokens in both cases (the context is set above the longest
    record, so nothing is cropped). Target ratio >= 0.8.  ->  RESULT P2
(b) data_prep: input MB/s of ``python -m data_prep SOURCE`` (a fresh process, as ``gzip -dc`` is: interpreter
    start, imports, parse, normalize, filter, tokenize, write tars + sha256 + manifest) against ``gzip -dc`` of the
    same gzipped input (MB = compressed input bytes), timed in rotation, the output directory removed outside the
    timing. The inputs stand for multi-GB corpora: each file of ../shared/data is repeated to about ``--mb`` MB of
    FASTA (default 64; record ids made unique by a suffix ``_<copy>``, for --clusters in the mapping TSV too) and
    gzipped (level 6) into the temp dir, so that the fixed cost of a run (printed apart: a 10-record input) does not
    decide the ratio.
    - RNAcentral with 1 process (RESULT P3, target >= 0.5) and with ``--workers 2`` (RESULT P3w2: the main
      process decompresses, numbers and writes the chunks of records in input order, two pool processes parse them;
      against one ``gzip -dc``: 0.5 per worker, target >= 1.0, on a machine with 2 free cores);
    - the UniRef50 files (``uniref``, 1 and 2 workers: RESULT P3u, P3u100 and their w2);
    - ``uniref --clusters TSV`` on the UniRef90 member sample, same size, 1 process (RESULT P3uc, target >= 0.5;
      2 workers printed too).
    Each prints its seconds and its per-rotation ratio as min / median / max over the rotations, the CPU seconds of
    each side (on a loaded machine they tell the work apart from the waiting) and the peak RSS of data_prep.
(c) Clusters memory: peak RSS (ru_maxrss from os.wait4: the data_prep process and its children) of the 1-process
    ``uniref --clusters`` run of (b) (the largest of its repeats) and of one run on SCALE (10) x the copies (about
    640 MB of FASTA, gzipped streaming, the TSV likewise): RESULT P3uc.rss10 = peak at 10x / peak at 1x, target
    <= 1.2 (memory bounded by the cluster map, not the input). The 10x run's speed against one ``gzip -dc`` of it is
    RESULT P3uc.x10 (one run each: the input is large).
(d) Job array split: the input (RNAcentral) repeated to SCALE x ``--mb`` MB as one plain FASTA (byte-range splitting
    applies to plain files only); in rotation, one job (``data_prep rnacentral``) against two jobs started together
    (``--num-jobs 2 --job-index 0`` and ``1``, wall from the start of the first to the end of the last), then
    ``data_prep merge`` timed apart. RESULT P3j2 = one job / two jobs (best of each; target >= 1.7 on 2 free
    cores); P3j2.merged adds the merge to the two jobs. The first rotation also reads both outputs (manifest totals,
    and sha256 of every (key, tokens) in manifest order): ``merged == one job: True``, else the script exits 1.

Default input: RNAcentral ncRNA test set from ../shared/data (gzipped into a temp dir), else the shipped Rfam sample;
the loader (a) reads the shards of the file as it is (not repeated). Each RESULT ratio is of the best time of each
side over ``--repeats`` rotations (spreads printed beside it; ``--quick``: 2 repeats, and the masked loader epoch
left out; (c) and (d) run under --quick too). Peak RSS is read through a bare launcher process (LAUNCHER). The
project's modules are byte-compiled first, as scripts/setup.sh leaves them: where PYTHONDONTWRITEBYTECODE is set,
a fresh process would otherwise compile them again each time (0.08 s of data_prep's start-up), which no installed
data_prep does. The default run takes about 2.5 minutes on two quiet cores (--quick about 2; most of it the one 10x
clusters run) and up to about 1.3 GB of the temp dir, for (d): its input and one output at a time.
"""
from __future__ import annotations

import argparse
import compileall
import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.config import load_config  # noqa: E402
from pipeline.data.loader import ShardStream  # noqa: E402
from pipeline.data.shard_reader import decode_tokens  # noqa: E402
from pipeline.data.shards import load_manifest  # noqa: E402
from pipeline.objectives.eco_rna import make_transform  # noqa: E402

DEFAULT_INPUTS = [REPO.parent / "shared" / "data" / "rna" / "rnacentral_ncrna6_testset.fasta",
                  REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"]


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def best_interleaved(fns: list, repeats: int) -> list[tuple[float, object]]:
    """Best time of each of ``fns``, run in rotation so that a slow spell of the machine hits all of them alike."""
    results = [(float("inf"), None)] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t, out = best(fn, 1)
            results[i] = (min(t, results[i][0]), out)
    return results


def np_load(raw: bytes) -> np.ndarray:
    return np.load(io.BytesIO(raw), allow_pickle=False)


def bare_read(shard_dir: Path, decode=np_load) -> tuple[int, int]:
    """(tokens, longest record) of every shard by plain tar iteration + ``decode`` of each .npy member: a block's
    bounds then tokens, cut into its records (views); a per-record shard's tokens."""
    tokens = longest = 0
    for s in load_manifest(shard_dir).shards:
        with tarfile.open(shard_dir / s.path, "r") as tf:
            bounds = None
            for m in tf:
                if m.name.endswith(".bounds.npy"):
                    bounds = decode(tf.extractfile(m).read()).tolist()
                elif m.name.endswith(".tokens.npy"):
                    t = decode(tf.extractfile(m).read())
                    records = [t] if bounds is None else [t[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
                    bounds = None
                    for r in records:
                        tokens, longest = tokens + len(r), max(longest, len(r))
    return tokens, longest


def frame_only(tokens: np.ndarray, rng: np.random.Generator) -> dict:
    """<cls> tokens <eos>, every position supervised: the loader's own work without an objective's corruption."""
    from pipeline.data.tokenizer import NucleotideTokenizer as tok

    framed = np.concatenate([[tok.cls_id], tokens, [tok.eos_id]]).astype(np.int64)
    return {"input_ids": framed, "labels": framed}


def loader_epoch(shard_dir: Path, context: int, micro_batch: int, workers: int, masked: bool) -> int:
    """Stored tokens delivered by the real loader (rank 0 of 1) in the whole batches of one epoch."""
    from pipeline.data.loader import make_loader

    manifest = load_manifest(shard_dir)
    cfg = load_config(None, [f"data.context_length={context}"])
    ds = ShardStream(shard_dir, rank=0, world_size=1, num_workers=workers, micro_batch_size=micro_batch, seed=0,
                     transform=make_transform(cfg) if masked else frame_only, pad_id=0)
    tokens = 0
    for _, b in zip(range(manifest.total_samples // micro_batch), make_loader(ds, workers)):
        tokens += int(np.count_nonzero(b.attention_mask.numpy())) - 2 * len(b.sample_ids)  # without <cls>/<eos>
    return tokens


SHARED = REPO.parent / "shared" / "data" / "protein"
UNIREF = [SHARED / "uniref50_202104_esm2_train_5000.fasta", SHARED / "uniref50_2022_fullheader_100.fasta"]
SCALE = 10  # (c), (d): inputs repeated to SCALE x --mb
PACKAGES = ("pipeline", "data_prep")  # byte-compiled before the first timing
UNIREF90, CLUSTERS = SHARED / "uniref90_202104_members_of_ur50_first2500.fasta", \
    SHARED / "uniref50_to_uniref90_mapping_first2500.tsv"


def per_record_copy(shard_dir: Path, out: Path) -> Path:
    """The shard directory rewritten with one member group per record (the layout before blocks): the loader's
    speed on the old format, for comparison."""
    from pipeline.data.shard_reader import read_shard
    from pipeline.data.shards import Manifest, ShardWriter, write_manifest

    m = load_manifest(shard_dir)
    out.mkdir()
    infos = []
    for s in m.shards:
        w = ShardWriter(out, prefix=Path(s.path).stem, max_samples=s.samples, vocab_size=len(m.tokenizer["vocab"]))
        for key, tokens, meta in read_shard(shard_dir / s.path, s.samples):
            w.write(key, tokens, meta)
        infos += w.close()
    write_manifest(out, Manifest(m.source, m.tokenizer, infos, m.filtered, m.inputs, m.stats, m.layout,
                                 "bioseq-wds/1"))
    return out


def write_copies(src: Path, out, copies: int) -> None:
    """``src``'s FASTA (gunzipped if gzipped) written to the binary file ``out``; with ``copies`` > 1 its records
    ``copies`` times, ids suffixed ``_<copy>``, one copy at a time (memory: one copy, whatever ``copies``)."""
    raw = src.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if copies == 1:
        out.write(raw)
        return
    raw = raw if raw.endswith(b"\n") else raw + b"\n"
    for k in range(copies):
        out.write(re.sub(rb"(?m)^>(\S+)", lambda m, k=k: b">" + m[1] + b"_%d" % k, raw))


def gzipped(src: Path, tmp: Path, copies: int = 1) -> Path:
    """``src`` gzipped (level 6) into ``tmp``, streamed; with ``copies`` > 1 its records ``copies`` times, ids
    suffixed ``_<copy>``."""
    out = tmp / (src.name + (f".x{copies}" if copies > 1 else "") + ".gz")
    with gzip.open(out, "wb", compresslevel=6) as f:
        write_copies(src, f, copies)
    return out


def plain_copies(src: Path, tmp: Path, copies: int) -> Path:
    """``src``'s records ``copies`` times as one uncompressed FASTA in ``tmp`` (ids suffixed as by gzipped)."""
    out = tmp / f"{src.name.removesuffix('.gz')}.x{copies}.plain.fasta"
    with open(out, "wb") as f:
        write_copies(src, f, copies)
    return out


def tsv_copies(src: Path, tmp: Path, copies: int) -> Path:
    """The --clusters mapping TSV for gzipped(..., copies): every cluster and member id suffixed per copy, as
    gzipped suffixes the records (none for one copy: a small --mb gave the TSV suffixes its FASTA lacked)."""
    head, *rows = src.read_text().splitlines()
    rows = [r for r in rows if r]
    out = tmp / f"{src.stem}.x{copies}.tsv"

    def suffixed(row: str, k: int) -> str:  # "cluster<TAB>member,member,..."
        if copies == 1:
            return row
        cluster, members = row.split("\t", 1)
        return f"{cluster}_{k}\t" + ",".join(f"{m}_{k}" for m in members.split(","))
    with open(out, "w") as f:
        f.write(head + "\n")
        for k in range(copies):
            f.write("".join(suffixed(r, k) + "\n" for r in rows))
    return out


class Run(NamedTuple):
    wall: float  # seconds, from before the first process started to after the last one ended
    cpu: float  # user + system seconds of the processes and their children
    rss: float  # MB: the largest peak resident set size among the processes and their children (ru_maxrss)


# Starts the commands of argv[1] (JSON) together, waits for each with os.wait4 and prints their wall time, exit
# statuses, CPU seconds and ru_maxrss. The bench starts it rather than its commands, because a process's ru_maxrss
# counts the memory it had before its exec: Python starts a child with vfork (or fork), whose exec records the
# peak RSS of the process it came from, here this bench (hundreds of MB of numpy, torch and inputs), not the
# child's own. This launcher is a bare interpreter (-I -S, about 11 MB); it times from just before the first start
# to the end of the last, so its own start-up is outside the timing.
LAUNCHER = """
import json, os, subprocess, sys, time
cmds = json.loads(sys.argv[1])
t0 = time.perf_counter()
procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL) for c in cmds]
done = []
for p in procs:
    _, status, ru = os.wait4(p.pid, 0)
    done.append((os.waitstatus_to_exitcode(status), ru.ru_utime + ru.ru_stime, ru.ru_maxrss))
print(json.dumps({"wall": time.perf_counter() - t0, "done": done}))
"""


def run_timed(*cmds: list) -> Run:
    """One run of ``cmds``, started together (each a fresh process, stdout discarded) by LAUNCHER, which waits for
    each with os.wait4: its rusage is that process's own and its waited-for children's (ru_maxrss: the largest)."""
    with tempfile.TemporaryFile() as err:
        r = subprocess.run([sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps([list(map(str, c)) for c in cmds])],
                           stdout=subprocess.PIPE, stderr=err, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        err.seek(0)
        if r.returncode:
            raise SystemExit(f"bench/data.py: the launcher failed ({r.returncode}): {err.read().decode()}")
        out = json.loads(r.stdout)
        failed = [(c, rc) for c, (rc, _, _) in zip(cmds, out["done"]) if rc]
        if failed:
            raise SystemExit("; ".join(f"{' '.join(map(str, c))} failed with exit status {rc}" for c, rc in failed)
                             + f": {err.read().decode(errors='replace')}")
    return Run(out["wall"], sum(d[1] for d in out["done"]), max(d[2] for d in out["done"]) / 1024)  # Linux: KB


def spread(xs: list, fmt: str = "{:.3f}") -> str:
    """min / median / max of ``xs``."""
    return " / ".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))


def prep_cmd(args: list, gz: Path, out: Path, shard_size: int, workers: int) -> list:
    return [sys.executable, "-m", "data_prep", *map(str, args), "--input", str(gz), "--output", str(out),
            "--shard-size", str(shard_size), "--workers", str(workers), "--progress", "off"]


def prep_vs_gzip(tmp: Path, name: str, gz: Path, args: list, shard_size: int, repeats: int,
                 workers: tuple = (1, 2)) -> dict:
    """``gzip -dc gz`` and ``python -m data_prep args`` on it with each of ``workers``, each in a fresh process,
    timed in rotation (the output directory removed before each run, outside the timing): every Run by key
    ("gzip", "w1", "w2"), the best wall time by key, the CPU seconds of that best run."""
    out = tmp / f"shards-{name}"
    runs = {"gzip": [], **{f"w{w}": [] for w in workers}}
    for _ in range(repeats):
        runs["gzip"].append(run_timed(["gzip", "-dc", str(gz)]))
        for w in workers:
            shutil.rmtree(out, ignore_errors=True)
            runs[f"w{w}"].append(run_timed(prep_cmd(args, gz, out, shard_size, w)))
    shutil.rmtree(out, ignore_errors=True)
    fastest = {k: min(v) for k, v in runs.items()}  # Run orders by wall time first
    return {"mb": gz.stat().st_size / 1e6, "runs": runs, **{k: r.wall for k, r in fastest.items()},
            "cpu": {k: r.cpu for k, r in fastest.items()}}


def rotation_ratios(r: dict, key: str) -> list:
    """gzip -dc time / data_prep time of each rotation (the two timed next to each other)."""
    return [g.wall / p.wall for g, p in zip(r["runs"]["gzip"], r["runs"][key])]


def content(shard_dir: Path) -> tuple[int, int, str]:
    """(total_samples, total_tokens of manifest.json, sha256 of every (key, tokens) read from the shards in manifest
    order): two directories with equal digests hold the same records in the same order."""
    from pipeline.data.shard_reader import read_shard

    m = json.loads((shard_dir / "manifest.json").read_text())
    h = hashlib.sha256()
    for s in m["shards"]:
        for key, tokens, _ in read_shard(shard_dir / s["path"], s["samples"]):
            h.update(b"%s\0%s\0%d\0" % (key.encode(), tokens.dtype.str.encode(), len(tokens)))
            h.update(np.ascontiguousarray(tokens).tobytes())
    return m["total_samples"], m["total_tokens"], h.hexdigest()


def clusters_at_scale(tmp: Path, k: int, shard_size: int) -> dict:
    """One gzip -dc and one 1-process ``data_prep uniref --clusters`` on the UniRef90 members repeated ``k`` times
    (the gzipped input and the TSV written streaming, removed after)."""
    gz, tsv = gzipped(UNIREF90, tmp, k), tsv_copies(CLUSTERS, tmp, k)
    out = tmp / "shards-clusters-big"
    g = run_timed(["gzip", "-dc", str(gz)])
    os.sync()  # the previous outputs' writeback is not this run's
    p = run_timed(prep_cmd(["uniref", "--clusters", tsv], gz, out, shard_size, 1))
    r = {"copies": k, "mb": gz.stat().st_size / 1e6, "fasta_mb": k * UNIREF90.stat().st_size / 1e6, "gzip": g,
         "prep": p}
    shutil.rmtree(out, ignore_errors=True)
    gz.unlink()
    tsv.unlink()
    return r


def jobs_split(tmp: Path, src: Path, k: int, shard_size: int, repeats: int) -> dict:
    """One job against two concurrent jobs (``--num-jobs 2 --job-index 0`` and ``1``, byte ranges of a plain FASTA)
    on ``src`` repeated ``k`` times, uncompressed; then ``merge`` of the two, timed apart; in rotation, ``repeats``
    times. The first rotation also reads both outputs: the merged one must hold the one job's records."""
    fasta = plain_copies(src, tmp, k)
    o1, o2 = tmp / "shards-one-job", tmp / "shards-two-jobs"

    def cmd(out: Path, *extra) -> list:
        return [sys.executable, "-m", "data_prep", "rnacentral", "--input", str(fasta), "--output", str(out),
                "--shard-size", str(shard_size), "--progress", "off", *extra]
    one, two, merge, same = [], [], [], None
    for i in range(repeats):
        shutil.rmtree(o1, ignore_errors=True)
        os.sync()
        one.append(run_timed(cmd(o1)))
        if i == 0:
            want = content(o1)
        shutil.rmtree(o1, ignore_errors=True)  # the one job's output goes before the two jobs write theirs
        shutil.rmtree(o2, ignore_errors=True)
        os.sync()
        two.append(run_timed(cmd(o2, "--num-jobs", "2", "--job-index", "0"),
                             cmd(o2, "--num-jobs", "2", "--job-index", "1")))
        merge.append(run_timed([sys.executable, "-m", "data_prep", "merge", "--output", str(o2)]))
        if i == 0:
            got = content(o2)
            same = (got == want, want, got)
        shutil.rmtree(o2, ignore_errors=True)
    r = {"copies": k, "mb": fasta.stat().st_size / 1e6, "one": one, "two": two, "merge": merge, "same": same}
    fasta.unlink()
    return r


def fixed_cost(tmp: Path, src: Path, repeats: int) -> tuple[float, float, float]:
    """(seconds of a fresh ``python -m data_prep rnacentral`` on the first 10 records of ``src``, seconds of the
    same run in this process after a first one, peak RSS MB of the fresh process): process start + imports, and what
    a run costs beyond its records (arguments, work directory, shard, manifest)."""
    from data_prep.__main__ import main as prep_main

    raw = gzip.decompress(src.read_bytes()) if src.read_bytes()[:2] == b"\x1f\x8b" else src.read_bytes()
    small = tmp / "ten.fa"
    small.write_bytes(b">" + b"\n>".join(raw.split(b"\n>")[:10]).lstrip(b">") + b"\n")
    out = tmp / "shards-ten"
    fresh = inproc = float("inf")
    rss = 0.0
    for _ in range(repeats + 1):
        shutil.rmtree(out, ignore_errors=True)
        r = run_timed(prep_cmd(["rnacentral"], small, out, 2000, 1))
        fresh, rss = min(fresh, r.wall), max(rss, r.rss)
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            prep_main(["rnacentral", "--input", str(small), "--output", str(out), "--progress", "off"])
        inproc = min(inproc, time.perf_counter() - t0) if _ else inproc  # the first in-process call: imports
    return fresh, inproc, rss


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", type=Path, default=next((f for f in DEFAULT_INPUTS if f.is_file()), None))
    p.add_argument("--shard-size", type=int, default=2000)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers for the loader run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 repeats, no masked loader epoch (bench/run_all.py)")
    p.add_argument("--mb", type=float, default=64.0,
                   help="(b) each input repeated to about this many MB of FASTA before gzip (default 64)")
    args = p.parse_args(argv)
    if args.input is None or not args.input.is_file():
        p.error(f"--input {args.input}: file not found")
    repeats = min(args.repeats, 2) if args.quick else args.repeats
    import pipeline.data.shards  # noqa: F401 -- imported before the first timing
    for package in PACKAGES:  # byte-compiled as scripts/setup.sh leaves them (see the docstring)
        compileall.compile_dir(REPO / package, quiet=1)

    def copies(f: Path, mb: float = args.mb) -> int:
        size = len(gzip.decompress(f.read_bytes())) if f.read_bytes()[:2] == b"\x1f\x8b" else f.stat().st_size
        return max(1, round(mb * 1e6 / size))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gz = gzipped(args.input, tmp)
        gz_mb = gz.stat().st_size / 1e6
        fixed = fixed_cost(tmp, args.input, repeats)
        # (b) data_prep vs gzip -dc, RNAcentral (the default input) then the UniRef files, each repeated
        k_rna = copies(args.input)
        rna = prep_vs_gzip(tmp, "rna", gzipped(args.input, tmp, k_rna), ["rnacentral"], args.shard_size, repeats)
        rna["copies"] = k_rna
        shard_dir = tmp / "shards-rna"
        # the shards of the file itself (1 process) for the loader
        from data_prep.__main__ import main as prep_main
        with contextlib.redirect_stdout(io.StringIO()):
            prep_main(["rnacentral", "--input", str(gz), "--output", str(shard_dir), "--shard-size",
                       str(args.shard_size)])
        manifest = load_manifest(shard_dir)
        uniref = {}
        for f in UNIREF:
            if f.is_file():
                k = copies(f)
                uniref[f.name] = prep_vs_gzip(tmp, f.stem, gzipped(f, tmp, k), ["uniref"], args.shard_size, repeats)
                uniref[f.name]["copies"] = k
        clusters = None
        if UNIREF90.is_file() and CLUSTERS.is_file():
            k = copies(UNIREF90)
            clusters = prep_vs_gzip(tmp, "clusters", gzipped(UNIREF90, tmp, k),
                                    ["uniref", "--clusters", tsv_copies(CLUSTERS, tmp, k)], args.shard_size, repeats)
            clusters["copies"] = k

        # (a) loader vs bare read + decode of the same shards; context above the longest record: no cropping
        _, longest = bare_read(shard_dir)
        context = longest + 2
        per_record = per_record_copy(shard_dir, tmp / "shards-per-record")
        runs = [lambda: bare_read(shard_dir), lambda: bare_read(shard_dir, decode_tokens),
                lambda: loader_epoch(shard_dir, context, args.micro_batch, args.workers, False),
                lambda: loader_epoch(per_record, context, args.micro_batch, args.workers, False)]
        if not args.quick:
            runs.append(lambda: loader_epoch(shard_dir, context, args.micro_batch, args.workers, True))
        timed = best_interleaved(runs, repeats)
        (t_bare, (bare_tokens, _)), (t_own, _), (t_load, load_tokens), (t_old, old_tokens) = timed[:4]
        bare_rate, own_rate, load_rate = bare_tokens / t_bare, bare_tokens / t_own, load_tokens / t_load
        old_rate = old_tokens / t_old
        shutil.rmtree(per_record)

        # (c) the clusters path at SCALE x the size: peak memory and speed, one run (d) one job vs two on plain FASTA
        big = clusters_at_scale(tmp, clusters["copies"] * SCALE, args.shard_size) if clusters is not None else None
        jobs = jobs_split(tmp, args.input, k_rna * SCALE, args.shard_size, repeats)

    print(f"input: {args.input} ({gz_mb:.2f} MB gzipped, {manifest.total_samples} records, "
          f"{manifest.total_tokens} tokens, {len(manifest.shards)} shards, format {manifest.format})")
    print(f"(a) loader      {load_rate / 1e6:8.2f} M tokens/s  (workers={args.workers}, "
          f"micro_batch={args.micro_batch}, context={context})")
    print(f"    bare read   {bare_rate / 1e6:8.2f} M tokens/s  (tar + np.load, records cut by the block bounds)")
    print(f"    ratio loader / bare read+decode = {load_rate / bare_rate:.2f}  (reported: the floor is a vectorized "
          "block read)")
    print(f"    ratio loader / bare read with the loader's own npy decode = {load_rate / own_rate:.2f}  "
          f"(everything but read+decode: shuffle, framing, collate)")
    print(f"    loader on the same records in per-record shards (format 1) {old_rate / 1e6:.2f} M tokens/s: "
          f"blocks / per-record = {load_rate / old_rate:.2f}")
    if not args.quick:
        t_mask, mask_tokens = timed[4]
        print(f"    with Eco-RNA span masking: {mask_tokens / t_mask / 1e6:.2f} M tokens/s, "
              f"ratio {mask_tokens / t_mask / bare_rate:.2f}")

    load = os.getloadavg()
    print(f"(b) fresh processes (interpreter start included on both sides) on inputs repeated to ~{args.mb:.0f} MB "
          f"of FASTA, ids suffixed _<copy>; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
          f"{os.cpu_count()} CPUs")
    print(f"    fixed cost of a run (first 10 records of {args.input.name}): {fixed[0] * 1e3:.0f} ms in a fresh "
          f"process (interpreter, imports), {fixed[1] * 1e3:.0f} ms in a warm one (arguments, work dir, shard, "
          f"manifest); peak RSS of the fresh process {fixed[2]:.0f} MB")

    def show(label: str, r: dict):
        cpu, runs = r["cpu"], r["runs"]
        print(f"(b) {label} x{r['copies']}: gzip -dc {r['mb'] / r['gzip']:6.2f} MB/s, data_prep "
              f"{r['mb'] / r['w1']:6.2f} MB/s (ratio {r['gzip'] / r['w1']:.3f}), --workers 2 "
              f"{r['mb'] / r['w2']:6.2f} MB/s (ratio {r['gzip'] / r['w2']:.3f}, speed-up {r['w1'] / r['w2']:.2f}x)"
              f"  [{r['mb']:.2f} MB gzipped; CPU s: gzip {cpu['gzip']:.2f}, 1 process {cpu['w1']:.2f}, "
              f"2 workers + reader {cpu['w2']:.2f}]")
        print(f"    without the fixed cost of a fresh process ({fixed[0]:.2f} s, what a multi-GB input makes "
              f"negligible): ratio {r['gzip'] / (r['w1'] - fixed[0]):.3f} 1 process, "
              f"{r['gzip'] / (r['w2'] - fixed[0]):.3f} --workers 2")
        secs = ", ".join(f"{what} {spread([x.wall for x in runs[k]], '{:.2f}')}"
                         for k, what in (("gzip", "gzip -dc"), ("w1", "1 process"), ("w2", "--workers 2")))
        print(f"    over {len(runs['gzip'])} rotations, min / median / max: seconds {secs}; ratio per rotation "
              f"{spread(rotation_ratios(r, 'w1'))} 1 process, {spread(rotation_ratios(r, 'w2'))} --workers 2; "
              f"peak RSS {max(x.rss for x in runs['w1']):.0f} MB 1 process, {max(x.rss for x in runs['w2']):.0f} MB "
              "--workers 2")
    show(f"rnacentral {args.input.name}", rna)
    for name, r in uniref.items():
        show(f"uniref {name}", r)
    if clusters is not None:
        show(f"uniref --clusters {UNIREF90.name}", clusters)
    if big is not None:
        peak1 = max(r.rss for r in clusters["runs"]["w1"])
        b_gzip, b_prep = big["gzip"], big["prep"]
        print(f"(c) uniref --clusters peak memory, 1 process (ru_maxrss of data_prep and its children, os.wait4): "
              f"x{clusters['copies']} ({clusters['copies'] * UNIREF90.stat().st_size / 1e6:.0f} MB of FASTA) "
              f"{peak1:.0f} MB (max of {repeats} runs; min {min(r.rss for r in clusters['runs']['w1']):.0f}), "
              f"x{big['copies']} ({big['fasta_mb']:.0f} MB of FASTA, {big['mb']:.1f} MB gzipped) {b_prep.rss:.0f} MB "
              f"(one run): {SCALE} x the input, {b_prep.rss / peak1:.2f} x the peak; less the {fixed[2]:.0f} MB of a "
              f"10-record run (interpreter, imports): {(b_prep.rss - fixed[2]) / max(peak1 - fixed[2], 1):.2f} x")
        print(f"    x{big['copies']}, one run each (the input is large): gzip -dc {big['mb'] / b_gzip.wall:6.2f} MB/s "
              f"({b_gzip.wall:.1f} s), data_prep {big['mb'] / b_prep.wall:6.2f} MB/s ({b_prep.wall:.1f} s, "
              f"CPU {b_prep.cpu:.1f} s), ratio {b_gzip.wall / b_prep.wall:.3f}")
    one, two, merge = ([r.wall for r in jobs[k]] for k in ("one", "two", "merge"))
    print(f"(d) --num-jobs 2 on plain FASTA (each job parses its byte range), {args.input.name} x{jobs['copies']} "
          f"({jobs['mb']:.0f} MB uncompressed), fresh processes, {repeats} rotations; seconds min / median / max:")
    print(f"    one job                 {spread(one, '{:.2f}')} s  ({jobs['mb'] / min(one):.1f} MB/s, "
          f"CPU {min(jobs['one']).cpu:.1f} s)")
    print(f"    two jobs, concurrently  {spread(two, '{:.2f}')} s  (start of the first to end of the last; "
          f"CPU {min(jobs['two']).cpu:.1f} s)")
    print(f"    merge                   {spread(merge, '{:.2f}')} s")
    print(f"    one job / two jobs per rotation {spread([a / b for a, b in zip(one, two)])}; including the merge "
          f"{spread([a / (b + m) for a, b, m in zip(one, two, merge)])}")
    same, want, got = jobs["same"]
    print(f"merged == one job: {same}  (first rotation: {want[0]} samples, {want[1]} tokens, content sha256 "
          f"{want[2][:16]}" + ("" if same else f"; merged: {got[0]} samples, {got[1]} tokens, {got[2][:16]}") + ")")
    print(f"RESULT P2 {load_rate / bare_rate:.3f} loader / bare tar+np.load read of the same shards, tokens/s "
          "(reported: the floor is a vectorized block read; per-sample loader work dominates)")
    print(f"RESULT P3 {rna['gzip'] / rna['w1']:.3f} data_prep rnacentral / gzip -dc, MB/s of gzipped input, "
          f"1 process, best of {repeats} (per rotation {spread(rotation_ratios(rna, 'w1'))}; target >= 0.5)")
    print(f"RESULT P3w2 {rna['gzip'] / rna['w2']:.3f} data_prep rnacentral --workers 2 (one job, its chunks "
          f"parsed by a pool of 2) / one gzip -dc, MB/s, best of {repeats} (per rotation "
          f"{spread(rotation_ratios(rna, 'w2'))}; target >= 1.0)")
    print(f"RESULT P3.steady {rna['gzip'] / (rna['w1'] - fixed[0]):.3f} P3 without data_prep's start-up "
          f"({fixed[0]:.2f} s of interpreter and imports, negligible on a multi-GB input; target >= 0.5)")
    print(f"RESULT P3w2.steady {rna['gzip'] / (rna['w2'] - fixed[0]):.3f} P3w2 without that start-up")
    for name, r in uniref.items():
        tag = "P3u" if name == UNIREF[0].name else "P3u100"
        print(f"RESULT {tag} {r['gzip'] / r['w1']:.3f} data_prep uniref {name} / gzip -dc, 1 process "
              "(target >= 0.5)")
        print(f"RESULT {tag}w2 {r['gzip'] / r['w2']:.3f} data_prep uniref {name} --workers 2 / gzip -dc "
              "(target near 2 x 1 process)")
    if clusters is not None:
        print(f"RESULT P3uc {clusters['gzip'] / clusters['w1']:.3f} data_prep uniref --clusters (UniRef90 members "
              f"x{clusters['copies']}) / gzip -dc, 1 process, start-up included, best of {repeats} (per rotation "
              f"{spread(rotation_ratios(clusters, 'w1'))}; target >= 0.5)")
        print(f"RESULT P3ucw2 {clusters['w1'] / clusters['w2']:.3f} data_prep uniref --clusters --workers 2 speed-up "
              f"over 1 process (a pool scans the member FASTA while the job reads the TSV), best of {repeats} each "
              "(target >= 1.3 on 2 free cores)")
    if big is not None:
        print(f"RESULT P3uc.rss10 {big['prep'].rss / peak1:.3f} peak RSS of data_prep uniref --clusters on {SCALE} x "
              f"the input / on 1 x ({big['prep'].rss:.0f} MB / {peak1:.0f} MB; target <= 1.2)")
        print(f"RESULT P3uc.x10 {big['gzip'].wall / big['prep'].wall:.3f} P3uc on {SCALE} x the input "
              f"({big['fasta_mb']:.0f} MB of FASTA), one run")
    print(f"RESULT P3j2 {min(one) / min(two):.3f} data_prep rnacentral one job / two concurrent jobs (--num-jobs 2, "
          f"byte ranges of {jobs['mb']:.0f} MB of plain FASTA), wall, best of {repeats}, merge apart (per rotation "
          f"{spread([a / b for a, b in zip(one, two)])}; target >= 1.7)")
    print(f"RESULT P3j2.merged {min(one) / (min(two) + min(merge)):.3f} P3j2 with the merge's time added to the two "
          "jobs'")
    if not same:
        raise SystemExit("bench/data.py: the merged output of the two jobs is not the one job's output")


if __name__ == "__main__":
    main()
