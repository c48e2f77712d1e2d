"""``python SCRIPT ARGS`` for command-line tests without paying torch's and DeepSpeed's import each time.

A bad-input case runs the real CLI to its one error line in well under a second, after 3 s of importing torch and
DeepSpeed. ``run_python`` hands the command to a server process that imported them once (SERVER below) and forks a
child per command; the child takes the command's argv, working directory, stdin (/dev/null) and output files, runs the
script or module as ``__main__`` with runpy, then exits as the interpreter would: SystemExit's code (a message
printed to stderr and exit 1 for a non-integer), a traceback and exit 1 for an uncaught exception, the non-daemon
threads joined and the atexit handlers run first. Each child starts from the server's state, never from an earlier
command's, and imports the project itself (nothing of pipeline/, data_prep/, launchers/ or tools/ is imported by the
server), so a command sees the code and environment a fresh ``python`` would.

What a fresh process would do that a child does not: print the import-time lines of torch and DeepSpeed (DeepSpeed's
"Setting accelerator to CPU" warning goes to the server's stdout, /dev/null). The child runs under the caller's
os.environ. The server's imports read the environment it started with, so a command run after os.environ changed
(PYTEST_CURRENT_TEST aside: pytest sets it for every test) starts a new server first, and one with its own ``env``
runs as a plain subprocess. The child's exit is waited for with a pidfd (Linux 5.3), else by polling.
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SERVER = r"""
import atexit, ctypes, json, os, runpy, select, signal, sys, threading, time, traceback
reply = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # no print of the server (DeepSpeed logs to stdout) in the replies
import numpy, torch, torch.nn.attention.varlen, deepspeed, yaml, safetensors.torch, transformers  # noqa: E401,F401
# (what the CLIs import: torch.nn.attention.varlen brings torch._dynamo, a second of its own)


def child(req):
    reply.close()
    os.environ.clear()
    os.environ.update(req["env"])
    os.setpgid(0, 0)  # its own process group: a timeout kills whatever it started too
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with a server killed mid-command
    os.chdir(req["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                            (2, req["stderr"], os.O_WRONLY)):
        os.dup2(os.open(path, flags), fd)
    argv, code = req["argv"], 0
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], req["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:  # as the interpreter exits on it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def exited(pid, timeout):
    # whether child pid exits within timeout seconds (left unreaped for waitpid)
    try:
        fd = os.pidfd_open(pid)  # readable once the child has exited (Linux 5.3)
    except (AttributeError, OSError):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(0.005)
        return False
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


for line in sys.stdin:
    req = json.loads(line)
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(req)
    timed_out = not exited(pid, req["timeout"])
    if timed_out:
        os.killpg(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status), "timed_out": timed_out}) + "\n")
    reply.flush()
"""


class _Server:
    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict | None = None  # os.environ when the server started
        self.lock = threading.Lock()

    def start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None or _imported_with(os.environ) != _imported_with(self.env):
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
            self.env = dict(os.environ)
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True, bufsize=1)
            atexit.register(self.proc.kill)
        return self.proc

    def run(self, argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory(prefix="prewarmed-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            out.touch()
            err.touch()
            proc = self.start()
            try:
                proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "stdout": str(out), "stderr": str(err),
                                             "timeout": timeout, "env": dict(os.environ)}) + "\n")
                reply = proc.stdout.readline()
            except BaseException:  # interrupted (a pytest timeout, ctrl-c): its late reply must not answer the next
                proc.kill()
                proc.wait()
                self.proc = None
                raise
            if not reply:
                raise RuntimeError(f"tests/prewarmed.py: the server exited ({proc.wait()}) running {argv}")
            r = json.loads(reply)
            stdout, stderr = (p.read_bytes().decode("utf-8", "replace") for p in (out, err))
            if r["timed_out"]:
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
            return subprocess.CompletedProcess([sys.executable, *argv], r["rc"], stdout, stderr)


_SERVER = _Server()
PER_TEST = ("PYTEST_CURRENT_TEST",)  # set by pytest for each test; read by no import


def _imported_with(env) -> dict:
    return {k: v for k, v in env.items() if k not in PER_TEST}


def run_python(args: list, cwd: Path, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python ARGS...`` (a script path or ``-m module``) in ``cwd``, captured as text, as subprocess.run would
    return it; forked from the pre-imported server unless ``env`` is given (see the module docstring)."""
    argv = [str(a) for a in args]
    if env is not None:
        return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=env)
    return _SERVER.run(argv, Path(cwd), timeout)
