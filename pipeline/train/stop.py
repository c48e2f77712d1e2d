"""How a training ends early: stop requests (signals, the launcher's death, train.max_hours), divergence, and the
loss of a peer rank, each with the one line that tells the user what happened and what to do."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import torch
import torch.distributed as dist

from pipeline.train.step import all_reduce_host


class TrainingStopped(RuntimeError):
    """The run stopped itself with a non-zero exit (divergence); the message says why and what is kept."""


class LoaderFailed(RuntimeError):
    """A DataLoader worker died: the run finished the step (its loader restarted from the exact position), wrote a
    checkpoint and stopped with a non-zero exit; the message names the worker, the shard and the checkpoint."""


class PeerLost(RuntimeError):
    """A collective failed because another rank is gone (its node died, was killed, or the network failed)."""


# A stop request waits this long for the current step to end (then the step is checkpointed and the run exits 0);
# past it the step is abandoned between two microbatches, unsaved (a long accumulation must not outlast the 30 s
# between DeepSpeed's forwarded SIGTERM and its SIGKILL).
STOP_GRACE_S = 2.0


class StopMidStep(Exception):
    """Raised between microbatches when a stop request has waited STOP_GRACE_S: the step is abandoned unsaved."""


class StopRequest:
    """Why this rank wants the run to stop after its current step: SIGTERM or SIGUSR1 (what SLURM and Kubernetes
    send before a kill), SIGINT (Ctrl-C), the death of the launcher that started it, or ``train.max_hours``.

    The handlers only set ``reason``; the training loop all-reduces the flag once per step, so every rank finishes
    the same step, writes its part of one checkpoint and exits 0. SIGTERM to the ``deepspeed`` runner kills the
    runner alone and leaves its ``deepspeed.launcher.launch`` child and the ranks running (runner.py installs no
    handler for a local launch), and a SIGKILLed torchrun leaves its ranks running: the ranks watch the launcher
    processes and stop when one is gone. DeepSpeed's launch.py forwards SIGTERM to the ranks and kills them 30 s
    later, so a save that takes longer needs SIGUSR1 sent to the ranks themselves (docs/checkpoints.md,
    "Preemption").
    """

    # SIGINT: Ctrl-C reaches every rank of a local launch (one process group) and DeepSpeed's launch.py, which then
    # sends SIGTERM and kills 30 s later; the first one stops after the step, checkpointed, like SIGTERM. A second
    # Ctrl-C does not wait: KeyboardInterrupt, which the launcher reports in one line (the step is not saved).
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, max_hours: float | None):
        self.max_hours = max_hours
        self.deadline = time.monotonic() + max_hours * 3600 if max_hours else None
        self.reason: str | None = None
        self._previous = {}

    def install(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        watched = _launcher_processes()
        if watched:
            threading.Thread(target=self._watch, args=(watched,), daemon=True, name="launcher-watch").start()

    def _on_signal(self, signum, frame):
        if signum == signal.SIGINT and self.reason == "SIGINT (Ctrl-C)":
            raise KeyboardInterrupt
        self.reason = self.reason or ("SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name)

    def _watch(self, processes):
        while self.reason is None:
            for proc in processes:
                if not proc.is_running() or proc.status() == "zombie":
                    self.reason = self.reason or f"the launcher (pid {proc.pid}) exited"
                    return
            time.sleep(1.0)

    def requested(self) -> bool:
        if self.reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.reason = f"train.max_hours ({self.max_hours:g} h) reached"
        return self.reason is not None

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _launcher_processes() -> list:
    """The launcher processes above this rank, as psutil handles: DeepSpeed's launch.py and the runner or remote
    shell that started it, or torchrun's agent; [] when this rank was started by neither. torchrun starts each rank
    in a session of its own and does not make it die with the agent: a SIGKILLed torchrun would leave its ranks
    training on."""
    import psutil  # a DeepSpeed dependency

    try:
        parent = psutil.Process(os.getppid())
        cmdline = parent.cmdline()
        if any(a == "torch.distributed.run" or os.path.basename(a) == "torchrun" for a in cmdline[:3]):
            return [parent]
        if "deepspeed.launcher.launch" not in " ".join(cmdline):
            return []
        watched = [parent]
        grand = parent.parent()
        if grand is not None and grand.pid > 1 and "deepspeed" in " ".join(grand.cmdline()):
            watched.append(grand)
        return watched
    except psutil.Error:
        return []


def peer_lost(e: BaseException, collective: str, step: int, timeout_s: float, latest: str) -> PeerLost:
    """The error to raise for a collective that failed in ``collective`` (during 1-based ``step``) because a peer is
    gone (pipeline.distributed.lost_peer), naming the last complete checkpoint ``latest``."""
    # gloo's own text blames "a remote worker hanging or bugs in the application"; say what to do instead
    detail = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [""])[0]).split(". This is")[0]
    if "timed out" in detail.lower() or "timeout" in detail.lower():
        return PeerLost(f"no answer from another rank for {timeout_s:g} s (train.collective_timeout) in {collective} "
                        f"({detail}): a rank is frozen (stopped, swapping, a hung device) or its node is unreachable; "
                        f"the last complete checkpoint is {latest}: stop every rank and start again with the same "
                        "command to resume from it")
    return PeerLost(f"lost contact with another rank during step {step} ({detail}): a node died or was killed, or the "
                    f"network between the nodes failed; the last complete checkpoint is {latest}: start every node "
                    "again with the same command to resume from it")


class MidStep:
    """Between the microbatches of a step: a heartbeat on a long step (train.heartbeat_seconds), and a stop request
    that has waited STOP_GRACE_S for the step to end abandons the step (StopMidStep). While microbatches are computed
    (collectives run between them) the ranks decide together, one all-reduce (MAX) per microbatch, and only when a
    step has more than one; reading is local, each rank decides for itself."""

    def __init__(self, stop: StopRequest, heartbeat_seconds: float, rank: int, device):
        self.stop, self.heartbeat, self.rank, self.device = stop, heartbeat_seconds, rank, device
        self.seen = None  # when this rank first saw a stop request inside a step

    def start(self, step: int):
        """Step ``step`` (1-based) begins."""
        self.step, self.t0 = step, time.perf_counter()
        self.beat = self.t0

    def __call__(self, i: int, n: int, what: str):
        """After microbatch i of n was ``what`` ("read" or "computed")."""
        now = time.perf_counter()
        if now - self.beat >= self.heartbeat:
            self.beat = now
            if self.rank == 0:
                print(f"step {self.step}: microbatch {i} of {n} {what}, {now - self.t0:.0f} s into the step",
                      flush=True)
        if self.stop.requested() and self.seen is None:
            self.seen = now
        want = self.seen is not None and now - self.seen >= STOP_GRACE_S
        if what == "computed":
            if n == 1 or i == n:
                return  # the end of the step: the per-step check decides (and saves)
            want = bool(all_reduce_host([float(want)], torch.float32, self.device, dist.ReduceOp.MAX)[0])
        if want:
            raise StopMidStep(f"microbatch {i} of {n} {what}")
