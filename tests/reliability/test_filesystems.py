"""Campaign cases on real filesystems: a run_dir on a read-only filesystem (a traceback), ``convert --output`` on one
(failed after all the work), a genuinely full disk under a training (a 30-line traceback from the error log) and
under convert (``SafetensorError``). Each now ends in one line naming the place and the reason, with nothing
half-written. The filesystems are tmpfs mounts in a private mount namespace (``unshare -rm``: no root needed, gone
with the process); where the kernel refuses user namespaces the tests skip, saying so."""
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY, launch_env

PRETRAIN = [sys.executable, str(REPO / "launchers/pretrain.py"), "--ds_config", str(REPO / "ds_configs/zero2.json")]
CONVERT = [sys.executable, str(REPO / "tools/convert_checkpoint.py")]


def _namespaces() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -rm refused: {probe.stderr.strip()}"


pytestmark = [pytest.mark.slow,  # DeepSpeed training launches
              pytest.mark.skipif(_namespaces() is not None,
                                 reason=f"needs a private mount namespace ({_namespaces()})")]


def on_tmpfs(mount, cmd, *, size: str, read_only: bool = False):
    """``cmd`` with a fresh tmpfs of ``size`` at ``mount`` (read-only if asked); its stdout ends with what the mount
    holds afterwards (``ls -A``), since the mount is gone once the command returns."""
    opts = f"size={size}" + (",ro" if read_only else "")
    script = (f"mount -t tmpfs -o {opts} tmpfs {shlex.quote(str(mount))} || exit 99; {shlex.join(map(str, cmd))}; "
              f"rc=$?; echo '--- left:'; ls -A {shlex.quote(str(mount))}; exit $rc")
    mount.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=launch_env(),
                          cwd=REPO, timeout=300)
    assert proc.returncode != 99, proc.stderr
    out, _, left = proc.stdout.rpartition("--- left:\n")
    return proc, out, left.split()


def one_error(proc) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    return line[line.index("error:"):]


@pytest.fixture
def checkpoint(short_run):
    return short_run / "checkpoints" / "step00000004"  # the test's copy of the session's short run (conftest)


def train_cmd(shards, run_dir):
    sets = TINY + [f"data.train_shards={shards}", f"run_dir={run_dir}", "train.max_steps=2", "tracking.enabled=false"]
    return PRETRAIN + [a for s in sets for a in ("--set", s)]


def test_a_read_only_run_dir_is_one_line(sample_shards, tmp_path):
    mount = tmp_path / "ro"
    proc, _, _ = on_tmpfs(mount, train_cmd(sample_shards, mount / "run"), size="1m", read_only=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_error(proc) == (f"error: run_dir {mount / 'run'}: cannot write there (Read-only file system); choose "
                               "a run_dir on a writable filesystem")


def test_a_full_disk_under_a_training_is_one_line(sample_shards, tmp_path):
    """The run's logs fit, its first checkpoint does not: the checkpoint error, and no traceback from the error log
    that cannot be written either."""
    mount = tmp_path / "full"
    proc, _, left = on_tmpfs(mount, train_cmd(sample_shards, mount / "run"), size="256k")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error(proc)
    assert line.startswith(f"error: disk full writing checkpoint {mount / 'run' / 'checkpoints' / 'step00000002'} ") \
        and line.endswith("; latest still names no checkpoint"), line
    assert left == ["run"]


def test_convert_onto_a_read_only_filesystem_fails_before_the_work(checkpoint, tmp_path):
    mount = tmp_path / "ro"
    proc, _, _ = on_tmpfs(mount, CONVERT + ["--checkpoint", checkpoint, "--output", mount / "export"], size="1m",
                          read_only=True)
    assert proc.returncode == 2
    assert one_error(proc) == f"error: {mount / 'export'}: cannot write in {mount} (Read-only file system)"
    assert "loading the checkpoint" not in proc.stderr  # refused before the checkpoint was read


def test_convert_onto_a_full_disk_leaves_nothing(checkpoint, tmp_path):
    mount = tmp_path / "full"
    proc, _, left = on_tmpfs(mount, CONVERT + ["--checkpoint", checkpoint, "--output", mount / "export"], size="64k")
    assert proc.returncode == 2
    line = one_error(proc)
    assert line.startswith(f"error: {mount / 'export'}: ") and "No space left on device" in line, line
    assert left == []  # no partial export, no staging directory


def test_a_read_only_mlflow_store_is_one_warning(sample_shards, tmp_path):
    """Campaign case: a read-only MLflow store gave SQL tracebacks. An existing store on a filesystem remounted
    read-only: the training runs to the end with one line saying the store is not writable and how to replay."""
    mount, run = tmp_path / "store", tmp_path / "run"
    db = mount / "mlflow.db"
    make = (f"{shlex.quote(sys.executable)} -c 'from mlflow.tracking import MlflowClient; "
            f"MlflowClient(tracking_uri=\"sqlite:///{db}\").create_experiment(\"x\")' >/dev/null 2>&1 && "
            f"touch {shlex.quote(str(db))}.lock && mount -o remount,ro {shlex.quote(str(mount))} && ")
    cmd = ["env", f"MLFLOW_TRACKING_URI=sqlite:///{db}", *train_cmd(sample_shards, run)]
    cmd[cmd.index("tracking.enabled=false")] = "tracking.enabled=true"
    script = (f"mount -t tmpfs -o size=20m tmpfs {shlex.quote(str(mount))} || exit 99; {make}"
              f"{shlex.join(map(str, cmd))}")
    mount.mkdir()
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=launch_env(),
                          cwd=REPO, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if f"sqlite:///{db} not writable" in ln]
    assert len(lines) == 1 and "Read-only file system" in lines[0], out[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == "step00000002"
