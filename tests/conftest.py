"""Shared fixtures: the repository root on sys.path, sample shards, a runner for real DeepSpeed launches, and a
local MLflow server."""
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED_DATA = REPO.parent / "shared" / "data"
SAMPLE_FASTA = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"
HELDOUT_FASTA = REPO / "data" / "samples" / "rfam_nrc_heldout_sample.fasta.gz"

# A tiny Eco-RNA so that multi-process trainings take seconds on two CPU cores.
TINY = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128", "data.context_length=64",
        "train.micro_batch_size=4", "train.log_every=1", "optim.warmup_steps=2"]


# What a launcher gives each rank to find its process group. A test that starts a group in this process
# (bench.step_proxies.count_step, via pipeline.distributed) sets them here and keeps the group's store listening on
# MASTER_PORT; a launch that inherited them would join that rendezvous instead of starting its own (EADDRINUSE on the
# store's port: 4 launches and the 7 tests of a fixture in one CI run, all after tests/bench/test_step_proxies.py).
RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SESSION_RENDEZVOUS = {k: os.environ.get(k) for k in RENDEZVOUS}


@pytest.fixture(autouse=True, scope="module")
def no_rendezvous_leak():
    """After each test module, this process's rendezvous variables are what they were when the session started."""
    yield
    for k, v in SESSION_RENDEZVOUS.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def default_sigint():
    """SIGINT as `python -m data_prep` run from a terminal has it (KeyboardInterrupt in the main thread), whatever this
    process inherited or was left: a test run started in the background by a shell without job control (`(bash -c
    'bash scripts/test.sh' &)`) starts with SIGINT ignored, and a signal then does nothing; an in-process Trainer set
    up and never fitted would leave its StopRequest's handlers."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sample_shards(tmp_path_factory) -> Path:
    """The shipped Rfam sample as 8 shards, built by the real data_prep CLI."""
    out = tmp_path_factory.mktemp("shards") / "rfam"
    subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA),
                    "--output", str(out), "--shard-size", "300"], cwd=REPO, check=True, capture_output=True)
    return out


def deepspeed_cmd(nproc: int, ds_config: str, overrides: list, extra: list = ()) -> list:
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
           str(free_port()), str(REPO / "launchers" / "pretrain.py"), "--ds_config", str(REPO / ds_config)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + list(extra)


def torchrun(nproc: int, script: Path, args: list) -> list:
    """torchrun rather than deepspeed (both work, docs/architecture.md, "DeepSpeed on CPU"): it starts in half the time,
    which matters for 4 processes on 2 cores. It sets OMP_NUM_THREADS=1 per process."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), str(script), *args]


def torchrun_pretrain(nproc: int, ds_config: str, overrides: list, extra: list = (),
                      script: Path = REPO / "launchers" / "pretrain.py") -> list:
    """``nproc`` ranks of launchers/pretrain.py (or ``script``, a launcher like it) under torchrun: for the multi-rank
    tests whose subject is not the deepspeed runner (deepspeed_cmd, which the golden, CLI, signal and launcher tests
    keep). torchrun starts in about half the runner's time."""
    return torchrun(nproc, script,
                    ["--ds_config", str(REPO / ds_config), *[a for o in overrides for a in ("--set", o)], *extra])


def run_torchrun(nproc: int, ds_config: str, overrides: list, extra: list = (), timeout: int = 600, **kw):
    return run_launch(torchrun_pretrain(nproc, ds_config, overrides, extra, **kw), timeout)


def launch_env() -> dict:
    env = dict(os.environ)
    for k in ("MLFLOW_TRACKING_URI", *RENDEZVOUS):  # a launch starts its own process group
        env.pop(k, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_launch(cmd: list, timeout: int = 600) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a training or evaluation launch, in a process group of its own: on a timeout (or a
    pytest-timeout) every rank is killed, not only the launcher, so a stalled training cannot keep two cores and
    its memory for the rest of the suite."""
    with subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen):
    """SIGKILL every process of a launch started with ``start_new_session=True`` (if any is left) and reap it.

    Its descendants too, found while the launcher lives: torchrun starts each rank in a session of its own, out of
    reach of the group's kill, and such orphans would train on (and checkpoint) after the "kill"."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in descendants:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()


@contextlib.contextmanager
def running_until(cmd: list, ready: str, timeout: float = 240):
    """A launch in a process group of its own whose output (stdout and stderr) is collected line by line; yields
    (process, lines so far, the reader thread: joined, the output has ended) once a line matches the regex ``ready``,
    and kills whatever is left of the group on the way out."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, seen = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if re.match(ready, line):
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(timeout), "".join(lines[-40:])
        yield proc, lines, reader
    finally:
        kill_group(proc)


def run_pretrain(nproc: int, ds_config: str, overrides: list, extra: list = (), timeout: int = 600):
    return run_launch(deepspeed_cmd(nproc, ds_config, overrides, extra), timeout)


def pretrain_cmd(ds_config: str, overrides: list, extra: list = ()) -> list:
    """A training of one process as ``python launchers/pretrain.py`` (docs/recursive_gpt.md), without a launcher: a
    world of one starts its own process group (pipeline/distributed.py). For the tests of what a training does on its
    own (resume, refusals, damaged checkpoints): the deepspeed runner and its launch.py are two more interpreters that
    each import torch and DeepSpeed, about 8 s of a 1-rank launch's 11-15 s on two cores. What the launcher adds (its
    exit, the ranks' watch of it, several ranks) is tested through deepspeed_cmd."""
    cmd = [sys.executable, str(REPO / "launchers" / "pretrain.py"), "--ds_config", str(REPO / ds_config)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + list(extra)


def run_single(ds_config: str, overrides: list, extra: list = (), timeout: int = 600) -> subprocess.CompletedProcess:
    return run_launch(pretrain_cmd(ds_config, overrides, extra), timeout)


# The short finished run several reliability tests start from (then damage, poison, resume or reconfigure).
SHORT_RUN = ["train.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=0"]


@pytest.fixture(scope="session")
def _short_run(sample_shards, tmp_path_factory) -> Path:
    """ROOT holding ROOT/run, a 4-step training on sample_shards (1 rank, ZeRO-2, TINY; checkpoints at steps 2 and 4,
    none rotated away), and ROOT/mlflow.db, its store. Trained once per session: each test that starts from such a
    run used to train its own, one launch each."""
    root = tmp_path_factory.mktemp("short_run")
    r = run_single("ds_configs/zero2.json", TINY + [f"data.train_shards={sample_shards}", f"run_dir={root / 'run'}",
                                                   *SHORT_RUN], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def copy_trained(root: Path, dest: Path):
    """Copy ROOT, run directories and their MLflow store ROOT/mlflow.db (trained once for several tests), into
    ``dest`` for a test to damage or resume. The store names its artifact folder by its absolute path: moved to the
    copy's, so that a resumed copy logs its artifacts there and never into ROOT, which the next test copies."""
    shutil.copytree(root, dest, dirs_exist_ok=True)
    with contextlib.closing(sqlite3.connect(dest / "mlflow.db")) as db, db:
        for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri")):
            db.execute(f"update {table} set {column} = replace({column}, ?, ?)", (root.as_uri(), dest.as_uri()))


@pytest.fixture
def short_run(_short_run, tmp_path):
    """This test's own copy of the short run, tmp_path/run with its store tmp_path/mlflow.db beside it (where a
    training started in tmp_path/run logs): free to damage, resume or train on, the next test gets a fresh one.
    After the test, the shared run must hold the same files as before (nothing logged into it through the copy)."""
    before = sorted(_short_run.rglob("*"))
    copy_trained(_short_run, tmp_path)
    yield tmp_path / "run"
    assert sorted(_short_run.rglob("*")) == before, f"a test wrote into the shared run {_short_run}"


def read_jsonl(path: Path) -> list:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln]


def losses(run_dir: Path) -> dict:
    """{step: loss} of a run's metrics.jsonl."""
    return {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}


def samples_per_step(run_dir: Path) -> dict:
    """{step: Counter of sample ids} over every rank's samples-rank*.jsonl (train.log_samples)."""
    out = {}
    for f in run_dir.glob("samples-rank*.jsonl"):
        for rec in read_jsonl(f):
            out.setdefault(rec["step"], Counter()).update(rec["ids"])
    return out


def launch_and_kill(cmd: list, metrics: Path, at_step: int, timeout: int = 300):
    """Start a training launch and SIGKILL every process of it once ``metrics`` (its metrics.jsonl) has logged
    ``at_step``: a preempted job, killed between checkpoints."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and any(m["step"] >= at_step for m in read_jsonl(metrics)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "training ended before it could be killed"
    finally:
        kill_group(proc)


def sqlite_uri(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def mlflow_store(run_dir: Path) -> str:
    """The store a training launched without one configured logs to: mlflow.db beside its run directory, shared
    with the run directories next to it (pipeline/tracking/store.py, default_store)."""
    from pipeline.tracking.store import default_store

    return sqlite_uri(default_store(run_dir))


def mlflow_runs(run_dir: Path) -> list:
    """The MLflow runs of one run directory in its default store: those tagged with its journal's run key (the store
    also holds the runs of the directories beside it)."""
    from mlflow.tracking import MlflowClient

    key = json.loads((Path(run_dir) / "tracking_state.json").read_text())["run_key"]
    client = MlflowClient(tracking_uri=mlflow_store(run_dir))
    return client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"tags.`pipeline.run_key` = '{key}'")


@pytest.fixture
def mlflow_server(tmp_path):
    if importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("fastapi") is None:
        pytest.skip("mlflow's server extras (uvicorn, fastapi) are not installed")
    port, db = free_port(), tmp_path / "server.db"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", sqlite_uri(db), "--default-artifact-root",
           (tmp_path / "server-artifacts").as_uri(), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, "mlflow server did not start"
            time.sleep(0.25)
        yield proc, port, db
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --------------------------------------------------------------------------------------------------------------------
# Object storage on loopback: a real S3 server (moto's ThreadedMotoServer, what s3fs's own tests use: moto's
# in-process mock does not reach s3fs/aiobotocore) and a plain HTTP server, each behind a fault injector. The remote
# shard sets (pipeline/data/remote.py) and checkpoint mirroring reuse them.
# --------------------------------------------------------------------------------------------------------------------
class Faults:
    """What the loopback servers do to requests (a WSGI middleware for S3, the handler for HTTP): ``latency_s`` per
    request; ``fail(n, status, match)``: the next n requests whose path contains ``match`` get ``status`` (S3's
    error XML); ``cut(n, match)``: the next n GETs of such an object send half the body and drop the connection;
    ``short(n, match)`` (HTTP): they send half of it as a whole answer.
    ``counts`` counts requests by (method, path), ``log`` lists them in order (S3); ``gets(match)`` the object GETs
    served whole."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.latency_s, self._fail, self._cut, self._short = 0.0, [], [], []
            self.counts, self.served = Counter(), Counter()
            self.log = []  # (method, path) of every request, in the order they arrived

    def fail(self, n: int, status: int = 503, match: str = ""):
        with self.lock:
            self._fail.append([n, status, match])

    def cut(self, n: int, match: str = ""):
        with self.lock:
            self._cut.append([n, match])

    def short(self, n: int, match: str = ""):
        """HTTP only: the next n GETs answer half the object as if it were all of it (a Content-Length of half)."""
        with self.lock:
            self._short.append([n, match])

    def _take(self, rules: list, path: str):
        with self.lock:
            for rule in rules:
                if rule[0] > 0 and rule[-1] in path:
                    rule[0] -= 1
                    return rule
        return None

    def gets(self, match: str = "") -> int:
        return sum(n for (method, path), n in self.served.items() if method == "GET" and match in path)


_S3_CODES = {503: "SlowDown", 500: "InternalError", 429: "SlowDown", 403: "AccessDenied"}


class FaultyApp:
    """WSGI middleware applying ``Faults`` in front of moto's app."""

    def __init__(self, app, faults: Faults):
        self.app, self.faults = app, faults

    def __call__(self, environ, start_response):
        f, method, path = self.faults, environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        with f.lock:
            f.counts[(method, path)] += 1
            f.log.append((method, path))
        if f.latency_s:
            time.sleep(f.latency_s)
        rule = f._take(f._fail, path)
        if rule is not None:
            code = _S3_CODES.get(rule[1], "ServiceUnavailable")
            body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected "
                    f"{rule[1]}</Message><RequestId>1</RequestId></Error>").encode()
            start_response(f"{rule[1]} Injected", [("Content-Type", "application/xml"),
                                                   ("Content-Length", str(len(body)))])
            return [body]
        cut = f._take(f._cut, path) if method == "GET" else None
        out = self.app(environ, start_response)
        if cut is None:
            if method == "GET":
                with f.lock:
                    f.served[(method, path)] += 1
            return out
        body = b"".join(out)

        def half():
            yield body[:len(body) // 2]
            sock = environ.get("werkzeug.socket")
            if sock is not None:  # a connection reset mid-body: the client sees a short, failed download
                sock.shutdown(socket.SHUT_RDWR)
        return half()


class S3Server:
    """moto's ThreadedMotoServer on 127.0.0.1 with a Faults middleware; ``env`` is what a client process needs
    (endpoint, dummy credentials, no instance-metadata lookups), ``client()`` a boto3 client for set-up."""

    def __init__(self):
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                                   create_backend_app)
        from werkzeug.serving import make_server

        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.faults = Faults()
        faults = self.faults

        class Server(ThreadedMotoServer):
            def _server_entry(self):  # ThreadedMotoServer's, with the middleware around moto's app
                app = FaultyApp(DomainDispatcherApplication(create_backend_app), faults)
                self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self.port = free_port()
        self.server = Server(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_EC2_METADATA_DISABLED": "true"}
        self.running = True

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self):
        """Gone for good: the port refuses connections (not a listening socket nobody accepts from)."""
        if self.running:
            self.running = False
            self.server.stop()
            self.server._server.server_close()


def forget_s3_clients():
    """fsspec keeps one S3FileSystem per set of arguments, with the endpoint it found in the environment then:
    after the environment changes (another server), the next one must read it again."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server on 127.0.0.1 for the session (skipped, saying why, without moto[server] and s3fs)."""
    for mod in ("moto", "werkzeug", "s3fs", "boto3"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed: the loopback S3 tests need the [dev] and [remote] extras "
                        "(scripts/setup.sh installs them)")
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """The session's S3 server for one test: its environment set (a launch inherits it), its faults reset, a fresh
    bucket named after the test; yields (server, bucket)."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    forget_s3_clients()
    s3_server.faults.reset()
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") + f"-{os.getpid() % 10000}"
    yield s3_server, s3_server.bucket(name)
    s3_server.faults.reset()


@contextlib.contextmanager
def http_server(directory: Path, faults: Faults | None = None):
    """A plain HTTP server on 127.0.0.1 serving ``directory`` (HEAD and GET), with ``faults``; yields its URL."""
    import http.server

    faults = faults or Faults()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(directory), **kw)

        def log_message(self, *args):
            pass

        def _faulted(self) -> bool:
            with faults.lock:
                faults.counts[(self.command, self.path)] += 1
            if faults.latency_s:
                time.sleep(faults.latency_s)
            rule = faults._take(faults._fail, self.path)
            if rule is not None:
                self.send_error(rule[1])
                return True
            return False

        def do_HEAD(self):
            if not self._faulted():
                super().do_HEAD()

        def do_GET(self):
            if self._faulted():
                return
            short = faults._take(faults._short, self.path) is not None
            if short or faults._take(faults._cut, self.path) is not None:
                data = (Path(directory) / self.path.lstrip("/")).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data) // 2 if short else len(data)))
                self.end_headers()
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                if not short:
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            with faults.lock:
                faults.served[("GET", self.path)] += 1
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", faults
    finally:
        server.shutdown()
        server.server_close()
