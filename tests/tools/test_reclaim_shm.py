"""tools/reclaim_shm.py removes leaked DeepSpeed segments and keeps the ones a live process maps."""
import mmap
import subprocess
import sys

from conftest import REPO

TOOL = [sys.executable, str(REPO / "tools" / "reclaim_shm.py")]


def test_reclaims_only_unmapped_deepspeed_segments(tmp_path):
    shm = tmp_path.resolve()
    leaked = shm / "deepspeed_allreduce_buffer_0_127.0.0.1_29500_0"
    live = shm / "deepspeed_allreduce_buffer_0_127.0.0.1_29501_0"
    other = shm / "torch_12345"
    for f in (leaked, live, other):
        f.write_bytes(b"\0" * 4096)

    with open(live, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):  # a training in progress maps its segment
        dry = subprocess.run(TOOL + ["--shm-dir", str(shm), "--dry-run"], capture_output=True, text=True, check=True)
        assert dry.stdout.splitlines()[0] == str(leaked) and "would reclaim 1 orphaned" in dry.stdout
        assert leaked.exists()
        # The tool runs in another process: it must see this process's mapping through /proc.
        run = subprocess.run(TOOL + ["--shm-dir", str(shm)], capture_output=True, text=True, check=True)
        assert "reclaimed 1 orphaned" in run.stdout, run.stdout
        assert not leaked.exists() and live.exists() and other.exists()

    run = subprocess.run(TOOL + ["--shm-dir", str(shm)], capture_output=True, text=True, check=True)
    assert "reclaimed 1 orphaned" in run.stdout and not live.exists() and other.exists()
