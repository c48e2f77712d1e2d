"""tests/prewarmed.py against the plain subprocess it stands in for: the same exit status, stdout and stderr for a
script that prints, runs an atexit handler and a thread, exits with a message or raises; the caller's environment,
a changed one included; and a timeout."""
import subprocess
import sys

import pytest

import prewarmed
from prewarmed import run_python

SCRIPT = """import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit"))
threading.Thread(target=lambda: (time.sleep(0.1), print("thread"))).start()
print(sys.argv[1:], os.path.basename(sys.argv[0]), os.getcwd() == sys.argv[2], os.environ.get("PREWARMED_PROBE"))
print("to stderr", file=sys.stderr)
mode = sys.argv[1]
if mode == "message":
    sys.exit("a message")
if mode == "code":
    sys.exit(3)
if mode == "raise":
    raise ValueError("boom")
"""


@pytest.mark.parametrize("mode", ["ok", "message", "code", "raise"])
def test_same_as_a_fresh_process(tmp_path, mode, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    for value in (("one", "two") if mode == "ok" else (None,)):  # a changed os.environ reaches the command
        if value is not None:
            monkeypatch.setenv("PREWARMED_PROBE", value)
        fresh = subprocess.run([sys.executable, script, mode, str(tmp_path)], cwd=tmp_path, capture_output=True,
                               text=True)
        forked = run_python([script, mode, str(tmp_path)], tmp_path)
        assert forked.returncode == fresh.returncode and forked.stdout == fresh.stdout, (forked, fresh)
        if value is not None:  # and the server's imports ran under it: a new server started
            assert prewarmed._SERVER.env.get("PREWARMED_PROBE") == value
        if mode == "raise":  # the traceback's last line; the forked one also shows runpy's frames
            assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: boom"
        else:
            assert forked.stderr == fresh.stderr


def test_a_timeout_raises_and_the_next_command_runs(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(30)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([script], tmp_path, timeout=1)
    assert run_python(["-m", "json.tool", "--help"], tmp_path).returncode == 0
