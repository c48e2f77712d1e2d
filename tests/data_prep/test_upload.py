"""data_prep upload / --output s3://: the published set is the local output byte for byte, a reader started during
the upload never sees a manifest whose shards are missing, and the ownership rules of local outputs hold."""
import os
import subprocess
import sys
import threading

from conftest import REPO, SAMPLE_FASTA
from pipeline.data import remote
from pipeline.data.remote import FetchError


def prep(output, *extra):
    return subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                           str(output), "--shard-size", "150", "--progress", "off", *extra], cwd=REPO,
                          capture_output=True, text=True, env=dict(os.environ))


def test_output_url_equals_local_and_a_reader_never_sees_a_partial_set(s3, tmp_path):
    server, bucket = s3
    local = tmp_path / "local"
    assert prep(local).returncode == 0
    r = prep(f"s3://{bucket}/direct")
    assert r.returncode == 0 and f"-> s3://{bucket}/direct" in r.stdout, r.stderr
    client = server.client()
    for p in local.iterdir():  # the same bytes as the local output, shards and manifest (the markers name their runs)
        if p.name == ".written-by.json":
            continue
        assert client.get_object(Bucket=bucket, Key=f"direct/{p.name}")["Body"].read() == p.read_bytes(), p.name
    r = prep(f"s3://{bucket}/direct")
    assert r.returncode == 1 and r.stderr.strip() == (f"data_prep: error: s3://{bucket}/direct already holds a "
                                                      "data_prep output; pass --overwrite to replace it")
    client.put_object(Bucket=bucket, Key="foreign/notes.txt", Body=b"mine")
    r = subprocess.run([sys.executable, "-m", "data_prep", "upload", str(local), f"s3://{bucket}/foreign",
                        "--overwrite"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1 and "was not written by data_prep" in r.stderr and "Traceback" not in r.stderr

    # a reader polling while a slow upload runs: no manifest yet, or the whole set, never a manifest without shards
    server.faults.latency_s = 0.05
    url = f"s3://{bucket}/slow"
    up = subprocess.Popen([sys.executable, "-m", "data_prep", "upload", str(local), url], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    while up.poll() is None or not seen or seen[-1] != "whole":
        remote.open_set.cache_clear()
        try:
            s = remote.open_set(url)
        except FetchError as e:
            assert "no manifest.json at this URL" in str(e), e
            seen.append("none")
            continue
        assert len(s.manifest.shards) == len(list(local.glob("*.tar")))
        seen.append("whole")
    assert up.wait() == 0 and "none" in seen and seen[-1] == "whole", (seen, up.stderr.read())
    remote.open_set.cache_clear()
