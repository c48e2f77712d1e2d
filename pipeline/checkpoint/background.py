"""Checkpoints written in the background (``checkpoint.background``, docs/checkpoints.md "Saves that do not stall
the step"): the step waits only while its state is copied to host memory; the files, their digests, the COMPLETE
marker, ``latest``, ``best`` and rotation follow in a writer thread, at most one save in flight.

Why not DeepSpeed's decoupled writer (``checkpoint.writer.decoupled``, deepspeed 0.19.8
runtime/checkpoint_engine/decoupled_checkpoint_engine.py): it hands the live state dicts to a spawned process through
a torch.multiprocessing queue, which moves their CPU storages into shared memory instead of copying them, so the
training must not change them until the write ends: its engine commits (waits for the writer) at the next optimizer
step, which only moves the stall one step later; it sets the global multiprocessing start method to spawn (every
DataLoader worker would then be spawned); its writer is FastCheckpointEngine, which needs the async_io op built; and
it commits with a collective inside ``engine.step`` and writes ``latest`` itself, where this project's protocol
needs SHA256SUMS, COMPLETE, ``latest``, ``best`` and rotation in that order, once every rank's files are whole.

What is used instead: DeepSpeed's own ``save_checkpoint`` with its checkpoint engine swapped, for the call, for
``Capture``, whose ``save`` copies each state dict to host memory (``snapshot``: every tensor's storage copied once
into a buffer reused from save to save, views rebuilt on it, so what torch.save then writes is byte for byte what it
writes from the live state, and training may change the live tensors at once) and keeps it. ``BackgroundWriter``
then writes the captured files in a thread, digesting each as it is written; the ranks' writer threads agree on the
outcome over a gloo group of their own (never the training's, whose collectives the main thread is making), and
rank 0's writer finishes the checkpoint in the synchronous order: client_state.json, config.yaml, SHA256SUMS,
COMPLETE, ``latest``, ``best``, rotation. Until COMPLETE exists resume, rotation, the tools and their readers' lock
see an incomplete checkpoint (pipeline/checkpoint/layout.py), so a kill at any moment leaves the previous
checkpoint as ``latest`` or the new one whole. ``after_complete`` callables run last, with the finished tag dir: the
place for a step that copies a complete checkpoint elsewhere (object storage).

Fault points (the kill test, tests/reliability/test_background_save.py): PIPELINE_CHECKPOINT_FAULT=S:P makes the
process SIGKILL itself at the P-th point (1-based) of its S-th background save; the points are each write into a
file, each file's end, the ranks' agreement, and each step of the finish (``BackgroundWriter.points`` lists a save's
points by name).
"""
from __future__ import annotations

import copy
import hashlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

FAULT_ENV = "PIPELINE_CHECKPOINT_FAULT"


class HostPool:
    """Host buffers for the snapshots, reused from save to save in the order a save takes them (its state has the
    same storages each time): a fresh allocation per save would pay the page faults of the whole state again. At
    most one save is in flight, and the previous one is written before the next snapshot, so a buffer is never
    overwritten while its file is being written. Pinned on CUDA hosts (the device-to-host copies are asynchronous)."""

    def __init__(self):
        self.buffers: list[torch.UntypedStorage] = []
        self.taken = 0

    def take(self, nbytes: int, pin: bool) -> torch.UntypedStorage:
        i, self.taken = self.taken, self.taken + 1
        if i < len(self.buffers) and self.buffers[i].nbytes() == nbytes and self.buffers[i].is_pinned() == pin:
            return self.buffers[i]
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
        if i < len(self.buffers):
            self.buffers[i] = buf
        else:
            self.buffers.append(buf)
        return buf

    def restart(self) -> None:
        self.taken = 0


def snapshot(obj, pool: HostPool, memo: dict):
    """``obj`` (a state dict as DeepSpeed hands it to torch.save) with every tensor's storage copied into host
    memory once and each tensor rebuilt on the copy with its own offset, shape and stride; containers rebuilt, any
    other object deep-copied, so nothing of the result refers to the live training state. ``memo`` (one per save):
    an object met twice is copied once (pickle writes the second as a reference), and so is a storage that several
    tensors share (ZeRO's flat buffers and the parameters that are views of them): torch.save then writes the copy
    byte for byte as it writes the live state."""
    if id(obj) in memo:
        return memo[id(obj)][1]
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = ("storage", st._cdata)
        if key not in memo:
            host = pool.take(st.nbytes(), pin=st.device.type == "cuda")
            host.copy_(st, non_blocking=st.device.type == "cuda")
            memo[key] = (st, host)  # st kept alive: its id and _cdata stay its own for this save
        out = torch.empty(0, dtype=obj.dtype)
        out.set_(memo[key][1], obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
        elif obj.requires_grad:  # pickled with the tensor (ZeRO's fp32 partitions require grad)
            out.requires_grad_(True)
        if getattr(obj, "__dict__", None):  # attributes set on a tensor are pickled with it
            out.__dict__.update(snapshot(obj.__dict__, pool, memo))
    elif isinstance(obj, dict):
        items = [(k, snapshot(v, pool, memo)) for k, v in obj.items()]
        if type(obj) is dict or hasattr(obj, "move_to_end"):  # dict, OrderedDict
            out = type(obj)(items)
        else:  # another mapping (a defaultdict): its own kind
            out = copy.copy(obj)
            out.clear()
            out.update(items)
        if getattr(obj, "__dict__", None):  # a state dict's _metadata (module versions), which pickle writes too
            out.__dict__.update(snapshot(obj.__dict__, pool, memo))
    elif isinstance(obj, list):
        out = [snapshot(v, pool, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [snapshot(v, pool, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        out = copy.deepcopy(obj)
    memo[id(obj)] = (obj, out)  # obj kept alive, so that no later object of this save takes its id
    return out


def first_nonfinite(obj, where: str = "") -> str | None:
    """Where the first floating tensor of a host snapshot holding a NaN or an inf is (a key path such as
    ``module['embed.weight']``), or None. Run by the writer thread before anything is written: a checkpoint is a good
    state of the run, never one whose weights (or optimizer state) went bad. A sum holding a NaN or an inf is not
    finite and costs one read; only a sum that is not finite is checked element by element (finite values can
    overflow a sum). numpy's sums run in this thread alone (torch's would start a team of intra-op threads beside
    the training's)."""
    import numpy as np

    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point() or obj.numel() == 0:
            return None
        if obj.dtype in (torch.float16, torch.float32, torch.float64):
            a = obj.detach().numpy()
            ok = bool(np.isfinite(a.sum(dtype=np.float64))) or bool(np.isfinite(a).all())
        else:  # bfloat16 and others numpy lacks
            ok = bool(torch.isfinite(obj.detach().float().sum())) or bool(torch.isfinite(obj).all())
        return None if ok else where or "a tensor"
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        bad = first_nonfinite(v, f"{where}[{k!r}]" if where else str(k))
        if bad:
            return bad
    return None


class Capture:
    """A DeepSpeed checkpoint engine (runtime/checkpoint_engine/checkpoint_engine.py's interface) that keeps a host
    snapshot of each state dict ``save`` is given, with its path, instead of writing it; directories are made at
    once. Swapped in for one ``engine.save_checkpoint`` call (Checkpointer.save)."""

    def __init__(self, pool: HostPool):
        self.pool, self.files, self._memo = pool, [], {}
        pool.restart()

    def create(self, info):
        pass

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str):
        self.files.append((str(path), snapshot(state_dict, self.pool, self._memo)))

    def load(self, path: str, map_location=None):
        raise RuntimeError("the capturing checkpoint engine only saves")  # loads use the engine's own

    def commit(self, info):
        return True

    def is_data_parallel_writer(self, dp_rank):
        return dp_rank == 0

    def is_decoupled(self):
        return False

    def set_commit_info(self, info):
        pass

    def get_commit_info(self):
        return None

    def cleanup(self):
        pass

    def preserves_storage_sharing(self):
        return True

    def settle(self) -> None:
        """The device-to-host copies are asynchronous on CUDA: done before the step may change the tensors."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()


class _Digesting:
    """A file object for torch.save that digests what it writes (no second read of the file for SHA256SUMS) and
    passes a fault point at every write."""

    def __init__(self, f, fault: Callable[[str], None], name: str):
        self.f, self.fault, self.name, self.sha = f, fault, name, hashlib.sha256()
        self.n = 0

    def write(self, data) -> int:
        self.n += 1
        self.fault(f"write {self.n} of {self.name}")
        self.sha.update(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


@dataclass
class SaveJob:
    """One background save: the files captured on this rank and, on rank 0, what finishes the checkpoint."""
    tag_dir: Path
    files: list  # [(path, host state)]
    zipfile: bool  # torch.save's _use_new_zipfile_serialization, as the engine's own checkpoint engine writes
    stall: float = 0.0  # seconds the step waited for this save (snapshot, and the previous save if it was late)
    finish: Callable[[dict, Callable[[str], None]], None] | None = None  # rank 0: (digests, fault) -> complete it
    started: float = field(default_factory=time.perf_counter)


class BackgroundWriter:
    """The writer thread of one rank: ``start`` a SaveJob, ``join`` it; ``outcome`` is None (no save yet), ("ok",
    tag) or ("failed", one line). ``group``: the gloo process group the ranks' writer threads agree over (None for
    one rank). ``describe(exception, tag_dir)``: the one line of a failed write (disk full says so)."""

    def __init__(self, rank: int, group, describe: Callable[[BaseException, Path], str]):
        self.rank, self.group, self.describe = rank, group, describe
        self.thread: threading.Thread | None = None
        self.outcome: tuple | None = None
        self.saves = 0  # background saves started by this process (the fault points' S)
        self.points: list[str] = []  # the fault points the last save passed, in order
        self.seconds = 0.0  # how long the last save took in the background
        self.after_complete: list[Callable[[Path], None]] = []  # run on rank 0 once a checkpoint is complete

    def start(self, job: SaveJob) -> None:
        if self.thread is not None:  # Checkpointer.save joins the previous save first; never two in flight
            raise RuntimeError("a background checkpoint save is already in flight")
        self.saves += 1
        self.outcome, self.points = None, []
        self.thread = threading.Thread(target=self._run, args=(job, self._fault_at()), name="checkpoint-writer",
                                       daemon=True)  # the trainer joins it; a kill or a second Ctrl-C may cut it
        self.thread.start()

    def join(self) -> tuple | None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return self.outcome

    @property
    def in_flight(self) -> bool:
        return self.thread is not None

    def _fault_at(self) -> int | None:
        spec = os.environ.get(FAULT_ENV, "")
        save, _, point = spec.partition(":")
        if save.isdigit() and point.isdigit() and int(save) == self.saves:
            return int(point)
        return None

    def _run(self, job: SaveJob, kill_at: int | None) -> None:
        def fault(name: str) -> None:
            self.points.append(name)
            if kill_at is not None and len(self.points) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        error, digests = None, {}
        try:
            for path, state in job.files:  # checked before any is written: a bad state leaves nothing behind
                bad = first_nonfinite(state)
                if bad:
                    error = (f"{job.tag_dir.name}: {Path(path).name} {bad} holds non-finite values though the step's "
                             f"loss and gradient norm were finite; {job.tag_dir.name} is not written")
                    break
            for path, state in job.files if error is None else ():
                name = Path(path).relative_to(job.tag_dir).as_posix() if Path(path).is_relative_to(job.tag_dir) \
                    else Path(path).name
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:
                    out = _Digesting(f, fault, name)
                    torch.save(state, out, _use_new_zipfile_serialization=job.zipfile)
                    f.flush()
                    os.fsync(f.fileno())  # durable before COMPLETE vouches for it
                fault(f"written {name}")
                if Path(path).is_relative_to(job.tag_dir):
                    digests[name] = out.sha.hexdigest()
            job.files.clear()  # the host copies stay in the pool; nothing else refers to them
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = self.describe(e, job.tag_dir)
        try:
            error, digests = self._agree(error, digests)
            fault("the ranks agree")
            if error is None and self.rank == 0:
                try:
                    job.finish(digests, fault)
                    for hook in self.after_complete:
                        hook(job.tag_dir)
                except OSError as e:
                    error = self.describe(e, job.tag_dir)
            error = self._broadcast(error)
        except Exception as e:  # noqa: BLE001 - a lost peer: the save is not complete, and says why
            error = error or f"could not complete checkpoint {job.tag_dir} ({type(e).__name__}: {e})".splitlines()[0]
        self.seconds = time.perf_counter() - job.started
        self.outcome = ("failed", error) if error else ("ok", job.tag_dir.name)

    def _agree(self, error: str | None, digests: dict) -> tuple[str | None, dict]:
        """Every rank's outcome and digests, on every rank (the first error wins)."""
        if self.group is None:
            return error, digests
        import torch.distributed as dist

        gathered = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (error, digests), group=self.group)
        errors = [e for e, _ in gathered if e]
        merged = {}
        for _, d in gathered:
            merged.update(d)
        return (errors[0] if errors else None), merged

    def _broadcast(self, error: str | None) -> str | None:
        """Rank 0's outcome of the finish, on every rank."""
        if self.group is None:
            return error
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]
