"""Remote shard sets (pipeline/data/remote.py) against a real S3 server and a plain HTTP server on loopback
(tests/conftest.py): the loader reads the samples of the local copy, each shard is fetched once per epoch and never
read before it is whole and checked, the cache stays under its limit and never evicts a shard in use, faults are
retried or refused in one line naming the URL."""
import json
import multiprocessing
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import REPO, SAMPLE_FASTA, TINY, http_server, pretrain_cmd, run_launch
from pipeline.data import remote, shard_reader
from pipeline.data.loader import ShardStream
from pipeline.data.remote import COUNTERS, CacheSettings, FetchError, RetryPolicy, ShardCache
from pipeline.data.shards import ShardError
from pipeline.data.streams import resolve_shards

FAST = RetryPolicy(retries=3, backoff_s=0.01)


@pytest.fixture(scope="module")
def shards20(tmp_path_factory):
    """The Rfam sample as 20 shards of about 105 samples (a local data_prep output)."""
    out = tmp_path_factory.mktemp("remote") / "rfam20"
    subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                    str(out), "--shard-size", "106", "--progress", "off"], cwd=REPO, check=True, capture_output=True)
    assert len(list(out.glob("*.tar"))) == 20
    return out


def put(server, bucket: str, directory, prefix: str) -> str:
    client = server.client()
    for p in sorted(directory.iterdir()):
        client.upload_file(str(p), bucket, f"{prefix}/{p.name}")
    return f"s3://{bucket}/{prefix}"


@pytest.fixture(autouse=True)
def fresh_caches():
    """Each test reads its store afresh (the manifest and listing are cached per process by URL)."""
    remote.open_set.cache_clear()
    resolve_shards.cache_clear()
    yield
    remote.open_set.cache_clear()
    resolve_shards.cache_clear()


def transform(tokens, rng):
    t = np.asarray(tokens, dtype=np.int64)
    return {"input_ids": t, "labels": t}


def sample_ids(spec, n_batches: int, cache=None, **kw) -> list:
    ds = ShardStream(str(spec), rank=0, world_size=1, num_workers=0, micro_batch_size=8, seed=7, transform=transform,
                     pad_id=0, cache=cache, **kw)
    it, out = iter(ds), []
    for _ in range(n_batches):
        out += next(it).sample_ids
    return out


def shard_bytes(directory) -> list:
    return sorted(p.stat().st_size for p in directory.glob("*.tar"))


class Peak:
    """Polls the cache's files every 2 ms from another thread: the largest total ever seen (objects and downloads
    in progress at their reserved size), independently of the cache's own usage.json."""

    def __init__(self, root):
        self.root, self.peak, self.stop = root / "objects", 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            total = 0
            for p in list(self.root.glob("*")) if self.root.is_dir() else []:
                try:
                    size = p.stat().st_size
                except FileNotFoundError:
                    continue
                total += max(size, int(p.name.split(".")[1])) if p.name.endswith(".part") else size
            self.peak = max(self.peak, total)
            time.sleep(0.002)

    def done(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


def test_s3_set_reads_the_local_samples_once_per_epoch_within_the_cache_limit(s3, shards20, tmp_path):
    """20 shards, a cache of 3 shards' size, prefetch 2, three 503s and a cut download: the sample order is the
    local copy's over two epochs and a half, the faults were retried (4, counted), every shard was fetched whole
    exactly once per epoch (counted at the server), and the cache never held more than its limit (its own record and
    a thread watching its files agree)."""
    server, bucket = s3
    url = put(server, bucket, shards20, "rfam20")
    limit = 3 * max(shard_bytes(shards20))
    cache = CacheSettings(str(tmp_path / "cache"), limit, prefetch=2, retry=FAST)
    names = sorted(p.name for p in shards20.glob("*.tar"))
    server.faults.fail(3, 503, match=names[5])  # S3's SlowDown, three times: retried
    server.faults.cut(1, match=names[7])  # half the body, then the connection drops: fetched again
    peak = Peak(tmp_path / "cache")
    before = COUNTERS.total()["retries"]
    epochs = 2107 * 5 // 2 // 8  # batches of 8 samples: two and a half epochs
    got = sample_ids(url, epochs, cache, mix_shards=1)
    seen = peak.done()
    assert COUNTERS.total()["retries"] - before == 4
    assert got == sample_ids(shards20, epochs, mix_shards=1)
    served = [server.faults.gets(f"/{bucket}/rfam20/{p.name}") for p in sorted(shards20.glob("*.tar"))]
    # epoch 3 is half read (and up to 2 shards prefetched beyond it): each shard 2 or 3 times, none more
    assert all(n in (2, 3) for n in served), served
    third = sum(n == 3 for n in served)
    assert 9 <= third <= 13, served
    assert seen <= limit and remote.json.loads((tmp_path / "cache" / "usage.json").read_text())["peak_bytes"] <= limit
    assert seen > 2 * min(shard_bytes(shards20))  # the watcher saw the cache in use, not an empty directory


def test_http_set_and_faults_503_and_a_cut_download(shards20, tmp_path, monkeypatch):
    """A plain HTTP server: 503 for 3 requests is retried (counted), a download cut half-way and one that ends
    early without an error are never read (the reader only ever opens whole, checked files) and are fetched again;
    the samples are the local copy's."""
    served = tmp_path / "www" / "rfam20"
    shutil.copytree(shards20, served)
    local = sample_ids(shards20, 2107 // 8, mix_shards=1)
    read = []
    real = shard_reader._ShardFile.__init__

    def opened(self, path):
        read.append(path)
        real(self, path)
    monkeypatch.setattr(shard_reader._ShardFile, "__init__", opened)
    with http_server(tmp_path / "www") as (base, faults):
        url = f"{base}/rfam20"
        names = sorted(p.name for p in shards20.glob("*.tar"))
        faults.fail(3, 503, match=names[4])
        faults.cut(1, match=names[6])
        faults.short(1, match=names[8])  # half the object, announced as all of it: fewer bytes than listed
        before = COUNTERS.total()
        cache = CacheSettings(str(tmp_path / "cache"), 10**9, prefetch=2, retry=FAST)
        got = sample_ids(url, 2107 // 8, cache, mix_shards=1)
        after = COUNTERS.total()
        assert got == local
        # fsspec's http info falls back from HEAD to GET on an error: the three 503s make one or more retries
        assert after["retries"] - before["retries"] >= 3 and not faults._fail[0][0]
        for name in names[6], names[8]:  # the torn downloads were fetched again, whole
            assert faults.counts[("GET", f"/rfam20/{name}")] == 2 and faults.gets(name) == 1
    # only whole, checked objects were ever read: in the cache, named by the manifest's digest
    digests = {s.sha256 for s in remote.manifest_of(shards20).shards}
    assert len(read) == 20 and all(p.parent == tmp_path / "cache" / "objects" for p in read)
    assert {p.name for p in read} == {f"{d}.tar" for d in digests}


def cache_of(tmp_path, limit, retry=FAST) -> ShardCache:
    return ShardCache(CacheSettings(str(tmp_path / "cache"), limit, prefetch=0, retry=retry))


def test_a_pinned_shard_is_never_evicted_and_a_demand_waits_for_room(s3, shards20, tmp_path):
    """Room for two shards: with A pinned (being read) a third shard evicts B, the least recently used one that
    nobody reads, never A; with A and B both pinned a demand for C waits until one is released, then takes its
    room; the limit holds throughout."""
    server, bucket = s3
    url = put(server, bucket, shards20, "pins")
    refs = [r.remote for r in resolve_shards(url)]
    a, b, c = sorted(refs[:3], key=lambda r: r.size)[::-1]
    cache = cache_of(tmp_path, a.size + b.size)
    pa = cache.acquire(a)
    pb = cache.acquire(b)
    cache.release(b)
    pc = cache.acquire(c)
    assert pa.is_file() and pc.is_file() and not pb.exists()  # B went, A (pinned) stayed
    cache.release(c)
    pb = cache.acquire(b)  # evicts C (unpinned), not A
    assert pa.is_file() and pb.is_file()
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("c", cache.acquire(c)))
    t.start()
    time.sleep(0.5)
    assert "c" not in got and pa.is_file() and pb.is_file()  # A and B pinned: C waits
    cache.release(b)
    t.join(10)
    assert got["c"].is_file() and pa.is_file() and not pb.exists()
    peak = remote.json.loads((tmp_path / "cache" / "usage.json").read_text())["peak_bytes"]
    assert peak <= a.size + b.size


def _fetch_all(settings, refs, out):
    cache = ShardCache.get(settings)
    for r in refs:
        cache.acquire(r)
        cache.release(r)
    out.put("ok")


def test_processes_sharing_a_cache_fetch_each_shard_once(s3, shards20, tmp_path):
    """Three processes of one node read the same 20 shards at once through one cache (a lock per shard): the server
    serves each shard once."""
    server, bucket = s3
    url = put(server, bucket, shards20, "shared")
    refs = [r.remote for r in resolve_shards(url)]
    server.faults.latency_s = 0.02  # downloads overlap
    settings = CacheSettings(str(tmp_path / "cache"), 10**9, prefetch=0, retry=FAST, processes=3)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_fetch_all, args=(settings, refs[i:] + refs[:i], out)) for i in (0, 7, 13)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [out.get(timeout=5) for _ in procs] == ["ok"] * 3
    assert [server.faults.gets(f"/{bucket}/shared/{p.name}") for p in sorted(shards20.glob("*.tar"))] == [1] * 20


def test_a_replaced_object_and_a_rewritten_set_are_refused_in_one_line(s3, shards20, tmp_path):
    """An object replaced under its manifest (another size, or the same size and other bytes) is never read:
    one line naming the URL; a whole set uploaded again with another manifest is the data-change refusal of
    rewritten local shards."""
    server, bucket = s3
    url = put(server, bucket, shards20, "changed")
    refs = [r.remote for r in resolve_shards(url)]
    names = sorted(p.name for p in shards20.glob("*.tar"))
    client = server.client()
    client.put_object(Bucket=bucket, Key=f"changed/{names[0]}", Body=(shards20 / names[0]).read_bytes() + bytes(10240))
    same = bytearray((shards20 / names[2]).read_bytes())
    same[-1] ^= 1  # same size, one byte off: the digest tells
    client.put_object(Bucket=bucket, Key=f"changed/{names[2]}", Body=bytes(same))
    cache = cache_of(tmp_path, 10**9)
    for r, why in ((refs[0], "its size is"), (refs[2], "ETag")):
        with pytest.raises(FetchError) as e:
            cache.acquire(r)
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"{url}/{r.url.rsplit('/', 1)[1]}: the object changed") \
            and why in line and "--allow-data-change" in line, line
    # same size, and a store that gives no ETag: the digest of the downloaded bytes refuses it
    no_etag = remote.Remote(refs[2].url, refs[2].sha256, refs[2].size, None, refs[2].set_url, refs[2].set_sha256)
    with pytest.raises(FetchError, match="its sha256 .* differs from the manifest's"):
        cache.acquire(no_etag)
    assert not list((tmp_path / "cache" / "objects").glob("*"))  # nothing kept, nothing half-written
    client.put_object(Bucket=bucket, Key="changed/manifest.json", Body=b'{"rebuilt": 1}')
    with pytest.raises(FetchError) as e:
        cache.acquire(refs[0])
    assert str(e.value).startswith(f"{url}: the shard set was rewritten while this run read it (its manifest.json "
                                   "changed since the run started;") and "--allow-data-change" in str(e.value)


def test_the_store_gone_is_one_line_naming_the_url(s3_server, tmp_path, shards20, monkeypatch):
    """A server that never answers: the retries (counted, with backoff) then one FetchError naming the URL."""
    import conftest

    server = conftest.S3Server()  # moto's buckets are per process: the session server's are this one's too
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    conftest.forget_s3_clients()
    server.bucket("gone")
    url = put(server, "gone", shards20, "set")
    refs = [r.remote for r in resolve_shards(url)]
    server.stop()
    cache = cache_of(tmp_path, 10**9, RetryPolicy(retries=2, backoff_s=0.05))
    before = COUNTERS.total()["retries"]
    t0 = time.perf_counter()
    with pytest.raises(FetchError) as e:
        cache.acquire(refs[0])
    assert COUNTERS.total()["retries"] - before == 2 and time.perf_counter() - t0 >= 0.15  # 0.05 + 0.1
    assert str(e.value).startswith(f"{refs[0].url}: cannot fetch it after 3 tries: ") and "\n" not in str(e.value)
    monkeypatch.undo()
    conftest.forget_s3_clients()  # the next test's clients find the session server again


@pytest.fixture(scope="module")
def small_set(s3_server, shards20, tmp_path_factory):
    """shards20 in a bucket of its own (for the launcher tests of this module)."""
    s3_server.bucket("launch")
    return put(s3_server, "launch", shards20, "rfam20")


def test_cache_smaller_than_a_shard_and_missing_credentials_fail_before_deepspeed(s3, small_set, shards20, tmp_path,
                                                                                   monkeypatch):
    """Both are one line and exit 2 from the plan, before DeepSpeed starts (no resolved: line, no run directory)."""
    largest = max(shard_bytes(shards20))
    base = TINY + [f"data.train_shards={small_set}", "tracking.enabled=false"]
    r = run_launch(pretrain_cmd("ds_configs/zero2.json", base + [f"run_dir={tmp_path / 'a'}",
                                                                  f"data.cache_bytes={largest - 1}"]), 120)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr[-2000:]
    assert f"data.cache_bytes: {largest - 1:,} bytes cannot hold the largest shard, {small_set}/" in errors[0]
    assert "resolved:" not in r.stdout and not (tmp_path / "a").exists()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    r = run_launch(pretrain_cmd("ds_configs/zero2.json", base + [f"run_dir={tmp_path / 'b'}"]), 120)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr[-2000:]
    assert errors[0].startswith(f"error: {small_set}/manifest.json: cannot read it: no credentials"), errors[0]
    assert "resolved:" not in r.stdout and not (tmp_path / "b").exists()


def test_a_remote_manifest_whose_counts_cannot_fit_its_shards_is_one_line(s3, shards20, tmp_path):
    """As for a local shard set (pipeline/data/shards.py check_counts_fit): a sample count larger than the shard's
    object (each sample takes at least one byte of its tar) is refused when the set is opened, naming the manifest's
    URL, before anything is allocated from it."""
    server, bucket = s3
    url = put(server, bucket, shards20, "counts")
    manifest = json.loads((shards20 / "manifest.json").read_text())
    manifest["shards"][3]["samples"] = 10**15
    server.client().put_object(Bucket=bucket, Key="counts/manifest.json", Body=json.dumps(manifest).encode())
    with pytest.raises(ShardError) as e:
        remote.open_set(url)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{url}/manifest.json: shards[3].samples 1000000000000000 is more "
                                                "than shard ") and "could hold" in line, line
