"""The process group of a training: starting it (DeepSpeed's, gloo on CPU), timeouts on every group, small object
collectives, telling a lost peer from a bug, and leaving together."""
from __future__ import annotations

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist

# torch 2.13 deprecates dist.all_gather_into_tensor and reduce_scatter_tensor for all_gather_single and
# reduce_scatter_single (the same collectives: the old names now just call the new ones). DeepSpeed 0.19's
# TorchBackend still calls the old names, for every ZeRO all-gather (the parameters after each optimizer step) and
# ZeRO-3's gradient reduce-scatter, so a FutureWarning reached the console and train.log, and again after anything
# reset the warnings registry (on rank 0 after each validation). The calls are DeepSpeed's, not this project's:
# silence exactly those two messages, raised from torch's own deprecation wrapper.
warnings.filterwarnings(
    "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    category=FutureWarning, module=r"torch\.distributed\.c10d_logger")


def name_cpu_accelerator():
    """``DS_ACCELERATOR=cpu`` on a host where torch sees no CUDA device, unless the caller chose one; call before
    DeepSpeed is first imported.

    DeepSpeed then falls back to its CPU accelerator anyway (the training uses CUDA iff torch sees it), but by
    detection, which logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
    it." in every process, into every rank's part of train.log. Naming what detection would find changes nothing
    else; on a CUDA host the variable is left unset (forcing it there would be wrong)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def _single_process_group(backend: str, timeout: dict):
    """Start a one-process group for ``python launchers/pretrain.py`` run without a launcher.

    The store listens on a port the kernel picks at ``listen`` time (port 0), never on one probed and released
    beforehand: between such a probe and the store's ``listen`` another process can take the port (EADDRINUSE at
    start, 4 launches of a CI run of the suite). DeepSpeed's ``init_distributed`` then adopts the started group."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, **timeout)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(store.port))
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **timeout)


def init_distributed(timeout_s: float | None = None):
    """``deepspeed.init_distributed`` (nccl on GPU hosts, gloo on CPU) without DeepSpeed's shared-memory all-reduce op;
    ``timeout_s``: how long a collective waits for the other ranks (train.collective_timeout; None: DeepSpeed's).

    On CPU hosts DeepSpeed's TorchBackend JIT-compiles that op (35-50 s on a fresh machine) and every rank creates a
    69 MB ``/dev/shm/deepspeed_allreduce_buffer_*`` segment that nothing ever unlinks. /dev/shm is RAM, so each run
    leaked 138 MB on two ranks until the host ran out of memory; and a rank whose segment cannot be created leaves its
    peers spinning on ``shm_open`` forever. The op serves only ``inference_all_reduce`` (AutoTP inference), which
    training never calls: its collectives go through torch.distributed. ``__compatible_ops__`` is DeepSpeed's one
    cached dict of buildable ops (``deepspeed/ops/__init__.py``), so marking the op unbuildable there is enough.
    """
    import deepspeed  # heavy: imported when a process group is really started

    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        # Reading __compatible_ops__ probes every op (compiler subprocesses); DeepSpeed does that here on CPU anyway.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if "RANK" not in os.environ and not dist.is_initialized():
        _single_process_group(backend, timeout)
    deepspeed.init_distributed(dist_backend=backend, **timeout)


def set_collective_timeout(seconds: float):
    """Give every process group, not only the world's, the timeout ``seconds``: torch's ``new_group`` (DeepSpeed's
    data-parallel and expert groups, where ZeRO reduces gradients) takes its own default (30 min on gloo) instead of
    the world group's, so a frozen peer met inside a gradient reduction would still be waited on for half an hour.
    ``_set_pg_timeout`` is torch's (private) setter for exactly this."""
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank; ``obj`` itself outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's ``obj``, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def lost_peer(e: BaseException) -> bool:
    """Whether a collective failed because a peer is gone or silent: an error of gloo's TCP transport (connection
    reset or closed by the peer, a receive that timed out, a pair closed by the timeout) or torch's distributed
    backend and network errors (NCCL)."""
    text = str(e)
    return isinstance(e, (dist.DistBackendError, dist.DistNetworkError)) or (
        isinstance(e, RuntimeError) and ("gloo/transport" in text or "timeout caused pair closure" in text))


def shutdown_distributed():
    """Leave together: without it a rank can exit while a peer's gloo threads still talk to it, and the peer dies in
    its process-group destructor ("terminate called without an active exception", seen once in a CI run)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int = 0):
    """End a process that ran DeepSpeed. A finished one leaves with os._exit after flushing its output: at the
    interpreter's finalization the destructors of torch's and gloo's C++ threads abort a finished rank now and then
    ("terminate called without an active exception", SIGABRT; a few in a thousand CI launches, after the work was
    done), which the launcher reports as a failure. A failed one leaves normally: its error line must be printed."""
    if code != 0:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
