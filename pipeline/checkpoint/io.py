"""Writing a training's checkpoints and loading them back into a DeepSpeed engine.

``TrainState`` is what a checkpoint stores about the run besides weights and optimizer (client_state.json);
``Checkpointer`` writes checkpoints in the order that keeps ``latest`` on a complete one (docs/checkpoints.md),
loads them on the same or another layout (DeepSpeed's own load, its universal checkpoint, or the consolidated path
for expert parallelism), and prepares the run directory for an attempt (rollback, config files, logs).

Collectives (every rank, in this order): ``save``: an all-gather of the loader states, the non-finite check's
all-gather, a barrier, DeepSpeed's save, an all-gather of the failures, and for a synchronous save a broadcast of rank
0's outcome (a background save's writer threads agree over a gloo group of their own, never in the main thread's
order); ``load`` with a universal conversion: a broadcast of rank 0's outcome. ``Checkpointer()`` with
checkpoint.background makes that group (a collective).
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.checkpoint.background import BackgroundWriter, Capture, HostPool, SaveJob
from pipeline.checkpoint.layout import (BEST, CHECKPOINT_FORMAT, COMPLETE, LATEST, checkpoint_tags, mark_complete,
                                        read_latest, rotate, set_aside_later_checkpoints, tag_step, write_atomic)
from pipeline.checkpoint.read import (EXPERT_KEY, is_foreign_checkpoint, load_ds_file, read_client_state,
                                      weights_only_loads, zero12_optimizer_state)
from pipeline.checkpoint.resume import expert_parallel_size, resumed_horizon
from pipeline.config import ConfigError, RunConfig, dump_yaml
from pipeline.distributed import all_gather_object, broadcast_object
from pipeline.tracking.journal import resolve_run_id


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, ...); ``latest`` still names the previous one."""


@dataclass
class TrainState:
    """The run's position and running totals: what a checkpoint's client state holds besides its layout."""
    step: int = 0  # optimizer steps done
    batches_consumed: int = 0  # microbatches this rank has read
    cumulative: dict = field(default_factory=dict)  # totals over the whole run, all ranks (tokens, words, FLOPs...)
    best: tuple | None = None  # (loss, step) of the lowest finite logged training loss
    val_best: tuple | None = None  # (value, step) of the best checkpoint.keep_best validation metric
    horizon: dict | None = None  # what the lr schedule decays over (pipeline/train/optim.py, schedule_horizon)
    init_from: str | None = None  # the checkpoint this run started from (train.init_from), kept on resume
    last_loss: float = math.nan  # this attempt's last step (not saved)

    def client(self) -> dict:
        return {"step": self.step, "batches_consumed": self.batches_consumed, "cumulative": self.cumulative,
                "schedule": self.horizon, "best": list(self.best) if self.best else None,
                "val_best": list(self.val_best) if self.val_best else None, "init_from": self.init_from}

    def restore(self, client: dict):
        """From a (migrated) client state."""
        self.step, self.batches_consumed = client["step"], client["batches_consumed"]
        self.cumulative = dict(client["cumulative"])
        self.best = tuple(client["best"]) if client["best"] else None
        self.val_best = tuple(client["val_best"]) if client["val_best"] else None
        self.init_from = client["init_from"]


def tag_of(step: int) -> str:
    return f"step{step:08d}"


class Checkpointer:
    """A training's checkpoints in ``run_dir/checkpoints``, for DeepSpeed ``engine`` and its ZeRO ``optimizer``.

    With ``checkpoint.background`` (the default) a save copies the step's state to host memory and returns; a writer
    thread writes, digests and completes it (pipeline/checkpoint/background.py), at most one save in flight: the
    next save, ``wait`` and ``latest`` first wait for it. Created on every rank in the same order (its writer group
    is a collective)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, engine, optimizer, ds_config: dict, rank: int, world: int,
                 trusted: bool = False, data_fingerprint: dict | None = None):
        self.cfg, self.run_dir, self.ckpt_dir = cfg, run_dir, run_dir / "checkpoints"
        self.trusted = trusted  # --trust-checkpoint: DeepSpeed's loads may unpickle anything (weights_only_loads)
        self.data_fingerprint = data_fingerprint  # {config key: manifest digest and counts}: resume checks it
        self.engine, self.optimizer = engine, optimizer
        self.zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        self.ds_config, self.rank, self.world = ds_config, rank, world
        self.universal_dir = None  # set while this attempt runs from a universal conversion (removed at next save)
        self.last_saved = None  # the tag this attempt last wrote whole
        self.stalls: list[tuple[str, float]] = []  # (tag, seconds the step waited for its save), this attempt
        self.background = cfg.checkpoint.background
        self.writer = None
        if self.background:
            # The writer threads agree over a gloo group of their own: the main thread's collectives (the training's
            # group, NCCL on GPUs) go on meanwhile, and a collective of another thread must never interleave with
            # them. new_group is itself a collective: every rank builds its Checkpointer at the same point of setup.
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.train.collective_timeout)) \
                if world > 1 else None
            self.writer = BackgroundWriter(rank, group, _describe_save_error)
            self.pool = HostPool()

    # -- saving -----------------------------------------------------------------------------------------------------
    def save(self, state: TrainState, loader_state: dict, tracker, milestone: bool = False, best: bool = False):
        """Checkpoint ``state.step``; ``milestone`` checkpoints (checkpoint.at_steps / at_words) survive keep_last;
        ``best``: this step is the best by checkpoint.keep_best, ``best`` names it (and rotation keeps it).

        Order: every rank's shards, then (rank 0) client_state.json and config.yaml, then SHA256SUMS and the COMPLETE
        marker, then ``latest`` (and ``best``), then rotation. A failure at any point leaves ``latest`` on the
        previous complete checkpoint. In the background the same order is kept by the writer thread, after the state
        was copied to host memory here; a failure of that write is raised by the next save or ``wait``.
        """
        started = time.perf_counter()
        self.wait()  # at most one save in flight: the previous one is complete (or failed, raised) before this one
        tag = tag_of(state.step)
        tag_dir = self.ckpt_dir / tag
        # DeepSpeed stores client_state from rank 0 only, and every rank's loader is somewhere else: gather them.
        loader = all_gather_object(loader_state)
        client = {"format": CHECKPOINT_FORMAT, **state.client(), "world_size": self.world,
                  "zero_stage": self.zero_stage, "loader": loader, "mlflow_run_id": tracker.run_id,
                  "mlflow_tracking_uri": tracker.uri, "milestone": milestone, "config": self.cfg.to_dict(),
                  "data_fingerprint": self.data_fingerprint}
        # A checkpoint is the last good state of a run: never one whose weights are NaN or inf. A background save
        # checks its host copy in the writer thread (BackgroundWriter: the check was most of the step's wait, 0.4-1.3
        # s of 80 M weights on the loaded 2-core host), before it writes anything.
        bad = None if self.background else self.nonfinite_weight()
        if bad:
            raise CheckpointWriteError(f"step {state.step}: the weights hold non-finite values ({bad}) though the "
                                       f"step's loss and gradient norm were finite; {tag} is not written and "
                                       f"{LATEST} still names {self.latest('no checkpoint')}")
        if self.rank == 0 and tag_dir.is_symlink():  # refused at start (layout.check_no_links); made since:
            tag_dir.unlink()  # the link goes, never what it points to
        elif self.rank == 0 and tag_dir.exists():
            # The same tag from an abandoned timeline (after a rollback) or a save that died: never let its old
            # COMPLETE marker vouch for the files about to be rewritten.
            shutil.rmtree(tag_dir)
        dist.barrier()
        if self.background:
            self._save_background(tag_dir, client, best, started)
        else:
            self._save_now(tag_dir, client, best)
            self.stalls.append((tag, time.perf_counter() - started))
            if self.rank == 0:
                print(f"checkpoint {tag}: written in {self.stalls[-1][1]:.2f} s (the step waited for all of it)",
                      flush=True)

    def _save_now(self, tag_dir: Path, client: dict, best: bool):
        """The synchronous save: DeepSpeed writes, rank 0 completes, every rank learns the outcome."""
        tag = tag_dir.name
        try:
            # save_latest=False: DeepSpeed writes 'latest' on rank 0 before the other ranks finish their shards; we
            # write it after save_checkpoint's closing barrier, atomically, so 'latest' only names a whole one.
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False)
            failed = None
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather below to agree on the outcome
            failed = _describe_save_error(e, tag_dir)
        failures = [f for f in all_gather_object(failed) if f]
        if failures:
            raise CheckpointWriteError(f"{failures[0]}; {LATEST} still names {self.latest('no checkpoint')}")
        failed = None
        if self.rank == 0:
            try:
                self._complete(tag_dir, json.dumps(client, indent=1), dump_yaml(self.cfg), best)
            except OSError as e:
                failed = _describe_save_error(e, tag_dir)
        failed = broadcast_object(failed)
        if failed:
            raise CheckpointWriteError(f"{failed}; {LATEST} still names {self.latest('no checkpoint')}")
        self.last_saved = tag

    def _complete(self, tag_dir: Path, client_text: str, config_text: str, best: bool, known: dict | None = None,
                  fault=lambda name: None):
        """Rank 0, once every rank's files are whole: client_state.json, config.yaml, SHA256SUMS and COMPLETE,
        ``latest``, ``best``, rotation, and the universal conversion this attempt ran from goes. ``known``: the
        digests of the files the background writer wrote; ``fault``: its fault points."""
        tag = tag_dir.name
        write_atomic(tag_dir / "client_state.json", client_text)
        fault("client_state.json")
        write_atomic(tag_dir / "config.yaml", config_text)
        fault("config.yaml")
        mark_complete(tag_dir, known, fault)
        fault(COMPLETE)
        write_atomic(self.ckpt_dir / LATEST, tag)
        fault(LATEST)
        if best:
            write_atomic(self.ckpt_dir / BEST, tag)
            fault(BEST)
        rotate(self.ckpt_dir, self.cfg.checkpoint.keep_last, tag)
        fault("rotation")
        if self.universal_dir is not None:  # this run's own checkpoint is the resume point now
            shutil.rmtree(self.universal_dir.parent, ignore_errors=True)
            self.universal_dir = None

    def _save_background(self, tag_dir: Path, client: dict, best: bool, started: float):
        """DeepSpeed's save_checkpoint with its checkpoint engine swapped for ``Capture``: the step's state is copied
        to host memory (its collectives and barriers as in a synchronous save), then the writer thread writes it."""
        tag = tag_dir.name
        own = self.engine.checkpoint_engine
        capture = Capture(self.pool)
        self.engine.checkpoint_engine = capture
        try:
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False)
            capture.settle()
            failed = None
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather below to agree on the outcome
            failed = _describe_save_error(e, tag_dir)
        finally:
            self.engine.checkpoint_engine = own
        failures = [f for f in all_gather_object(failed) if f]
        if failures:
            raise CheckpointWriteError(f"{failures[0]}; {LATEST} still names {self.latest('no checkpoint')}")
        client_text, config_text = json.dumps(client, indent=1), dump_yaml(self.cfg)  # now: the run goes on

        stall = time.perf_counter() - started

        def finish(digests: dict, fault):  # rank 0's writer thread, once every rank's files are whole
            self._complete(tag_dir, client_text, config_text, best, digests, fault)
            self.last_saved = tag
            print(f"checkpoint {tag}: the step waited {stall:.2f} s (its state copied to host memory); written, "
                  f"digested and completed in the background in {time.perf_counter() - started - stall:.2f} s",
                  flush=True)

        self.stalls.append((tag, stall))
        self.writer.start(SaveJob(tag_dir, capture.files, getattr(own, "zipfile_serialization", True), stall,
                                  finish if self.rank == 0 else None))

    def wait(self):
        """The save in flight, complete: returns once it is (at once without one); CheckpointWriteError, on every
        rank, when it failed (``latest`` still names the checkpoint before it)."""
        failed = self.settle()
        if failed:
            raise CheckpointWriteError(f"{failed}; {LATEST} still names {self.latest('no checkpoint')}")

    def settle(self) -> str | None:
        """Wait for the save in flight, whatever its outcome; its error line when it failed (said once), else None.
        Every rank's writer learns the same outcome, so the ranks raise at the same save."""
        if self.writer is None or not self.writer.in_flight:
            return None
        outcome = self.writer.join()
        if outcome[0] == "ok":
            self.last_saved = outcome[1]
            return None
        return outcome[1]

    def latest(self, default: str = "none") -> str:
        """The tag ``latest`` names (``default`` when none), once the save in flight has ended: the checkpoint a
        message about the run's end can send the user to."""
        failed = self.settle()
        if failed and self.rank == 0:
            print(f"warning: {failed}", flush=True)
        return read_latest(self.ckpt_dir) or default

    def nonfinite_weight(self) -> str | None:
        """The first parameter holding a NaN or inf on any rank (ZeRO-3: each rank checks its partition), or None.
        One pass over the weights and one gather, at a save or a resume only."""
        params = [(n, getattr(p, "ds_tensor", p)) for n, p in self.engine.module.named_parameters()]
        # A sum holding a NaN or an inf is not finite, and the sums are one read of the weights (isfinite(t).all()
        # made a mask of every weight: 0.34 s against 0.02 s for 94 M weights, in the step a save stalls); only a
        # sum that is not finite is checked element by element, since finite weights can overflow a sum.
        sums = torch.isfinite(torch.stack([t.detach().sum(dtype=torch.float32) for _, t in params])).tolist() \
            if params else []
        finite = [ok or bool(torch.isfinite(t).all()) for (_, t), ok in zip(params, sums)]
        mine = next((n for (n, _), ok in zip(params, finite) if not ok), None)
        return next((n for n in all_gather_object(mine) if n), None)

    # -- loading ----------------------------------------------------------------------------------------------------
    def load(self, tag: str, reshard: str | None, state: TrainState) -> dict:
        """Resume from ``tag`` (on its own layout, or ``reshard`` "universal" / "consolidated",
        pipeline/checkpoint/resume.py check_reshard) into the engine and ``state``; returns the client state."""
        saved = read_client_state(self.ckpt_dir / tag)
        if reshard == "consolidated":
            self._load_consolidated(tag, saved)
        else:
            self._load_deepspeed(tag, saved, reshard)
        bad = self.nonfinite_weight()
        if bad:  # written before the save-time check, or by other code: training on would only spread the NaN
            earlier = [t for t in checkpoint_tags(self.ckpt_dir) if tag_step(t) < tag_step(tag)]
            raise ConfigError(f"checkpoint {self.ckpt_dir / tag} holds non-finite weights ({bad}); it cannot be "
                              "resumed. " + (f"Resume from an earlier one (--resume {self.ckpt_dir / earlier[-1]})"
                                             if earlier else "No earlier checkpoint is left: use another run_dir"))
        state.restore(saved)
        state.horizon = resumed_horizon(saved, self.cfg, announce=self.rank == 0)
        if self.rank == 0:
            saved_ep, ep = expert_parallel_size(saved["config"]), self.cfg.train.expert_parallel_size
            with_ep = max(saved_ep, ep) > 1
            moved = (f" (written by {saved['world_size']} ranks under ZeRO stage {saved['zero_stage']}"
                     + (f" with EP {saved_ep}" if with_ep else "")
                     + f", continued on {self.world} under stage {self.zero_stage}"
                     + (f" with EP {ep}" if with_ep else "") + ")" if reshard else "")
            print(f"resumed from {self.ckpt_dir / tag} at step {state.step}{moved}", flush=True)
        return saved

    def _load_consolidated(self, tag: str, saved: dict):
        """Continue an expert-parallel checkpoint on another world size, ZeRO stage (1-2) or EP size: the full fp32
        master and Adam moments of every parameter, read from the ZeRO-1/2 shards in the single-process names
        (pipeline.checkpoint.read.zero12_optimizer_state: experts under their global ids), are set into this
        engine's partitions with DeepSpeed's tensor-fragment API, each local expert from its global id. DeepSpeed's
        universal checkpoint does not place this project's experts (it writes them under their local names)."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # needs the engine

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
            m = EXPERT_KEY.match(name)
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

    def _load_deepspeed(self, tag: str, saved: dict, reshard: str | None):
        """DeepSpeed's own load: the checkpoint as written, or its universal form on another world size or stage."""
        load_dir = self._universal_checkpoint(tag, saved) if reshard == "universal" else self.ckpt_dir
        hyper = _group_hypers(self.optimizer)
        with weights_only_loads(self.trusted):
            path, _ = self.engine.load_checkpoint(str(load_dir), tag=tag, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {load_dir / tag}")
        if reshard:
            # ZeRO-3's universal load gives every param group the first one's hyper-parameters (weight decay on the
            # gains too) and every parameter one shared step tensor, which AdamW would then advance once per group
            for group, h in zip(self.optimizer.param_groups, hyper):
                group.update(h)
            for st in getattr(self.optimizer, "optimizer", self.optimizer).state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].clone()

    def load_init_optimizer(self, src: Path):
        """Weights and AdamW moments of another run's DeepSpeed checkpoint; this run's hyper-parameters and schedule.

        DeepSpeed restores the source's param-group hyper-parameters (its lr, betas, weight decay) along with the
        moments, and its step counters: put this run's back, so the first step's lr is this run's schedule at 0.
        """
        ours = _group_hypers(self.optimizer)
        with weights_only_loads(self.trusted):
            path, _ = self.engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                                  load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {src}")
        for group, hyper in zip(self.optimizer.param_groups, ours):
            group.update(hyper)
        self.engine.global_steps = self.engine.global_samples = self.engine.skipped_steps = 0

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
                  f"{saved['zero_stage']}) to a universal checkpoint in {out}", flush=True)
            # DeepSpeed's converter, its torch.loads under weights_only_loads (pipeline/checkpoint/universal.py)
            cmd = [sys.executable, "-m", "pipeline.checkpoint.universal", *(["--trusted"] if self.trusted else []),
                   "--input_folder",
                   str(self.ckpt_dir / tag), "--output_folder", str(tmp), "--num_extract_workers", "1",
                   "--num_merge_workers", "1", "--inject_missing_state"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=_with_repo_on_path())
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
                failed = (f"checkpoint {self.ckpt_dir / tag}: DeepSpeed's ds_to_universal failed "
                          f"({lines[-1]}); it continues on {saved['world_size']} ranks under ZeRO stage "
                          f"{saved['zero_stage']}")
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

    # -- the run directory ------------------------------------------------------------------------------------------
    def prepare_run_dir(self, resume_tag: str | None, state: TrainState):
        """Rank 0, before the attempt's first step: a rollback sets the later checkpoints aside, the resolved
        config and ds_config are written, and the logs are cut back to the resume point."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_tag and read_latest(self.ckpt_dir) != resume_tag:
            # A rollback (--resume of an older tag) or a fallback past an incomplete latest: this is the timeline
            # now, and a crash before the next save must come back here.
            aside = set_aside_later_checkpoints(self.ckpt_dir, resume_tag)
            if aside:
                print(f"note: the checkpoints after {resume_tag} were moved to {aside}", flush=True)
                self._repoint_best(state.val_best)
            write_atomic(self.ckpt_dir / LATEST, resume_tag)
        write_atomic(self.run_dir / "config.yaml", dump_yaml(self.cfg))
        write_atomic(self.run_dir / "ds_config.json", json.dumps(self.ds_config, indent=1))
        self._truncate_logs(resume_tag, state.step)

    def _repoint_best(self, val_best: tuple | None):
        """After a rollback: ``best`` names the resumed timeline's best checkpoint (client_state val_best), or
        nothing when that one is gone."""
        best = read_latest(self.ckpt_dir, BEST)
        if best is None or (self.ckpt_dir / best).is_dir():
            return
        tag = tag_of(val_best[1]) if val_best else None
        if tag and (self.ckpt_dir / tag).is_dir():
            write_atomic(self.ckpt_dir / BEST, tag)
        else:
            (self.ckpt_dir / BEST).unlink()

    def _truncate_logs(self, resume_tag: str | None, step: int):
        """Drop log lines of steps after the resume point (a killed run may have logged past its last checkpoint).
        A fresh start truncates nothing: logs left by a start that stopped before its first checkpoint are moved to
        RUN_DIR/earlier-start-N/."""
        logs = [f for f in [self.run_dir / "metrics.jsonl", *self.run_dir.glob("samples-rank*.jsonl")] if f.is_file()]
        if not resume_tag and any(f.stat().st_size for f in logs):
            aside = next(d for i in range(1, 10**6) if not (d := self.run_dir / f"earlier-start-{i}").exists())
            aside.mkdir()
            for f in logs:
                f.rename(aside / f.name)
            print(f"note: the logs of an earlier start without checkpoints were moved to {aside}", flush=True)
            return
        for f in logs:
            keep = [ln for ln in f.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            write_atomic(f, "".join(ln + "\n" for ln in keep))


def parent_tags(src: Path, init_from_optimizer: bool) -> dict:
    """MLflow tags linking a run to the checkpoint or export ``src`` it started from."""
    if is_foreign_checkpoint(src):
        return {"parent_checkpoint": str(src.resolve()), "init_from_optimizer": "False"}
    client = read_client_state(src)
    tags = {"parent_checkpoint": str(src.resolve()), "init_from_optimizer": str(init_from_optimizer)}
    if client.get("mlflow_run_id"):  # a run started offline holds 'pending:<key>' until its journal knows more
        client["mlflow_run_id"] = resolve_run_id(src.parent.parent, client["mlflow_run_id"],
                                                 client.get("mlflow_tracking_uri")) or client["mlflow_run_id"]
    for key, name in (("mlflow_run_id", "parent_run_id"), ("mlflow_tracking_uri", "parent_tracking_uri"),
                      ("step", "parent_step"), ("source", "parent_export_source")):
        if client.get(key) is not None:
            tags[name] = str(client[key])
    return tags


def _with_repo_on_path() -> dict:
    """This process's environment with the directory holding ``pipeline`` first on PYTHONPATH, for a ``python -m
    pipeline...`` child wherever the run was started from."""
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def _group_hypers(optimizer) -> list[dict]:
    """Each param group's hyper-parameters (all but its params), to put back after a load overwrote them."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _add_stage3_optimizer_step(zero_dir: Path):
    """ZeRO-3's universal loader reads Adam's step count from zero/optimizer_state.pt's optimizer_state_dict, which
    the conversion of a stage 1-2 checkpoint does not write (it keeps the count in every parameter's step.pt)."""
    common = zero_dir / "optimizer_state.pt"
    sd = load_ds_file(common)
    if "optimizer_state_dict" in sd:
        return
    step = load_ds_file(next(zero_dir.glob("*/step.pt")))  # one count for all: every parameter steps together
    sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": sd.get("param_groups", [])}
    torch.save(sd, common)


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
