"""Case 6: a frozen peer (SIGSTOP on rank 1) hung rank 0 silently for as long as one waited. Now every collective
waits at most train.collective_timeout seconds; then the live rank exits with one line naming the timeout, the
collective, the step and the last complete checkpoint, within the timeout + 30 s. (The frozen rank itself cannot act;
DeepSpeed's launcher then stops it.)"""
import signal
import subprocess
import threading
import time

import psutil
import pytest

from conftest import REPO, TINY, deepspeed_cmd, kill_group, launch_env, read_jsonl

pytestmark = pytest.mark.slow  # DeepSpeed training launches

TIMEOUT = 15


def test_a_frozen_peer_ends_the_run_within_the_collective_timeout(sample_shards, tmp_path):
    run_dir = tmp_path / "run"
    cmd = deepspeed_cmd(2, "ds_configs/zero2.json", TINY + [
        f"data.train_shards={sample_shards}", f"run_dir={run_dir}", "train.max_steps=100000",
        "checkpoint.every_steps=2", f"train.collective_timeout={TIMEOUT}"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    frozen = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            m = run_dir / "metrics.jsonl"
            if m.is_file() and any(r["step"] >= 3 for r in read_jsonl(m)):
                break
            time.sleep(0.1)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "pretrain.py" in " ".join(p.cmdline()) and p.environ().get("RANK") in ("0", "1")]
        frozen = next(p for p in ranks if p.environ()["RANK"] == "1")
        live = next(p for p in ranks if p.environ()["RANK"] == "0")
        frozen.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            live.wait(TIMEOUT + 30)
        except psutil.TimeoutExpired:
            pass
        took = time.monotonic() - t0
        time.sleep(1)  # the rank's last lines reach the pipe
    finally:
        if frozen is not None:
            try:
                frozen.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        kill_group(proc)
    out = "".join(lines)
    assert took < TIMEOUT + 30, (took, out[-3000:])
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    # Rank 1, let go (SIGCONT) above, may say the same of rank 0 before the kill reaches it: true, and not the
    # live rank's line.
    errors = [ln for ln in lines if f"no answer from another rank for {TIMEOUT} s (train.collective_timeout)" in ln
              and not ln.startswith("[rank 1] ")]
    assert len(errors) == 1 and errors[0].startswith("[rank 0] error: "), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert " in the " in errors[0] and " step " in errors[0] and f"the last complete checkpoint is {latest}" in errors[0], errors[0]
    print(f"rank 0 exited {took:.1f} s after rank 1 froze: {errors[0].strip()}")
