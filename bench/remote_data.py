#!/usr/bin/env python
"""REMOTE: the loader's wait on a remote shard set at steady state, as a share of the step.

A 20-shard set (the shipped Rfam sample, data_prep) served over HTTP on 127.0.0.1 with a fixed latency added to every
request (``--latency-ms``, default 50: a HEAD and a GET per shard), read through a shard cache of 3 shards' size
with ``data.prefetch_shards`` 2 (pipeline/data/remote.py), one loader stream, shards one after another
(mix_shards 1). Each step takes ``--step-ms`` of compute (a sleep standing for the model) over 2 microbatches of
8 samples; the loader's wait per step is the time ``acquire`` spent on shards not yet in the cache. Steady state:
the steps after the first 10 (the first shard is always a demand fetch). Prints, per repeat, the mean wait share
of the steps and the largest step's, and RESULT REMOTE.wait_share (median over repeats) with its spread.

    python bench/remote_data.py [--latency-ms 50] [--step-ms 40] [--steps 300] [--repeats 3] [--quick]

``--quick`` (bench/run_all.py's default) runs 40 steps once.
"""
from __future__ import annotations

import argparse
import http.server
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.data.loader import ShardStream  # noqa: E402
from pipeline.data.remote import COUNTERS, CacheSettings, RetryPolicy  # noqa: E402


def serve(directory: Path, latency_s: float):
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(directory), **kw)

        def log_message(self, *args):
            pass

        def do_HEAD(self):
            time.sleep(latency_s)
            super().do_HEAD()

        def do_GET(self):
            time.sleep(latency_s)
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def transform(tokens, rng):
    t = np.asarray(tokens, dtype=np.int64)
    return {"input_ids": t, "labels": t}


def run(url: str, sizes: list, steps: int, step_s: float, cache_dir: Path) -> list:
    cache = CacheSettings(str(cache_dir), 3 * max(sizes), prefetch=2, retry=RetryPolicy(3, 0.05))
    ds = ShardStream(url, rank=0, world_size=1, num_workers=0, micro_batch_size=8, seed=0, transform=transform,
                     pad_id=0, mix_shards=1, cache=cache)
    it, shares = iter(ds), []
    for _ in range(steps):
        t0 = time.perf_counter()
        before = COUNTERS.total()["wait_s"]
        for _ in range(2):
            next(it)
        time.sleep(step_s)  # the step's compute
        shares.append((COUNTERS.total()["wait_s"] - before) / (time.perf_counter() - t0))
    return shares


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--step-ms", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="40 steps, one repeat")
    a = p.parse_args()
    if a.quick:
        a.steps, a.repeats = 40, 1
    with tempfile.TemporaryDirectory() as tmp:
        www = Path(tmp) / "www"
        subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input",
                        str(REPO / "data/samples/rfam_nrc_train_sample.fasta.gz"), "--output", str(www / "rfam20"),
                        "--shard-size", "106", "--progress", "off"], cwd=REPO, check=True, capture_output=True)
        sizes = [f.stat().st_size for f in (www / "rfam20").glob("*.tar")]
        server = serve(www, a.latency_ms / 1000)
        url = f"http://127.0.0.1:{server.server_address[1]}/rfam20"
        means = []
        for r in range(a.repeats):
            shares = run(url, sizes, a.steps, a.step_ms / 1000, Path(tmp) / f"cache{r}")
            steady = shares[10:]
            means.append(statistics.mean(steady))
            print(f"repeat {r}: {len(sizes)} shards, cache 3 shards, latency {a.latency_ms:g} ms a request, step "
                  f"{a.step_ms:g} ms: wait share mean {100 * means[-1]:.2f}%, largest step {100 * max(steady):.1f}% "
                  f"(first 10 steps: {100 * statistics.mean(shares[:10]):.1f}%)", flush=True)
        server.shutdown()
    print(f"RESULT REMOTE.wait_share {statistics.median(means):.4f} (spread {min(means):.4f}-{max(means):.4f}, "
          f"target <= 0.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
