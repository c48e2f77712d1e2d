"""Training engine: DeepSpeed ZeRO, exact token-normalized steps, checkpoint/resume, MLflow.

One optimizer step:
  1. draw all ``grad_accum_steps`` microbatches of the step (the loader position advances by that many);
  2. all-reduce the supervised-token count n_global over ranks and microbatches (skip the update if it is 0);
  3. per microbatch: ``engine.backward(sum_token_loss * world / n_global, scale_wrt_gas=False)`` and ``engine.step()``.
     ``scale_wrt_gas=False`` turns off DeepSpeed's division by gradient_accumulation_steps (runtime/engine.py
     ``backward``); the factor ``world`` cancels its average over data-parallel ranks (zero/stage_1_and_2.py,
     comm/coalesced_collectives.py for stage 3). The update is then the gradient of the global token mean.
     Under expert parallelism the same factor is exact for the experts too: DeepSpeed sums their gradients over the
     expert-data-parallel group and divides by the whole data-parallel size (pipeline/parallel/expert_parallel.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.checkpoint import (check_same_model, is_export, is_foreign_checkpoint, load_esm2, load_state_dict,
                                 load_weights_into, read_client_state, resolve_tag_dir, zero12_optimizer_state)
from pipeline.config import ConfigError, RunConfig, dump_yaml, load_yaml
from pipeline.ds_config import load_ds_config, resolve_ds_config
from pipeline.data.compat import check_shards_fit
from pipeline.data.loader import (ShardStream, Source, StreamLayout, is_url_pattern, make_loader, reshard_states,
                                  resolve_shards, saved_layout)
from pipeline.families import get_family
from pipeline.parallel import EP_KEY, check_parallelism, optimizer_groups, parallelize
from pipeline.profiling import StepProfiler
from pipeline.run_dir import (BEST, CHECKPOINT_FORMAT, COMPLETE, LATEST, RunDirLock, checkpoint_tags, damaged_files,
                              is_complete, mark_complete, resume_tag, rotate, set_aside_later_checkpoints,
                              write_atomic)
from pipeline.run_dir import read_latest as read_latest_tag
from pipeline.run_log import current as current_run_log
from pipeline.tracking import Tracker, broadcast_object, resolve_run_id
from pipeline import validation

CUMULATIVE = ("samples", "tokens", "supervised_tokens", "words", "flops", "row_iterations",  # logged as total/<name>
              "skipped", "nonfinite")
# What a resumed run must share with its checkpoint to see the data the uninterrupted run would have seen
# (--allow-config-change overrides): the seed, the batch arithmetic and the data spec.
RESUME_INVARIANTS = ("seed", "train.micro_batch_size", "train.grad_accum_steps", "train.global_batch_size",
                     "train.max_tokens_per_microbatch", "data")


class TrainingStopped(RuntimeError):
    """The run stopped itself with a non-zero exit (divergence); the message says why and what is kept."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, ...); ``latest`` still names the previous one."""


class PeerLost(RuntimeError):
    """A collective failed because another rank is gone (its node died, was killed, or the network failed)."""


SHARED_CHECK = ".shared-check-"  # RUN_DIR/.shared-check-<random>: rank 0's probe that every rank sees run_dir


# --------------------------------------------------------------------------------------------------------------------
# Set-up that can fail fast, before any process group or compute
# --------------------------------------------------------------------------------------------------------------------
def schedule_horizon(cfg: RunConfig, dataset_samples: int) -> dict:
    """What the cosine decays over, fixed at a run's first start and kept in its checkpoints.

    ``optim.schedule_steps`` if set; else the word budget (``train.max_words``) or the epoch budget
    (``train.max_epochs``, in samples) when one is set, so a budgeted run decays over its budget instead of sitting
    at peak lr until ``max_steps``; else ``train.max_steps``. Extending a resumed run (``--set train.max_steps=...``)
    does not re-stretch it: past the horizon the lr stays at the floor.
    """
    o, t = cfg.optim, cfg.train
    if o.schedule_steps:
        return {"unit": "steps", "total": o.schedule_steps}
    if t.max_words is not None:
        return {"unit": "words", "total": t.max_words}
    if t.max_epochs is not None:
        return {"unit": "samples", "total": t.max_epochs * dataset_samples}
    return {"unit": "steps", "total": t.max_steps}


def lr_factor(optim, horizon: dict, step: int, cumulative: dict) -> float:
    """lr / optim.lr at 0-based ``step``: linear warmup over optim.warmup_steps, then cosine to optim.min_lr_ratio
    over the horizon's progress (steps, or the words or samples consumed before this step)."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if horizon["unit"] == "steps":
        progress = (step - optim.warmup_steps) / max(1, horizon["total"] - optim.warmup_steps)
    else:
        progress = cumulative.get(horizon["unit"], 0.0) / max(1.0, horizon["total"])
    progress = min(1.0, max(0.0, progress))
    floor = optim.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_lambda(cfg: RunConfig):
    """The step-horizon schedule as a function of the 0-based step (optim.schedule_steps or train.max_steps)."""
    horizon = {"unit": "steps", "total": cfg.optim.schedule_steps or cfg.train.max_steps}
    return lambda step: lr_factor(cfg.optim, horizon, step, {})


def param_groups(model: torch.nn.Module, optim) -> list[dict]:
    """AdamW groups, each with a ``name`` (DeepSpeed's MoE group split needs one).

    Matrices are decayed; gains, biases, vectors and what the model names in ``no_weight_decay()`` (Eco-RNA's
    identity-initialized B and W_o, ProtLingo's memory tables) are not. A group the model names in ``lr_groups()``
    gets ``optim.lr * optim.lr_scale[group]``; an lr_scale for a group the model does not have is a ConfigError.
    """
    exempt = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    named_groups = model.lr_groups() if hasattr(model, "lr_groups") else {}
    scales = dict(optim.lr_scale or {})
    unknown = sorted(set(scales) - set(named_groups))
    if unknown:
        raise ConfigError(f"optim.lr_scale.{unknown[0]}: the model has no such parameter group "
                          f"(it has: {', '.join(sorted(named_groups)) or 'none'})")
    named = list(model.named_parameters())
    stray = sorted((exempt | set().union(*named_groups.values())) - {n for n, _ in named})
    if stray:
        raise ValueError(f"no_weight_decay / lr_groups name unknown parameters {stray[:3]}")
    group_of = {n: g for g, names in named_groups.items() for n in names}
    groups: dict[tuple, dict] = {}
    for n, p in named:
        decay = p.ndim >= 2 and n not in exempt
        lr_group = group_of.get(n) if group_of.get(n) in scales else None
        key = (lr_group or "", decay)
        if key not in groups:
            groups[key] = {"name": f"{lr_group + '_' if lr_group else ''}{'decay' if decay else 'no_decay'}",
                           "params": [], "weight_decay": optim.weight_decay if decay else 0.0,
                           "lr": optim.lr * (scales[lr_group] if lr_group else 1.0)}
        groups[key]["params"].append(p)
    return list(groups.values())


def _ensure_dist_env():
    """Let ``python launchers/pretrain.py`` run as a single process without a launcher."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


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
    import deepspeed

    _ensure_dist_env()
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    if torch.cuda.is_available():
        deepspeed.init_distributed(dist_backend="nccl", **timeout)
        return
    # Reading __compatible_ops__ probes every op (compiler subprocesses); DeepSpeed does that here on CPU anyway.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", **timeout)


# A stop request waits this long for the current step to end (then the step is checkpointed and the run exits 0);
# past it the step is abandoned between two microbatches, unsaved (a long accumulation must not outlast the 30 s
# between DeepSpeed's forwarded SIGTERM and its SIGKILL).
STOP_GRACE_S = 2.0


class StopMidStep(Exception):
    """Raised between microbatches when a stop request has waited STOP_GRACE_S: the step is abandoned unsaved."""


def set_collective_timeout(seconds: float):
    """Give every process group, not only the world's, the timeout ``seconds``: torch's ``new_group`` (DeepSpeed's
    data-parallel and expert groups, where ZeRO reduces gradients) takes its own default (30 min on gloo) instead of
    the world group's, so a frozen peer met inside a gradient reduction would still be waited on for half an hour.
    ``_set_pg_timeout`` is torch's (private) setter for exactly this."""
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


class StopRequest:
    """Why this rank wants the run to stop after its current step: SIGTERM or SIGUSR1 (what SLURM and Kubernetes
    send before a kill), the death of the launcher that started it, or ``train.max_hours``.

    The handlers only set ``reason``; the training loop all-reduces the flag once per step, so every rank finishes
    the same step, writes its part of one checkpoint and exits 0. SIGTERM to the ``deepspeed`` runner kills the
    runner alone and leaves its ``deepspeed.launcher.launch`` child and the ranks running (runner.py installs no
    handler for a local launch): the ranks watch the launcher processes and stop when one is gone. DeepSpeed's
    launch.py forwards SIGTERM to the ranks and kills them 30 s later, so a save that takes longer needs SIGUSR1
    sent to the ranks themselves (docs/checkpoints.md, "Preemption").
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

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
        self.reason = self.reason or signal.Signals(signum).name

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
    """The DeepSpeed launcher processes above this rank (launch.py and the runner or remote shell that started it),
    as psutil handles; [] when this rank was not started by DeepSpeed's launcher."""
    import psutil  # a DeepSpeed dependency

    try:
        parent = psutil.Process(os.getppid())
        if "deepspeed.launcher.launch" not in " ".join(parent.cmdline()):
            return []
        watched = [parent]
        grand = parent.parent()
        if grand is not None and grand.pid > 1 and "deepspeed" in " ".join(grand.cmdline()):
            watched.append(grand)
        return watched
    except psutil.Error:
        return []


class Trainer:
    def __init__(self, cfg: RunConfig, ds_config_path: str, resume: str = "auto", allow_config_change: bool = False,
                 world_size: int | None = None):
        """Resolve and check every input (config, ds_config, resume point, data) without starting anything.

        ``world_size``: the number of ranks to plan for; None reads WORLD_SIZE (set by the launcher), as a training
        does. ``dry_run`` passes another one to check a bigger run from a login node."""
        self.cfg = cfg
        self.family = get_family(cfg.family)
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.resume = resume
        self.allow_config_change = allow_config_change
        self.resume_note = None  # set when resume falls back from what 'latest' names
        world_size = self.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        # Everything that can be wrong with the inputs fails here, before DeepSpeed starts.
        for p in (self.run_dir, *self.run_dir.parents):  # a file where the run directory (or a parent) belongs
            if p.exists() and not p.is_dir():
                raise ConfigError(f"run_dir: {p} exists and is not a directory; choose another run_dir")
        cfg.check_world_size(world_size)
        self.ds_config = resolve_ds_config(load_ds_config(ds_config_path), cfg, world_size, ds_config_path,
                                           torch.cuda.is_available())
        self.ds_config_path = ds_config_path
        self.zero_stage = self.ds_config.get("zero_optimization", {}).get("stage", 0)
        # Expert parallelism and the MoE backend: EP size against experts, world size and ZeRO stage (ZeRO-3: none).
        self.dtype = torch.bfloat16 if self.ds_config["bf16"]["enabled"] else torch.float32
        self.moe_backend = check_parallelism(cfg, world_size, self.zero_stage, self.dtype)
        self.resume_tag = self._find_resume_tag()
        saved = read_client_state(self.ckpt_dir / self.resume_tag) if self.resume_tag else None
        # resuming on another world size, ZeRO stage or EP size: None, "universal" (DeepSpeed's universal
        # checkpoint) or "consolidated" (expert parallelism: the project's full-tensor path, _load_consolidated)
        self.reshard = None
        if saved:  # before DeepSpeed starts: a resume that would change the data order is refused here
            self._check_resume_config(saved["config"], self.ckpt_dir / self.resume_tag, saved.get("world_size"))
            self.reshard = self._check_reshard(saved)
        self.loader_layout, self.resumed_loader = self._loader_layout(saved)
        self.dataset_samples = 0  # one epoch: every sample of every source once (for train.max_epochs)
        for key, spec in self._shard_specs():
            # The shards' tokenizer (manifest) must be the one this family reads, with ids inside model.vocab_size.
            check_shards_fit(spec, self.family, cfg.model.vocab_size, key)
            shards = resolve_shards(spec)  # reads the manifest (or, for brace URLs, every tar once)
            n = len(shards)
            self.dataset_samples += sum(sh.samples for sh in shards)
            if n < self.loader_layout.streams:
                raise ConfigError(f"{key}: {spec} has {n} shards, fewer than the {self.loader_layout.streams} loader "
                                  f"streams ({self.loader_layout.describe()})")
        self._check_step_fits(world_size)
        self.val_dirs = validation.check_validation(cfg, self.family)  # refused like the train shards
        # A run that has checkpoints of its own continues from them; init_from only seeds its first start.
        self.init_source = self._check_init_source() if cfg.train.init_from and not self.resume_tag else None
        self.init_from_record = str(self.init_source.resolve()) if self.init_source else None  # kept on resume

    def _check_step_fits(self, world_size: int):
        """Refuse, before anything starts, a step that reads more samples than the training set holds: each step
        holds every microbatch in memory (the token count of the whole step normalises its loss), so such a step
        only grows memory for minutes. A microbatch holds micro_batch_size samples, or at least one under a token
        budget (train.max_tokens_per_microbatch)."""
        t = self.cfg.train
        per_micro = 1 if t.max_tokens_per_microbatch else t.micro_batch_size
        need = t.grad_accum_steps * per_micro * world_size
        if need > self.dataset_samples:
            raise ConfigError(
                f"train.grad_accum_steps: one step reads at least {need:,} samples (grad_accum_steps "
                f"{t.grad_accum_steps:,} x {per_micro} a microbatch x {world_size} ranks) but the training set holds "
                f"{self.dataset_samples:,}; lower train.grad_accum_steps or train.micro_batch_size")

    def _loader_layout(self, saved: dict | None) -> tuple[StreamLayout, list | None]:
        """(the data's stream layout, the checkpoint's loader states dealt to this world size, or None).

        A resumed run keeps its checkpoint's streams, whatever world size reads them now (reshard_states); a new
        run deals the data into data.loader_streams streams (default ranks x max(1, workers))."""
        d = self.cfg.data
        states = (saved or {}).get("loader")
        try:
            if not states:  # a new run, or a checkpoint from before loader states (same world size only)
                layout = StreamLayout.fresh(self.world_size, 0, d.num_workers, d.loader_streams)
            else:
                states = reshard_states(states, self.world_size, d.num_workers)
                layout = StreamLayout(**saved_layout(states[0]), world_size=self.world_size, rank=0)
        except ValueError as e:
            where = f"checkpoint {self.ckpt_dir / self.resume_tag}: " if states else ""
            raise ConfigError(f"{where}{e}") from None
        if layout.local % max(1, d.num_workers):
            raise ConfigError(f"data.num_workers: {d.num_workers} workers cannot share each rank's {layout.local} "
                              f"loader streams ({layout.describe()}); use a number that divides {layout.local}")
        return layout, states

    def _check_reshard(self, saved: dict) -> str | None:
        """How the checkpoint continues here: None (its own layout), "universal" (another world size or ZeRO stage),
        "consolidated" (expert parallelism on either side with another world size, stage or EP size)."""
        source = self.ckpt_dir / self.resume_tag
        saved_stage, saved_ep = saved.get("zero_stage", 0), _expert_parallel_size(saved["config"])
        ep = self.cfg.train.expert_parallel_size
        if saved.get("world_size") == self.world_size and saved_stage == self.zero_stage and saved_ep == ep:
            return None
        where = (f"{saved.get('world_size')} ranks under ZeRO stage {saved_stage} with EP {saved_ep}, this run has "
                 f"{self.world_size} under stage {self.zero_stage} with EP {ep}")
        if saved_stage == 0 or self.zero_stage == 0:
            raise ConfigError(f"checkpoint {source} was written by {where}; a checkpoint moves to another layout with "
                              "its ZeRO optimizer shards, which need ZeRO stage 1-3 on both sides "
                              "(tools/convert_checkpoint.py exports the weights for any layout)")
        if not saved.get("loader"):
            raise ConfigError(f"checkpoint {source} was written by {where} and holds no per-stream loader position "
                              "(an older checkpoint); it continues only on its own layout")
        if saved_ep == 1 and ep == 1:
            return "universal"
        if saved_stage == 3:  # EP runs on stage 1-2; a ZeRO-3 source has no expert-parallel form to read
            raise ConfigError(f"checkpoint {source} was written by {where}; a ZeRO-3 checkpoint continues with "
                              "expert parallelism only through --init-from (its weights, fresh optimizer moments)")
        return "consolidated"

    def _shard_specs(self) -> list[tuple[str, str]]:
        """(config key, shard spec) of every source the loader reads."""
        d = self.cfg.data
        if not d.sources:
            return [("data.train_shards", d.train_shards)]
        return [(f"data.sources[{s.name}].shards", s.shards) for s in d.sources]

    def build_dataset(self, rank: int | None = None) -> ShardStream:
        """This rank's loader dataset from data.* and train.* (a mixture when data.sources is set); ``rank``: another
        rank's (the dry run reads every rank's streams from rank 0's)."""
        cfg, d = self.cfg, self.cfg.data
        kwargs = dict(rank=self.rank if rank is None else rank, world_size=self.loader_layout.world_size,
                      num_workers=d.num_workers, micro_batch_size=cfg.train.micro_batch_size, seed=cfg.seed,
                      transform=self.family.make_transform(cfg), pad_id=self.family.pad_id,
                      grad_accum_steps=cfg.train.grad_accum_steps, max_tokens=cfg.train.max_tokens_per_microbatch,
                      pack=d.pack, row_length=d.context_length, shuffle_buffer=d.shuffle_buffer,
                      mix_shards=d.mix_shards, vocab_size=cfg.model.vocab_size, verify=d.verify,
                      length_window=d.length_window, streams=self.loader_layout.streams,
                      seed_width=self.loader_layout.seed_width)
        if not d.sources:
            return ShardStream(d.train_shards, **kwargs)
        sources = []
        for s in d.sources:
            # A source's molecule picks its random-replacement pool (DNA sources draw T, RNA sources U).
            own = (self.family.make_transform(dataclasses.replace(cfg, data=dataclasses.replace(d, molecule=s.molecule)))
                   if s.molecule not in (None, d.molecule) else None)
            sources.append(Source(s.name, s.shards, own))
        return ShardStream(sources, mixture=d.mixture(), **kwargs)

    def _find_resume_tag(self) -> str | None:
        if self.resume == "never":
            if checkpoint_tags(self.ckpt_dir):
                raise ConfigError(f"--resume never: {self.ckpt_dir} already holds checkpoints; "
                                  "use --resume auto or another run_dir")
            return None
        if self.resume == "auto":
            tag, self.resume_note = resume_tag(self.ckpt_dir, check_files=True)
            return tag
        tag_dir = Path(self.resume)
        if not (tag_dir / "client_state.json").is_file():
            raise ConfigError(f"--resume {self.resume}: not a checkpoint directory (no client_state.json)")
        if not is_complete(tag_dir):
            raise ConfigError(f"--resume {self.resume}: incomplete checkpoint (no {COMPLETE} marker or an unreadable "
                              "client_state.json); it cannot be resumed")
        if bad := damaged_files(tag_dir):
            raise ConfigError(f"--resume {self.resume}: {bad[0].name} is damaged (not a readable torch archive: "
                              "truncated?); resume from an earlier checkpoint")
        if tag_dir.resolve().parent != self.ckpt_dir.resolve():
            # Continuing another run's checkpoint here would write into its folder, rotate its checkpoints away and
            # look its MLflow run up in this run's store: starting from another run is --init-from.
            raise ConfigError(f"--resume {self.resume}: not a checkpoint of this run ({self.ckpt_dir}); --resume "
                              "continues the same run, --init-from starts a new run from another run's checkpoint")
        return tag_dir.name

    def _check_init_source(self) -> Path:
        """Resolve train.init_from and check, before anything starts, that this run can start from it. A foreign
        checkpoint (a Hugging Face directory, a fair-esm .pt) is read and converted here, by the family
        (Family.import_weights), into self.foreign_state."""
        t = self.cfg.train
        self.foreign_state = None
        if is_foreign_checkpoint(t.init_from):
            src = Path(t.init_from)
            if self.family.import_weights is None:
                raise ConfigError(f"train.init_from: {src} is not a run, checkpoint or export of this pipeline (a "
                                  f"Hugging Face directory or a single file), and the {self.cfg.family} family "
                                  "starts from none of another code base")
            if t.init_from_optimizer:
                raise ConfigError(f"train.init_from_optimizer: {src} is a foreign checkpoint (weights only); set it "
                                  "to false")
            torch.manual_seed(self.cfg.seed)  # the fresh parts (routers, memory): setup's initial weights
            fresh = self.family.build_model(self.cfg.model).state_dict()
            try:
                self.foreign_state = self.family.import_weights(*load_esm2(src), self.cfg.model, fresh)
            except ValueError as e:  # ConfigError is one; a config that is not the checkpoint's backbone
                raise ConfigError(f"train.init_from: {src}: {e}") from None
            return src
        try:
            src = resolve_tag_dir(t.init_from)
        except ConfigError as e:
            raise ConfigError(f"train.init_from: {e}") from None
        check_same_model(load_yaml(src / "config.yaml"), self.cfg, src)
        if t.init_from_optimizer:
            if is_export(src):
                raise ConfigError(f"train.init_from_optimizer: {src} is an export (weights only, no optimizer "
                                  "state); set it to false or start from a DeepSpeed checkpoint")
            client = read_client_state(src)
            if client.get("world_size") != self.world_size:
                raise ConfigError(f"train.init_from_optimizer: {src} was written by {client.get('world_size')} "
                                  f"ranks, this run has {self.world_size}; the ZeRO optimizer shards load only on "
                                  "the same world size (set it to false to start from the weights alone)")
            stage = self.ds_config.get("zero_optimization", {}).get("stage", 0)
            if client.get("zero_stage", stage) != stage:
                raise ConfigError(f"train.init_from_optimizer: {src} was written under ZeRO stage "
                                  f"{client['zero_stage']}, this run uses {stage}")
            src_ep = _expert_parallel_size(client.get("config", {}))
            if src_ep != t.expert_parallel_size:
                raise ConfigError(f"train.init_from_optimizer: {src} was written with {EP_KEY} {src_ep}, this run "
                                  f"uses {t.expert_parallel_size}; the expert optimizer shards load only on the same "
                                  "layout (set it to false to start from the weights alone)")
        return src

    # ---------------------------------------------------------------------------------------------------------------
    def setup(self):
        import deepspeed  # imported here so config errors surface without DeepSpeed's start-up cost

        init_distributed(self.cfg.train.collective_timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # One training per run directory: rank 0 takes the lock before anything is written there, and every rank
        # learns the outcome, so a refused second training exits on all of its ranks at once.
        self.lock, error = RunDirLock(self.run_dir), None
        if self.rank == 0:
            try:
                self.lock.acquire()
            except ConfigError as e:
                error = str(e)
        error = broadcast_object(error)
        if error:
            raise ConfigError(error)
        self._check_ranks_agree()  # before any rank writes into run_dir
        log = current_run_log()
        if log is not None:
            log.attach(self.run_dir, fresh_errors=self.rank == 0)
        dist.barrier()  # rank 0 has cleared the last attempt's errors before any rank can record one
        if self.rank == 0 and self.resume_note:
            print(f"note: {self.resume_note}", flush=True)
        self.universal_dir = None  # set when this attempt loads a universal checkpoint
        self.stop = StopRequest(self.cfg.train.max_hours)
        self.stop.install()
        self.started = time.time()
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
            if "OMP_NUM_THREADS" not in os.environ:  # ranks on one host share its cores; oversubscribing halves speed
                local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or self.world)
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))

        torch.manual_seed(self.cfg.seed)  # identical initial weights on every rank
        model = self.family.build_model(self.cfg.model)
        init_weights_only = self.init_source is not None and not self.cfg.train.init_from_optimizer
        if init_weights_only:  # fp32 weights from any world size, ZeRO stage and EP size, or from an export
            state = self.foreign_state if self.foreign_state is not None else load_state_dict(self.init_source)
            load_weights_into(model, state, self.init_source)
            self.foreign_state = None
        # The full model is built and loaded on every rank; EP then keeps this rank's experts (and MegaBlocks, on
        # CUDA, replaces the expert computation) before the optimizer sees the parameters. EP's expert parameters go
        # into DeepSpeed's MoE groups (optimizer_groups), which ZeRO partitions over the expert-data-parallel group.
        model = parallelize(model, self.cfg, self.zero_stage, self.dtype)
        optimizer = torch.optim.AdamW(optimizer_groups(model, param_groups(model, self.cfg.optim)),
                                      lr=self.cfg.optim.lr, betas=tuple(self.cfg.optim.betas), eps=self.cfg.optim.eps)
        # Each group's peak lr; the trainer sets lr = peak * lr_factor before every step (no torch scheduler: the
        # factor may follow the words or samples consumed, which a step-counting scheduler cannot see).
        self.peak_lrs = [g["lr"] for g in optimizer.param_groups]
        ds_config = self.ds_config
        if self.reshard == "universal":  # this attempt loads DeepSpeed's universal checkpoint
            ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        set_collective_timeout(self.cfg.train.collective_timeout)  # also on the groups DeepSpeed just made

        self.step, self.batches_consumed, run_id = 0, 0, None
        self.cumulative = {}  # running totals over the whole run (all ranks): tokens, words, FLOPs, ...
        self.best = None  # (loss, step) of the lowest finite logged loss
        self.val_best = None  # (value, step) of the best checkpoint.keep_best metric so far
        self.horizon = schedule_horizon(self.cfg, self.dataset_samples)
        parent = None
        if self.resume_tag:
            run_id = self._load(self.resume_tag)
        elif self.init_source is not None:
            if not init_weights_only:
                self._load_init_optimizer(self.init_source)
            parent = self._parent_tags(self.init_source)
            if self.rank == 0:
                print(f"initialized from {self.init_source} "
                      f"({'weights and optimizer moments' if not init_weights_only else 'weights'})", flush=True)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.resume_tag and read_latest_tag(self.ckpt_dir) != self.resume_tag:
                # A rollback (--resume of an older tag) or a fallback past an incomplete latest: this is the
                # timeline now, and a crash before the next save must come back here.
                aside = set_aside_later_checkpoints(self.ckpt_dir, self.resume_tag)
                if aside:
                    print(f"note: the checkpoints after {self.resume_tag} were moved to {aside}", flush=True)
                    self._repoint_best()
                write_atomic(self.ckpt_dir / LATEST, self.resume_tag)
            write_atomic(self.run_dir / "config.yaml", dump_yaml(self.cfg))
            write_atomic(self.run_dir / "ds_config.json", json.dumps(self.ds_config, indent=1))
            self._truncate_logs()
        dist.barrier()
        self.tracker = Tracker(self.cfg, self.run_dir, self.rank, run_id, self.step if self.resume_tag else None,
                               tags=parent)
        if not self.resume_tag:
            self.tracker.log_artifact(self.run_dir / "config.yaml")
            self.tracker.log_artifact(self.run_dir / "ds_config.json")
            single = not self.cfg.data.sources
            for (_, spec), name in zip(self._shard_specs(), [s.name for s in self.cfg.data.sources] or [""]):
                if not is_url_pattern(spec):
                    self.tracker.log_artifact(Path(spec) / "manifest.json", "data" if single else f"data/{name}")

        self.dataset = self.build_dataset()
        if self.resumed_loader is not None:  # the exact position of this rank's streams (dealt to this world size)
            self.dataset.load_state_dict(self.resumed_loader[self.rank])
        elif self.batches_consumed:  # a checkpoint from before loader state_dicts: the count alone
            self.dataset.load_state_dict({"batches_consumed": self.batches_consumed})
        self.data = make_loader(self.dataset, self.cfg.data.num_workers)
        self.val_batches = (validation.heldout_batches(self.cfg, self.family, self.val_dirs) if self.val_dirs
                            else None)
        self.val_history = []  # rank 0: the validation records of metrics.jsonl, for the plot
        if self.rank == 0 and self.val_dirs and (self.run_dir / "metrics.jsonl").is_file():
            for ln in (self.run_dir / "metrics.jsonl").read_text().splitlines():
                rec = json.loads(ln)
                if any(k.startswith("val/") for k in rec):
                    self.val_history.append({k: v for k, v in rec.items() if k == "step" or k.startswith("val/")})

    def _check_ranks_agree(self):
        """Every rank runs the same run on the same storage, or every rank raises the same ConfigError.

        Nodes are started one by one (by hand, or one scheduler task each), each with its own command line and
        files. A node started with another --set, config file or ds_config would train another model or batch
        until some collective mismatched, or silently; a node whose run_dir is on its local disk would write its
        checkpoint shards and samples where no other node, and no resume, finds them. Three checks, in this order:
        the resolved run config and ds_config (a digest each rank computes, gathered; the full dicts only on a
        mismatch, to name the first differing key); that every rank sees the file rank 0 has just written into
        run_dir; that every rank resumes from the same checkpoint. run_dir itself is compared by what it holds, not
        by its string: nodes may mount the shared storage at different paths.
        """
        host = socket.gethostname()
        ours = {k: v for k, v in self.cfg.to_dict().items() if k != "run_dir"}
        ours["ds_config"] = self.ds_config
        digest = hashlib.sha256(json.dumps(ours, sort_keys=True, default=str).encode()).hexdigest()
        gathered = _all_gather_object((digest, host, os.path.abspath(self.run_dir), self.resume_tag))
        hosts = [g[1] for g in gathered]
        odd = [r for r, g in enumerate(gathered) if g[0] != gathered[0][0]]
        if odd:  # every rank sees the same digests, so every rank makes this second gather
            r, full = odd[0], _all_gather_object(ours)
            key, a, b = _diff_path(full[0], full[r], "")
            raise ConfigError(f"rank {r} (host {hosts[r]}) resolved another run than rank 0 (host {hosts[0]}): "
                              f"{key.lstrip('.')} is {b!r} there and {a!r} on rank 0"
                              f"{f' ({len(odd)} ranks differ)' if len(odd) > 1 else ''}; start every node with the "
                              "same --config, --set and --ds_config")
        # run_dir on shared storage: rank 0 writes a file of a fresh random name (never looked up before, so no
        # client can hold a stale negative cache entry for it) and every rank reads it back. Nothing is created on
        # the other ranks: a rank whose run_dir does not exist simply does not see the file.
        probe = None
        if self.rank == 0:
            for old in self.run_dir.glob(f"{SHARED_CHECK}*"):  # left by an attempt killed during its check
                old.unlink(missing_ok=True)
            probe = f"{SHARED_CHECK}{secrets.token_hex(8)}"
            write_atomic(self.run_dir / probe, probe)
        probe = broadcast_object(probe)
        deadline = time.monotonic() + 2.0  # file systems whose metadata reaches other clients with a delay
        while True:
            try:
                seen = (self.run_dir / probe).read_text() == probe
            except OSError:
                seen = False
            if seen or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        blind = [r for r, ok in enumerate(_all_gather_object(seen)) if not ok]
        if self.rank == 0:
            (self.run_dir / probe).unlink(missing_ok=True)
        if blind:
            r = blind[0]
            raise ConfigError(f"run_dir {gathered[r][2]} on rank {r} (host {hosts[r]}) does not show the file rank 0 "
                              f"(host {hosts[0]}) just wrote into its run_dir {gathered[0][2]}"
                              f"{f' ({len(blind)} ranks do not)' if len(blind) > 1 else ''}: the run directory "
                              "(checkpoints, logs) must be on storage every node shares")
        tags = [g[3] for g in gathered]
        r = next((r for r, t in enumerate(tags) if t != tags[0]), None)
        if r is not None:
            raise ConfigError(f"rank {r} (host {hosts[r]}) would resume from {tags[r] or 'no checkpoint'} and rank 0 "
                              f"(host {hosts[0]}) from {tags[0] or 'no checkpoint'}; start every node with the same "
                              "--resume")

    def _load_init_optimizer(self, src: Path):
        """Weights and AdamW moments of another run's DeepSpeed checkpoint; this run's hyper-parameters and schedule.

        DeepSpeed restores the source's param-group hyper-parameters (its lr, betas, weight decay) along with the
        moments, and its step counters: put this run's back, so the first step's lr is this run's schedule at 0.
        """
        ours = _group_hypers(self.optimizer)
        path, _ = self.engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {src}")
        for group, hyper in zip(self.optimizer.param_groups, ours):
            group.update(hyper)
        self.engine.global_steps = self.engine.global_samples = self.engine.skipped_steps = 0

    def _parent_tags(self, src: Path) -> dict:
        """MLflow tags linking this run to the run it started from."""
        if is_foreign_checkpoint(src):
            return {"parent_checkpoint": str(src.resolve()), "init_from_optimizer": "False"}
        client = read_client_state(src)
        tags = {"parent_checkpoint": str(src.resolve()), "init_from_optimizer": str(self.cfg.train.init_from_optimizer)}
        if client.get("mlflow_run_id"):  # a run started offline holds 'pending:<key>' until its journal knows more
            client["mlflow_run_id"] = resolve_run_id(src.parent.parent, client["mlflow_run_id"],
                                                     client.get("mlflow_tracking_uri")) or client["mlflow_run_id"]
        for key, name in (("mlflow_run_id", "parent_run_id"), ("mlflow_tracking_uri", "parent_tracking_uri"),
                          ("step", "parent_step"), ("source", "parent_export_source")):
            if client.get(key) is not None:
                tags[name] = str(client[key])
        return tags

    def _load(self, tag: str) -> str | None:
        saved = read_client_state(self.ckpt_dir / tag)
        check_same_model(saved["config"], self.cfg, self.ckpt_dir / tag)
        if self.reshard == "consolidated":
            client = self._load_consolidated(tag, saved)
        else:
            client = self._load_deepspeed(tag, saved)
        self.step, self.batches_consumed = client["step"], client["batches_consumed"]
        self.cumulative = dict(client.get("cumulative", {}))
        self.best = tuple(client["best"]) if client.get("best") else None
        self.val_best = tuple(client["val_best"]) if client.get("val_best") else None
        self.horizon = self._resumed_horizon(client, saved["config"])
        self.init_from_record = client.get("init_from")
        if self.rank == 0:
            saved_ep, ep = _expert_parallel_size(saved["config"]), self.cfg.train.expert_parallel_size
            moved = (f" (written by {saved['world_size']} ranks under ZeRO stage {saved.get('zero_stage', 0)}"
                     + (f" with EP {saved_ep}" if max(saved_ep, ep) > 1 else "")
                     + f", continued on {self.world} under stage {self.zero_stage}"
                     + (f" with EP {ep}" if max(saved_ep, ep) > 1 else "") + ")" if self.reshard else "")
            print(f"resumed from {self.ckpt_dir / tag} at step {self.step}{moved}", flush=True)
        return client.get("mlflow_run_id")

    def _load_consolidated(self, tag: str, saved: dict) -> dict:
        """Continue an expert-parallel checkpoint on another world size, ZeRO stage (1-2) or EP size: the full fp32
        master and Adam moments of every parameter, read from the ZeRO-1/2 shards in the single-process names
        (pipeline.checkpoint.zero12_optimizer_state: experts under their global ids), are set into this engine's
        partitions with DeepSpeed's tensor-fragment API, each local expert from its global id. DeepSpeed's universal
        checkpoint does not place this project's experts (it writes them under their local names)."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from pipeline.checkpoint import _EXPERT_KEY

        source = self.ckpt_dir / tag
        full, step = zero12_optimizer_state(source)
        # Adam's state exists only after a first step: make it (one flat tensor per partition, as AdamW's own would
        # be) and link the parameters' fragments to it, as ZeRO-1/2 does after its first step.
        zero = self.optimizer
        for flat in zero.single_partition_of_fp32_groups:
            zero.optimizer.state[flat].update(step=torch.tensor(float(step)), exp_avg=torch.zeros_like(flat),
                                              exp_avg_sq=torch.zeros_like(flat))
        zero._lazy_init_hp_params_optimizer_state()
        module = self.engine.module
        owners = {name: m for name, m in module.named_modules() if hasattr(m, "global_expert_ids")}
        for name, param in module.named_parameters():
            key = name
            m = _EXPERT_KEY.match(name)
            owner = owners.get(m.group(1).split(".deepspeed_moe.")[0]) if m else None
            if owner is not None:  # EP: ...deepspeed_experts.<local>.w -> ...deepspeed_experts.<global>.w
                key = f"{m.group(1)}{owner.global_expert_ids()[int(m.group(2))]}{m.group(3)}"
            if key not in full["fp32"]:
                raise ConfigError(f"{source}: parameter {key} is not in the checkpoint's optimizer shards")
            with torch.no_grad():
                param.copy_(full["fp32"][key].to(param.dtype))  # the forward's weights (ZeRO-1/2: whole per rank)
            safe_set_full_fp32_param(param, full["fp32"][key])
            for moment in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(param, full[moment][key], moment)
        self.engine.global_steps = int(saved["step"])
        return saved

    def _load_deepspeed(self, tag: str, saved: dict) -> dict:
        """DeepSpeed's own load: the checkpoint as written, or its universal form on another world size or stage."""
        load_dir = self._universal_checkpoint(tag, saved) if self.reshard == "universal" else self.ckpt_dir
        hyper = _group_hypers(self.optimizer)
        path, client = self.engine.load_checkpoint(str(load_dir), tag=tag, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {load_dir / tag}")
        if self.reshard:
            # ZeRO-3's universal load gives every param group the first one's hyper-parameters (weight decay on the
            # gains too) and every parameter one shared step tensor, which AdamW would then advance once per group
            for group, h in zip(self.optimizer.param_groups, hyper):
                group.update(h)
            for state in getattr(self.optimizer, "optimizer", self.optimizer).state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        return client

    def _check_resume_config(self, saved: dict, source: Path, saved_world: int | None = None):
        """A resumed run must see the data the uninterrupted run would have seen: same seed, batch arithmetic and
        data spec (RESUME_INVARIANTS), unless --allow-config-change. On another world size the global batch
        (micro x accumulation x ranks) must stay, so grad_accum_steps scales inversely with the ranks."""
        ours = self.cfg.to_dict()
        for key in RESUME_INVARIANTS:
            a, b = _get_path(saved, key), _get_path(ours, key)
            if key == "data":  # checking digests, or how many workers read the streams, does not change what is read
                a, b = ({k: v for k, v in (x or {}).items() if k not in ("verify", "num_workers", "val_shards")}
                        for x in (a, b))
                a.setdefault("loader_streams", None)  # checkpoints from before the key dealt ranks x workers
            if key == "train.grad_accum_steps" and saved_world and saved_world != self.world_size:
                mb = _get_path(ours, "train.micro_batch_size")
                a, b = a * saved_world, b * self.world_size  # microbatches per optimizer step, all ranks
                if a != b and not self.allow_config_change:
                    fit = f"set train.grad_accum_steps={a // self.world_size}" if a % self.world_size == 0 else (
                        f"{a} microbatches per step do not divide among {self.world_size} ranks")
                    raise ConfigError(f"train.grad_accum_steps: {b // self.world_size} x {self.world_size} ranks x "
                                      f"micro {mb} is not the global batch of checkpoint {source} ({a} microbatches "
                                      f"on {saved_world} ranks); {fit}")
            if key == "data" and "mix_shards" not in a:  # checkpoints from before the key read one shard at a time
                a["mix_shards"] = 1
            if key == "data" and "length_window" not in a:  # ... and batched in draw order
                a["length_window"] = 0
            if a != b:
                if self.allow_config_change:
                    if os.environ.get("RANK", "0") == "0":
                        print(f"warning: {key} changed since checkpoint {source} ({a!r} -> {b!r}); continuing "
                              "(--allow-config-change): the data order is no longer the uninterrupted run's",
                              flush=True)
                    continue
                detail = _first_difference(a, b, key)
                raise ConfigError(f"{detail} in checkpoint {source}; a resumed run must keep the seed, batch "
                                  "arithmetic and data spec of its checkpoint (--allow-config-change to continue "
                                  "anyway, --init-from to start a new run from it)")

    def _universal_checkpoint(self, tag: str, saved: dict) -> Path:
        """DeepSpeed's universal form of checkpoint ``tag`` (ds_to_universal: every parameter's fp32 weight and Adam
        moments whole, loadable on any world size and ZeRO stage), made once by rank 0 under RUN/universal/ and
        removed after this run's next checkpoint. Returns the directory that holds it as ``tag``."""
        root = self.run_dir / "universal"
        out, failed = root / tag, None
        if self.rank == 0 and not (out / COMPLETE).is_file():
            shutil.rmtree(out, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".{tag}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"converting {self.ckpt_dir / tag} ({saved['world_size']} ranks, ZeRO stage "
                  f"{saved.get('zero_stage')}) to a universal checkpoint in {out}", flush=True)
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   str(self.ckpt_dir / tag), "--output_folder", str(tmp), "--num_extract_workers", "1",
                   "--num_merge_workers", "1", "--inject_missing_state"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
                failed = (f"checkpoint {self.ckpt_dir / tag}: DeepSpeed's ds_to_universal failed "
                          f"({lines[-1]}); it continues on {saved['world_size']} ranks under ZeRO stage "
                          f"{saved.get('zero_stage')}")
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                # DeepSpeed's universal loader opens the model-state file (client state; the weights come from zero/)
                # under the name of the loading run's stage: ZeRO-3 zero_pp_rank_0_mp_rank_00_model_states.pt, else
                # mp_rank_00_model_states.pt. The conversion writes the source stage's; give it both names.
                names = [tmp / "mp_rank_00_model_states.pt", tmp / "zero_pp_rank_0_mp_rank_00_model_states.pt"]
                have = next((f for f in names if f.is_file()), None)
                for f in names:
                    if have is not None and not f.is_file():
                        shutil.copy(have, f)
                if self.zero_stage == 3:
                    _add_stage3_optimizer_step(tmp / "zero")
                mark_complete(tmp)
                tmp.rename(out)
        failed = broadcast_object(failed)
        if failed:
            raise ConfigError(failed)
        self.universal_dir = out
        return root

    def _resumed_horizon(self, client: dict, saved: dict) -> dict:
        """The checkpoint's schedule horizon; a changed optim.schedule_steps is the one way to re-schedule."""
        if client.get("schedule"):
            horizon = client["schedule"]
        else:  # checkpoints from before the horizon was stored: what their own config gave
            saved_cfg = {**saved.get("optim", {}), **saved.get("train", {})}
            horizon = {"unit": "steps", "total": saved_cfg.get("schedule_steps") or saved_cfg.get("max_steps")}
        wanted = self.cfg.optim.schedule_steps
        if wanted and wanted != saved.get("optim", {}).get("schedule_steps"):
            if self.rank == 0:
                print(f"note: optim.schedule_steps {wanted} replaces the checkpoint's schedule horizon {horizon}",
                      flush=True)
            return {"unit": "steps", "total": wanted}
        return horizon

    def _truncate_logs(self):
        """Drop log lines of steps after the resume point (a killed run may have logged past its last checkpoint).
        A fresh start truncates nothing: logs left by a start that stopped before its first checkpoint are moved to
        RUN_DIR/earlier-start-N/."""
        logs = [f for f in [self.run_dir / "metrics.jsonl", *self.run_dir.glob("samples-rank*.jsonl")] if f.is_file()]
        if not self.resume_tag and any(f.stat().st_size for f in logs):
            aside = next(d for i in range(1, 10**6) if not (d := self.run_dir / f"earlier-start-{i}").exists())
            aside.mkdir()
            for f in logs:
                f.rename(aside / f.name)
            print(f"note: the logs of an earlier start without checkpoints were moved to {aside}", flush=True)
            return
        for f in logs:
            keep = [ln for ln in f.read_text().splitlines() if ln and json.loads(ln)["step"] <= self.step]
            write_atomic(f, "".join(ln + "\n" for ln in keep))

    def save(self, milestone: bool = False, best: bool = False):
        """Checkpoint this step; ``milestone`` checkpoints (checkpoint.at_steps / at_words) survive keep_last;
        ``best``: this step is the best by checkpoint.keep_best, ``best`` names it (and rotation keeps it).

        Order: every rank's shards, then (rank 0) client_state.json and config.yaml, then the COMPLETE marker, then
        ``latest``, then rotation. A failure at any point leaves ``latest`` on the previous complete checkpoint.
        """
        tag = f"step{self.step:08d}"
        tag_dir = self.ckpt_dir / tag
        # DeepSpeed stores client_state from rank 0 only, and every rank's loader is somewhere else: gather them.
        loader = _all_gather_object(self.data.state_dict())
        client = {"format": CHECKPOINT_FORMAT, "step": self.step, "batches_consumed": self.batches_consumed,
                  "world_size": self.world, "zero_stage": self.ds_config.get("zero_optimization", {}).get("stage", 0),
                  "cumulative": self.cumulative, "loader": loader, "mlflow_run_id": self.tracker.run_id,
                  "mlflow_tracking_uri": self.tracker.uri, "milestone": milestone, "schedule": self.horizon,
                  "best": list(self.best) if self.best else None,
                  "val_best": list(self.val_best) if self.val_best else None,
                  "init_from": self.init_from_record, "config": self.cfg.to_dict()}
        if self.rank == 0 and tag_dir.exists():
            # The same tag from an abandoned timeline (after a rollback) or a save that died: never let its old
            # COMPLETE marker vouch for the files about to be rewritten.
            shutil.rmtree(tag_dir)
        dist.barrier()
        try:
            # save_latest=False: DeepSpeed writes 'latest' on rank 0 before the other ranks finish their shards; we
            # write it after save_checkpoint's closing barrier, atomically, so 'latest' only names a whole one.
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False)
            failed = None
        except Exception as e:  # noqa: BLE001 - every rank must reach the barrier below to agree on the outcome
            failed = _describe_save_error(e, tag_dir)
        failures = [f for f in _all_gather_object(failed) if f]
        if failures:
            raise CheckpointWriteError(f"{failures[0]}; {LATEST} still names "
                                       f"{read_latest_tag(self.ckpt_dir) or 'no checkpoint'}")
        failed = None
        if self.rank == 0:
            try:
                write_atomic(tag_dir / "client_state.json", json.dumps(client, indent=1))
                write_atomic(tag_dir / "config.yaml", dump_yaml(self.cfg))
                mark_complete(tag_dir)
                write_atomic(self.ckpt_dir / LATEST, tag)
                if best:
                    write_atomic(self.ckpt_dir / BEST, tag)
                rotate(self.ckpt_dir, self.cfg.checkpoint.keep_last, tag)
                if self.universal_dir is not None:  # this run's own checkpoint is the resume point now
                    shutil.rmtree(self.universal_dir.parent, ignore_errors=True)
                    self.universal_dir = None
            except OSError as e:
                failed = _describe_save_error(e, tag_dir)
        failed = broadcast_object(failed)
        if failed:
            raise CheckpointWriteError(f"{failed}; {LATEST} still names "
                                       f"{read_latest_tag(self.ckpt_dir) or 'no checkpoint'}")
        self.last_saved = tag

    def _repoint_best(self):
        """After a rollback: ``best`` names the resumed timeline's best checkpoint (client_state val_best), or
        nothing when that one is gone."""
        best = read_latest_tag(self.ckpt_dir, BEST)
        if best is None or (self.ckpt_dir / best).is_dir():
            return
        tag = f"step{self.val_best[1]:08d}" if self.val_best else None
        if tag and (self.ckpt_dir / tag).is_dir():
            write_atomic(self.ckpt_dir / BEST, tag)
        else:
            (self.ckpt_dir / BEST).unlink()

    def validate(self, train_seconds: float) -> dict:
        """The validation metrics of the current weights (every rank; pipeline/validation.py), printed and (rank 0)
        plotted into RUN_DIR/validation.png. They go to MLflow with the step's record: the tracker sends one record
        per step (pipeline/tracking.py)."""
        val = validation.evaluate(self.engine.module, self.cfg, self.family, self.val_batches, self.device,
                                  self.rank, self.world)
        self.val_seconds += val["val/seconds"]
        val["val/time_share"] = self.val_seconds / max(train_seconds + self.val_seconds, 1e-9)
        if self.rank == 0:
            shown = " | ".join(f"{k.removeprefix('val/')} {v:.4f}" for k, v in val.items()
                               if k.startswith(("val/loss", "val/accuracy", "val/perplexity")))
            print(f"validation at step {self.step}: {shown} | {val['val/seconds']:.1f} s "
                  f"({100 * val['val/time_share']:.1f}% of the run's time)", flush=True)
            self.val_history.append({"step": self.step, **val})
            plot = validation.plot_history(self.val_history, self.run_dir / "validation.png")
            if plot is not None:
                self.tracker.log_artifact(plot)
        return val

    def _improves_best(self, val: dict) -> bool:
        """Whether ``val`` improves checkpoint.keep_best (then self.val_best is this step)."""
        key, mode = self.cfg.checkpoint.keep_best, self.cfg.checkpoint.best_mode
        if key is None:
            return False
        if key not in val:
            raise ConfigError(f"checkpoint.keep_best: {key} is not a validation metric of this run (it has "
                              f"{', '.join(k for k in val if k not in ('val/seconds', 'val/time_share'))})")
        v = val[key]
        if not math.isfinite(v) or (self.val_best is not None
                                    and not (v < self.val_best[0] if mode == "min" else v > self.val_best[0])):
            return False
        self.val_best = (v, self.step)
        return True

    def _budget_spent(self) -> bool:
        t, c = self.cfg.train, self.cumulative
        return ((t.max_words is not None and c.get("words", 0) >= t.max_words)
                or (t.max_epochs is not None and c.get("samples", 0) >= t.max_epochs * self.dataset_samples))

    def mixture_metrics(self, step: int) -> dict:
        """mix/weight/<source> in force at 0-based ``step``; mix/samples|tokens/<source> consumed so far, all ranks.

        One all-reduce (SUM) of 2 x sources numbers; every rank calls it once per step.
        """
        seen = self.data.seen()  # name -> (samples, tokens) of this rank; tokens = sequence lengths incl. framing
        names = list(seen)
        vec = torch.tensor([seen[n][0] for n in names] + [seen[n][1] for n in names], dtype=torch.float64,
                           device=self.device)  # NCCL reduces only CUDA tensors
        dist.all_reduce(vec)
        weights = self.dataset.mixture.weights(step)
        out = {}
        for i, n in enumerate(names):
            out[f"mix/weight/{n}"] = float(weights[i])
            out[f"mix/samples/{n}"] = int(vec[i])
            out[f"mix/tokens/{n}"] = int(vec[len(names) + i])
        return out

    # ---------------------------------------------------------------------------------------------------------------
    def set_lr(self) -> float:
        """Put the schedule's lr for 0-based step ``self.step`` into every param group; returns the base group's."""
        factor = lr_factor(self.cfg.optim, self.horizon, self.step, self.cumulative)
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs):
            group["lr"] = peak * factor
        return self.optimizer.param_groups[0]["lr"]

    def _between(self, i: int, n: int, what: str, t0: float):
        """After microbatch i of n of a step was read or computed: a heartbeat on a long step, and a stop request
        that has waited STOP_GRACE_S for the step to end abandons the step (StopMidStep). While microbatches are
        computed (collectives run between them) the ranks decide together, one all-reduce per microbatch, and only
        when a step has more than one; reading is local, each rank decides for itself."""
        now = time.perf_counter()
        if now - self._beat >= self.cfg.train.heartbeat_seconds:
            self._beat = now
            if self.rank == 0:
                print(f"step {self.step + 1}: microbatch {i} of {n} {what}, {now - t0:.0f} s into the step",
                      flush=True)
        if self.stop.requested() and self._stop_seen is None:
            self._stop_seen = now
        want = self._stop_seen is not None and now - self._stop_seen >= STOP_GRACE_S
        if what == "computed":
            if n == 1 or i == n:
                return  # the end of the step: the per-step check decides (and saves)
            flag = torch.tensor([float(want)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            want = bool(flag.item())
        if want:
            raise StopMidStep(f"microbatch {i} of {n} {what}")

    def _stop_requested(self) -> bool:
        """Whether any rank wants to stop after this step (one all-reduce, MAX, of one number per step)."""
        flag = torch.tensor([float(self.stop.requested())], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def train(self):
        cfg = self.cfg
        data = self.data
        metrics_file = open(self.run_dir / "metrics.jsonl", "a") if self.rank == 0 else None
        samples_file = (open(self.run_dir / f"samples-rank{self.rank}.jsonl", "a") if cfg.train.log_samples else None)
        peak = cfg.train.peak_flops_per_device
        status, self.stopped_by, self.last_saved = "FAILED", "train.max_steps", None
        streak, streak_start = 0, None  # consecutive non-finite steps and the first of them
        start_step, t_start, self.last_loss = self.step, time.perf_counter(), float("nan")
        interval = [0, 0]  # tokens computed, real tokens since the last logged step (padding_ratio)
        self._stop_seen = None  # when this rank first saw a stop request inside a step (_between)
        profiler = StepProfiler(cfg.train.profile, self.run_dir, self.rank)
        self.collective = "the first step's collectives"  # what a collective timeout waited in (its error line)
        self.val_seconds = 0.0  # this attempt's validation time (val/time_share)
        try:
            while self.step < cfg.train.max_steps:
                if self._budget_spent():
                    self.stopped_by = "budget"
                    break  # resumed after the word or epoch budget was spent
                profiler.before_step(self.step + 1)
                t0 = self._beat = time.perf_counter()
                n = cfg.train.grad_accum_steps
                try:
                    micro = []
                    for i in range(n):
                        micro.append(next(data))
                        self._between(i + 1, n, "read", t0)
                    self.batches_consumed += len(micro)
                    lr = self.set_lr()
                    skipped_before = self.engine.skipped_steps
                    self.collective = (f"the collectives of step {self.step + 1} (token counts, gradient reduction, "
                                       "statistics)")
                    rec = train_step(self.engine, self.family, cfg, micro, self.step, self.device,
                                     between=lambda i, n: self._between(i, n, "computed", t0))
                except StopMidStep as e:
                    self.stopped_by = self.stop.reason or "a stop request on another rank"
                    if self.rank == 0:
                        print(f"stopping during step {self.step + 1} ({e}): {self.stopped_by}; the step is not "
                              f"saved, the last complete checkpoint is {read_latest_tag(self.ckpt_dir) or 'none'}; "
                              "the same command resumes from it", flush=True)
                    break
                rec.update(self.mixture_metrics(self.step))
                self.step += 1
                profiler.after_step(self.step)
                # Non-finite: a loss or gradient norm that is inf/NaN, or DeepSpeed's own overflow check skipping
                # the update (it does on every ZeRO stage). The weights are then those of the last good step.
                overflow = self.engine.skipped_steps > skipped_before
                # A step without supervised tokens (loss NaN by definition) is skipped but is no sign of divergence.
                nonfinite = overflow or not (math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"]))
                rec["nonfinite"] = int(nonfinite and rec["supervised_tokens"] > 0)
                rec["skipped"] = int(rec["skipped"] or overflow)
                streak = streak + 1 if rec["nonfinite"] else 0
                streak_start = (streak_start or self.step) if streak else None
                dt = time.perf_counter() - t0
                interval = [interval[0] + rec["tokens_computed"], interval[1] + rec["tokens"]]
                # padded / real tokens over the steps since the last logged one: the logged interval at a log step
                rec["padding_ratio"] = interval[0] / interval[1] if interval[1] else float("nan")
                rec.update(step=self.step, time=time.time(), lr=lr, step_time=dt, tokens_per_s=rec["tokens"] / dt,
                           tflops_per_device=rec.get("flops", 0.0) / self.world / dt / 1e12)
                if peak:
                    rec["mfu"] = rec["tflops_per_device"] * 1e12 / peak
                words_before = self.cumulative.get("words", 0.0)
                for k in CUMULATIVE:  # identical on every rank: the per-step values are already all-reduced
                    if k in rec:
                        self.cumulative[k] = self.cumulative.get(k, 0.0) + rec[k]
                        rec[f"total/{k}"] = self.cumulative[k]
                self.last_loss = rec["loss"]
                new_best = validated = False
                if cfg.eval.every and (self.step % cfg.eval.every == 0 or self.step == cfg.train.max_steps):
                    self.collective = f"the validation after step {self.step}"
                    val = self.validate(time.perf_counter() - t_start - self.val_seconds)
                    rec.update(val)
                    validated = True
                    new_best = streak == 0 and self._improves_best(val)  # a checkpoint is written below
                if not rec["nonfinite"] and math.isfinite(rec["loss"]) and (self.best is None
                                                                            or rec["loss"] < self.best[0]):
                    self.best = (rec["loss"], self.step)
                words = self.cumulative.get("words", 0.0)
                milestone = (any(words_before < w <= words for w in cfg.checkpoint.at_words)
                             or self.step in cfg.checkpoint.at_steps)
                rec["epochs"] = self.cumulative["samples"] / self.dataset_samples
                budget_spent = self._budget_spent()
                if samples_file:
                    samples_file.write(json.dumps({"step": self.step, "ids": [s for b in micro for s in b.sample_ids]})
                                       + "\n")
                if metrics_file:
                    metrics_file.write(json.dumps(rec) + "\n")
                    metrics_file.flush()
                if rec["nonfinite"] and self.rank == 0:
                    print(f"warning: step {self.step}: non-finite loss {rec['loss']} / grad norm {rec['grad_norm']}: "
                          f"update skipped ({streak} in a row, train.max_nonfinite_steps "
                          f"{cfg.train.max_nonfinite_steps})", flush=True)
                last = self.step == cfg.train.max_steps
                if self.step % cfg.tracking.every == 0 or last or validated:
                    self.tracker.log_metrics({k: v for k, v in rec.items() if k != "step"}, self.step)
                if self.step % cfg.train.log_every == 0 or last:
                    interval = [0, 0]
                    if self.rank == 0:
                        print(f"step {self.step}/{cfg.train.max_steps} | loss {rec['loss']:.4f} | lr {lr:.3e} | "
                              f"grad_norm {rec['grad_norm']:.3f} | tok/s {rec['tokens_per_s']:.0f} | "
                              f"TFLOP/s/dev {rec['tflops_per_device']:.3f} | step {dt * 1000:.0f} ms", flush=True)
                if streak >= cfg.train.max_nonfinite_steps:
                    raise TrainingStopped(
                        f"training diverged: {streak} consecutive non-finite steps ({streak_start}-{self.step}, "
                        f"train.max_nonfinite_steps {cfg.train.max_nonfinite_steps}); no checkpoint was written "
                        f"during them, the last good one is {read_latest_tag(self.ckpt_dir) or 'none'}. Lower "
                        "optim.lr or raise optim.warmup_steps and resume from it")
                self.collective = f"the stop-flag all-reduce after step {self.step}"
                stop = self._stop_requested()
                self.collective = f"the checkpoint save of step {self.step}"
                periodic = (self.step % cfg.checkpoint.every_steps == 0 or self.step == cfg.train.max_steps
                            or milestone or budget_spent or stop or new_best)
                if periodic and streak == 0:  # never checkpoint a model in a non-finite streak
                    if samples_file:
                        samples_file.flush()
                    self.save(milestone, best=new_best)
                if budget_spent:
                    self.stopped_by = "budget"
                    if self.rank == 0:
                        print(f"budget reached: {words:.0f} words (train.max_words {cfg.train.max_words}), "
                              f"{rec['epochs']:.3f} epochs (train.max_epochs {cfg.train.max_epochs})", flush=True)
                    break
                if stop:
                    self.stopped_by = self.stop.reason or "a stop request on another rank"
                    if self.rank == 0:
                        print(f"stopping at step {self.step}: {self.stopped_by}; checkpoint "
                              f"{self.last_saved or 'not written (non-finite step)'}; the same command resumes",
                              flush=True)
                    break
            status = "FINISHED" if self.stopped_by in ("train.max_steps", "budget") else "KILLED"
        except BaseException as e:
            lost = not isinstance(e, (CheckpointWriteError, TrainingStopped)) and _lost_peer(e)
            self.stopped_by = ("the loss of another rank" if lost else "divergence" if isinstance(e, TrainingStopped)
                               else f"an error ({type(e).__name__})")
            if not lost:
                raise
            # gloo's own text blames "a remote worker hanging or bugs in the application"; say what to do instead
            detail = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [""])[0]).split(". This is")[0]
            latest = read_latest_tag(self.ckpt_dir) or "none"
            if "timed out" in detail.lower() or "timeout" in detail.lower():
                raise PeerLost(f"no answer from another rank for {cfg.train.collective_timeout:g} s "
                               f"(train.collective_timeout) in {self.collective} ({detail}): a "
                               "rank is frozen (stopped, swapping, a hung device) or its node is unreachable; the last "
                               f"complete checkpoint is {latest}: stop every rank and start again with the same "
                               "command to resume from it") from e
            raise PeerLost(f"lost contact with another rank during step {self.step + 1} ({detail}): a node died or was "
                           f"killed, or the network between the nodes failed; the last complete checkpoint is {latest}: "
                           "start every node again with the same command to resume from it") from e
        finally:
            profiler.close(self.step)  # a run that ends inside the window still writes what it recorded
            for f in (metrics_file, samples_file):
                if f:
                    f.close()
            self.stop.restore()
            try:
                if status == "FINISHED" and self.rank == 0:
                    self.tracker.log_artifact(self.run_dir / "metrics.jsonl")
                self.tracker.finish(status)
            except Exception as e:  # noqa: BLE001 - tracking never masks the training's own outcome
                print(f"warning: tracking: could not finish the MLflow run ({type(e).__name__}: {e})", flush=True)
            if self.rank == 0:
                self._print_summary(status, self.step - start_step, time.perf_counter() - t_start)

    def _print_summary(self, status: str, steps_this_attempt: int, seconds: float):
        """The run's last lines: how far it got, where its checkpoints and tracking live, how to export it."""
        c = self.cumulative
        latest = read_latest_tag(self.ckpt_dir)
        best = f"{self.best[0]:.4f} at step {self.best[1]}" if self.best else "n/a"
        lines = [
            f"==== run {self.run_dir} {status.lower()}: step {self.step}/{self.cfg.train.max_steps} "
            f"(stopped by {self.stopped_by}), {steps_this_attempt} steps in {_hms(seconds)} ====",
            f"loss: final {self.last_loss:.4f}, best {best} | tokens {c.get('tokens', 0):.4g} | samples {c.get('samples', 0):.4g} | skipped steps "
            f"{c.get('skipped', 0):.0f} | non-finite steps {c.get('nonfinite', 0):.0f}",
            f"checkpoints: {self.ckpt_dir} (latest {latest or 'none'})",
        ]
        if latest:
            lines.append(f"export: python tools/convert_checkpoint.py --checkpoint {self.run_dir} "
                         f"--output exports/{self.run_dir.name} --trust-checkpoint")
        if self.tracker.uri:
            lines.append(f"mlflow: run {self.tracker.run_id} in {self.tracker.uri} "
                         f"(mlflow ui --backend-store-uri {self.tracker.uri})")
        lines.append(f"log: {self.run_dir / 'train.log'}, metrics: {self.run_dir / 'metrics.jsonl'}")
        print("\n".join(lines), flush=True)


def train_step(engine, family, cfg: RunConfig, micro: list, step: int, device, between=None) -> dict:
    """One optimizer step over the microbatches ``micro`` of this rank (see the module docstring). ``between(i, n)``
    is called after each microbatch's backward (the Trainer's heartbeat and mid-step stop).

    Collectives, in order: one all-reduce (SUM) of the token counts, one (MAX) of the plans' sync values, then the
    microbatches' forward/backward, then one all-gather of the statistic names and one all-reduce (SUM) of their
    values. Every rank makes the same calls in the same order, whatever its data. The reduced tensors live on
    ``device``: an NCCL process group reduces only CUDA tensors.
    """
    world = dist.get_world_size()
    # a microbatch's draws (depths, initial states) are seeded by its origin, not by the rank reading it: a run
    # continued on another world size draws what the uninterrupted run would have
    plans = [family.plan(b, cfg, step=step, stream=b.origin[0], index=b.origin[1]) for b in micro]
    # tokens computed: rows x padded length of every microbatch [B, L], real tokens included (padding_ratio)
    counts = torch.tensor([sum(b.num_supervised for b in micro), sum(int(b.attention_mask.sum()) for b in micro),
                           sum(len(b.sample_ids) for b in micro), sum(b.input_ids.numel() for b in micro)],
                          dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    n_global, tokens_global, samples_global = int(counts[0]), int(counts[1]), int(counts[2])
    sync_keys = sorted(plans[0].sync_max) if plans else []
    if sync_keys:  # e.g. K_max: every rank must call the shared core equally often
        sync = torch.tensor([[p.sync_max[k] for k in sync_keys] for p in plans], dtype=torch.int64, device=device)
        dist.all_reduce(sync, op=dist.ReduceOp.MAX)
        for p, row in zip(plans, sync.tolist()):
            p.sync_max = dict(zip(sync_keys, row))
    rec = {"supervised_tokens": n_global, "tokens": tokens_global, "samples": samples_global,
           "tokens_computed": int(counts[3]), "skipped": int(n_global == 0)}
    if n_global == 0:  # an update needs a positive token count (A.2); skip it rather than divide by zero
        rec.update(loss=float("nan"), grad_norm=0.0)  # the trainer sets each step's lr itself: nothing to advance
        return rec
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    stats, totals = {}, {}
    for i, (batch, p) in enumerate(zip(micro, plans)):
        out = family.loss(engine, batch.to(device), cfg, p)
        engine.backward(out.sum_loss * (world / n_global), scale_wrt_gas=False)
        engine.step()
        if between is not None:
            between(i + 1, len(micro))
        loss_sum += out.sum_loss.detach().double()
        for k, (num, den) in out.stats.items():
            a, b = stats.get(k, (0.0, 0.0))
            stats[k] = (a + num, b + den)
        for k, v in out.totals.items():
            totals[k] = totals.get(k, 0.0) + v
    # Names differ between ranks (a depth drawn on one rank only): gather them so every rank reduces the same vector.
    gathered = _all_gather_object((sorted(stats), sorted(totals)))
    names = sorted(set().union(*(g[0] for g in gathered)))
    tnames = sorted(set().union(*(g[1] for g in gathered)))
    vec = torch.tensor([float(loss_sum)] + [v for k in names for v in stats.get(k, (0.0, 0.0))]
                       + [totals.get(k, 0.0) for k in tnames], dtype=torch.float64, device=device)
    dist.all_reduce(vec)
    rec.update(loss=float(vec[0]) / n_global, grad_norm=_grad_norm(engine))
    for i, k in enumerate(names):
        num, den = float(vec[1 + 2 * i]), float(vec[2 + 2 * i])
        if den:
            rec[k] = num / den
    for i, k in enumerate(tnames):
        rec[k] = float(vec[1 + 2 * len(names) + i])
    if family.derive_metrics is not None:  # metrics of the reduced step totals (e.g. routing entropy)
        rec.update(family.derive_metrics(rec))
    return rec


def _expert_parallel_size(saved_config: dict) -> int:
    """train.expert_parallel_size of a saved run config (1 for checkpoints from before the key existed)."""
    return int(saved_config.get("train", {}).get("expert_parallel_size", 1))


def _group_hypers(optimizer) -> list[dict]:
    """Each param group's hyper-parameters (all but its params), to put back after a load overwrote them."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _add_stage3_optimizer_step(zero_dir: Path):
    """ZeRO-3's universal loader reads Adam's step count from zero/optimizer_state.pt's optimizer_state_dict, which
    the conversion of a stage 1-2 checkpoint does not write (it keeps the count in every parameter's step.pt)."""
    from pipeline.checkpoint import _load_ds_file

    common = zero_dir / "optimizer_state.pt"
    sd = _load_ds_file(common)
    if "optimizer_state_dict" in sd:
        return
    step = _load_ds_file(next(zero_dir.glob("*/step.pt")))  # one count for all: every parameter steps together
    sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": sd.get("param_groups", [])}
    torch.save(sd, common)


def _all_gather_object(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _get_path(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _diff_path(a, b, key: str) -> tuple:
    """(dotted key, a's value, b's value) of the first differing leaf under ``key``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _diff_path(a.get(k), b.get(k), f"{key}.{k}")
    return key, a, b


def _first_difference(a, b, key: str) -> str:
    """'KEY: NEW differs from OLD' for the first differing leaf under ``key`` (the checkpoint's value is OLD)."""
    key, a, b = _diff_path(a, b, key)
    return f"{key}: {b!r} differs from {a!r}"


def _lost_peer(e: BaseException) -> bool:
    """Whether a collective failed because a peer is gone or silent: an error of gloo's TCP transport (connection
    reset or closed by the peer, a receive that timed out, a pair closed by the timeout) or torch's distributed
    backend and network errors (NCCL)."""
    text = str(e)
    return isinstance(e, (dist.DistBackendError, dist.DistNetworkError)) or (
        isinstance(e, RuntimeError) and ("gloo/transport" in text or "timeout caused pair closure" in text))


def _describe_save_error(e: BaseException, tag_dir: Path) -> str:
    """One line for a failed checkpoint write; a full disk says so (torch reports it as 'file write failed')."""
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    try:
        full = full or shutil.disk_usage(tag_dir.parent).free < 64 * 2**20
    except OSError:
        pass
    if full:
        return f"disk full writing checkpoint {tag_dir} ({text})"
    return f"could not write checkpoint {tag_dir} ({text})"


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m{s:02d}s" if m >= 60 else f"{m}m{s:02d}s"


def _grad_norm(engine) -> float:
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


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


def run(cfg: RunConfig, ds_config_path: str, resume: str = "auto", allow_config_change: bool = False):
    trainer = Trainer(cfg, ds_config_path, resume, allow_config_change)
    try:
        try:
            trainer.setup()
        except BaseException:
            tracker = getattr(trainer, "tracker", None)
            if tracker is not None:  # created before the failure: its MLflow run must not stay RUNNING
                tracker.finish("FAILED")
            raise
        trainer.train()
    finally:
        lock = getattr(trainer, "lock", None)
        if lock is not None:
            lock.release()
    shutdown_distributed()
    return trainer


# --------------------------------------------------------------------------------------------------------------------
# Dry run: the plan of a training, from the same checks, with nothing started
# --------------------------------------------------------------------------------------------------------------------
def dry_run(cfg: RunConfig, ds_config_path: str, resume: str = "auto", allow_config_change: bool = False,
            world_size: int = 1, local_world_size: int | None = None, origin: str = "") -> str:
    """What a training of ``cfg`` on ``world_size`` ranks, ``local_world_size`` per node, would do, as text.

    It resolves the inputs with the training's own code: ``Trainer.__init__`` (batch arithmetic, ds_config, resume
    point and its config, EP layout, data against the model, shards against streams) and rank 0's loader dataset
    (``build_dataset``: the loader's own checks). So every error a training raises before DeepSpeed starts is raised
    here too, the same one line. Nothing is started (no process group, no DeepSpeed engine) and nothing is written:
    not even the run directory. ``origin`` says where the world size came from (flags or the launcher's env).
    """
    local = local_world_size or world_size
    if world_size < 1 or local < 1 or world_size % local:
        raise ConfigError(f"world size {world_size} does not split into nodes of {local} ranks "
                          "(--world-size, --nproc-per-node, or the launcher's WORLD_SIZE and LOCAL_WORLD_SIZE)")
    trainer = Trainer(cfg, ds_config_path, resume, allow_config_change, world_size=world_size)
    try:
        dataset = trainer.build_dataset(rank=0)  # stream g's shards do not depend on the rank reading it
    except ValueError as e:  # the loader's own input checks (workers, windows, cluster sampling): one line
        raise ConfigError(str(e).splitlines()[0]) from None
    run_dir, nodes = trainer.run_dir, world_size // local
    lines = ["dry run: resolved without starting anything; nothing was written",
             f"run_dir: {run_dir} ({'exists' if run_dir.exists() else 'not created yet'})",
             f"world: {world_size} ranks = {nodes} node{'s' if nodes > 1 else ''} x {local} ranks per node"
             + (f" ({origin})" if origin else "") + (f"; rank r runs on node r // {local}" if nodes > 1 else ""),
             *_plan_batch(cfg, world_size), _plan_budget(cfg, trainer.dataset_samples), *_plan_resume(trainer)]
    if cfg.train.expert_parallel_size > 1:
        lines += _plan_expert_parallel(cfg, world_size, local, trainer.moe_backend)
    elif getattr(cfg.model, "moe_layers", None):
        lines.append(f"experts: every rank holds all {cfg.model.num_experts} experts (train.expert_parallel_size 1), "
                     f"moe backend {trainer.moe_backend}")
    lines.append(f"ds_config: {trainer.ds_config_path} resolved for {world_size} ranks (ZeRO stage "
                 f"{trainer.zero_stage}, {'bf16' if trainer.dtype == torch.bfloat16 else 'fp32'}):")
    lines.append(json.dumps(trainer.ds_config, indent=1))
    lines += _plan_data(trainer, dataset, local)
    return "\n".join(lines)


def _plan_batch(cfg: RunConfig, world: int) -> list[str]:
    t, d = cfg.train, cfg.data
    accum = f"grad_accum_steps {t.grad_accum_steps} x {world} ranks"
    supervised = "  supervised tokens per step: data-dependent (lengths, masking); counted and all-reduced every step"
    if t.max_tokens_per_microbatch:
        budget = t.max_tokens_per_microbatch * t.grad_accum_steps * world
        return [f"batch: token budget train.max_tokens_per_microbatch {t.max_tokens_per_microbatch} per microbatch "
                f"(sequences x longest) x {accum} = at most {budget} padded tokens per optimizer step; the sequences "
                "per microbatch depend on their lengths (train.micro_batch_size is not used by the loader)", supervised]
    rows = t.micro_batch_size * t.grad_accum_steps * world
    agreed = " (= train.global_batch_size)" if t.global_batch_size is not None else ""
    kind = "rows of packed documents" if d.pack else "sequences"
    return [f"batch: micro_batch_size {t.micro_batch_size} x {accum} = global batch {rows} {kind} per optimizer "
            f"step{agreed}",
            f"  tokens per step: at most {rows} x data.context_length {d.context_length} = "
            f"{rows * d.context_length}" + ("" if d.pack else " (each microbatch padded to its longest sequence)"),
            supervised]


def _plan_budget(cfg: RunConfig, dataset_samples: int) -> str:
    t = cfg.train
    parts = [f"train.max_steps {t.max_steps}"]
    if t.max_words is not None:
        parts.append(f"train.max_words {t.max_words}")
    if t.max_epochs is not None:
        parts.append(f"train.max_epochs {t.max_epochs:g} (= {t.max_epochs * dataset_samples:.0f} samples)")
    if t.max_hours is not None:
        parts.append(f"train.max_hours {t.max_hours:g} per attempt")
    return f"budget: stops at the first of {', '.join(parts)}" if len(parts) > 1 else f"budget: {parts[0]}"


def _plan_resume(trainer: Trainer) -> list[str]:
    ckpt = trainer.ckpt_dir
    if trainer.resume_tag:
        saved = read_client_state(ckpt / trainer.resume_tag)
        how = {None: "on its own layout",
               "universal": f"through DeepSpeed's universal checkpoint (rank 0 converts it into "
                            f"{trainer.run_dir / 'universal' / trainer.resume_tag} first)",
               "consolidated": "through the consolidated expert-parallel path"}[trainer.reshard]
        lines = [f"resume: from {ckpt / trainer.resume_tag} (step {saved.get('step')}, written by "
                 f"{saved.get('world_size')} ranks under ZeRO stage {saved.get('zero_stage', 0)}), {how}"]
        if trainer.resume != "auto" and read_latest_tag(ckpt) != trainer.resume_tag:
            lines.append(f"  a rollback: the checkpoints after {trainer.resume_tag} would move to "
                         f"{ckpt}/abandoned_after_{trainer.resume_tag}_TIME/")
        if trainer.resume_note:
            lines.append(f"  note: {trainer.resume_note}")
        if trainer.cfg.train.init_from:
            lines.append("  train.init_from is not read: the run has checkpoints of its own")
        if trainer.resumed_loader is not None:
            lines.append(f"  the loader continues every stream where the checkpoint left it (each rank has consumed "
                         f"{trainer.resumed_loader[0]['batches_consumed']} microbatches)")
        return lines
    if trainer.init_source is not None:
        what = "weights and AdamW moments" if trainer.cfg.train.init_from_optimizer else "weights"
        return [f"resume: none; a new run starting from the {what} of {trainer.init_source} (train.init_from)"]
    why = "--resume never" if trainer.resume == "never" else f"no checkpoint in {ckpt}"
    return [f"resume: none; a fresh start ({why})"]


def _plan_expert_parallel(cfg: RunConfig, world: int, local: int, backend: str) -> list[str]:
    """DeepSpeed's groups for EP size ep (utils/groups.py ``_create_expert_and_data_parallel``, no model or pipeline
    parallelism): EP groups of consecutive ranks, expert-data-parallel groups of the ranks with equal rank % ep."""
    ep, experts = cfg.train.expert_parallel_size, cfg.model.num_experts
    per = experts // ep
    where = ("each EP group inside one node" if local % ep == 0 else
             "EP groups span nodes: every MoE layer's all-to-all crosses the network")
    return [f"expert parallel: {EP_KEY} {ep} over {world} ranks, moe backend {backend}: {world // ep} EP groups of "
            f"consecutive ranks (all-to-all: ranks {ep}g .. {ep}g+{ep - 1}), {where}",
            f"  experts ({per} of {experts} per rank): "
            + "; ".join(f"r % {ep} = {e}: {e * per}" + (f"-{e * per + per - 1}" if per > 1 else "") for e in range(ep))
            + f"; ZeRO reduces and partitions them over the {world // ep} ranks with the same r % {ep}"]


def _plan_data(trainer: Trainer, dataset: ShardStream, local: int) -> list[str]:
    """The stream layout and, per source, the shards every rank's streams read in epoch 0 (module docstring of
    pipeline/data/loader.py, "Streams"), one line per rank, and how evenly the samples fall on the ranks."""
    layout, d = trainer.loader_layout, trainer.cfg.data
    origin = ("kept from the checkpoint" if trainer.resumed_loader is not None else
              "data.loader_streams" if d.loader_streams else
              f"default: {layout.world_size} ranks x max(1, data.num_workers {d.num_workers})")
    readers = (f"{d.num_workers} workers per rank (worker p reads streams p, p + {d.num_workers}, ...)"
               if d.num_workers else "read by the rank itself")
    share = ("rank r reads stream r" if layout.local == 1 else
             f"rank r reads streams {layout.local}r .. {layout.local}r+{layout.local - 1}")
    lines = [f"data: {layout.streams} loader streams ({origin}): {share}, {readers}; shards per stream in epoch 0:"]
    keys = [key for key, _ in trainer._shard_specs()]
    for key, src in zip(keys, dataset.sources):
        counts = src.counts
        prefix, suffix, short = _compact_names([sh.name for sh in src.shards])
        lines.append(f"source {src.name} ({key} = {src.spec}): {len(counts)} shards, {int(counts.sum())} samples"
                     + (f"; shard names {prefix}*{suffix}, * below" if prefix or suffix else ""))
        per_rank = []
        for r in range(layout.world_size):
            parts, total = [], 0
            for g in range(r * layout.local, (r + 1) * layout.local):
                ids = src.stream_shards(g, 0)
                total += int(counts[ids].sum())
                parts.append(f"stream {g} [{' '.join(short[i] for i in ids)}]")
            per_rank.append(total)
            lines.append(f"  rank {r} (node {r // local}): {', '.join(parts)}: {total} samples")
        lo, hi = min(per_rank), max(per_rank)
        lines.append(f"  samples per rank in epoch 0: min {lo} (rank {per_rank.index(lo)}), max {hi} "
                     f"(rank {per_rank.index(hi)}), max/min {hi / lo if lo else float('inf'):.2f}")
    if len(keys) > 1:
        lines.append("  (a mixture draws each sample's source by the schedule's weights; every source continues "
                     "into its next epoch independently)")
    return lines


def _compact_names(names: list[str]) -> tuple[str, str, list[str]]:
    """(common prefix, common suffix, what differs) of shard names, cut at digit boundaries so a shard number stays
    whole: rnacentral-000003.tar -> ("rnacentral-", ".tar", "000003"). No common part: ("", "", the names)."""
    if len(names) < 2:
        return "", "", list(names)
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[::-1] for n in names])[::-1]
    prefix = prefix.rstrip("0123456789")
    suffix = suffix.lstrip("0123456789")
    shortest = min(len(n) for n in names)
    if len(prefix) + len(suffix) >= shortest:
        return "", "", list(names)
    return prefix, suffix, [n[len(prefix):len(n) - len(suffix)] for n in names]
