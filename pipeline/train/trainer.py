"""The Trainer: ``setup()`` starts the process group, builds the model and its DeepSpeed engine, continues the run's
checkpoint (or starts from train.init_from) and opens the loader; ``fit()`` takes steps and hands every side effect
to its callbacks (pipeline/train/callbacks.py, where the order of the collectives is written down).

    plan = RunPlan(cfg, ds_config)            what would fail at start fails here, nothing started (dry run)
    trainer = Trainer(cfg, ds_config)         a RunPlan and the callbacks
    trainer.setup(); trainer.fit()
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

from pipeline.checkpoint.io import Checkpointer, CheckpointWriteError, TrainState, parent_tags
from pipeline.checkpoint.layout import RunDirLock
from pipeline.checkpoint.read import load_state_dict, load_weights_into
from pipeline.config import ConfigError, RunConfig
from pipeline.data.loader import make_loader
from pipeline.data.remote import FetchError
from pipeline.distributed import (all_gather_object, broadcast_object, init_distributed, lost_peer,
                                  set_collective_timeout, shutdown_distributed)
from pipeline.parallel import optimizer_groups, parallelize
from pipeline.run_log import current as current_run_log
from pipeline.tracking.tracker import Tracker
from pipeline.train.callbacks import Callback, default_callbacks
from pipeline.train.memory import claim_device
from pipeline.train.optim import lean_overflow_check, lr_factor, make_optimizer, param_groups, schedule_horizon
from pipeline.train.plan import RunPlan
from pipeline.train.resolved import line as resolved_line, resolved_settings
from pipeline.train.ranks import check_ranks_agree
from pipeline.train.step import train_step
from pipeline.train.stop import LoaderFailed, MidStep, StopMidStep, StopRequest, TrainingStopped, peer_lost

# Running totals over the whole run (all ranks), logged as total/<name>
CUMULATIVE = ("samples", "tokens", "supervised_tokens", "words", "flops", "row_iterations", "skipped", "nonfinite")


class Trainer:
    def __init__(self, cfg: RunConfig, ds_config_path: str, resume: str = "auto", allow_config_change: bool = False,
                 callbacks: list[Callback] | None = None, *, trust_checkpoint: bool = False,
                 allow_data_change: bool = False):
        """Resolve and check every input (RunPlan); ``callbacks`` run after the default ones."""
        self.plan = RunPlan(cfg, ds_config_path, resume, allow_config_change, trust_checkpoint=trust_checkpoint,
                            allow_data_change=allow_data_change)
        # the plan's config: train.max_tokens_per_microbatch: auto resolved (pipeline/train/memory.py)
        self.cfg, self.family, self.run_dir = self.plan.cfg, self.plan.family, self.plan.run_dir
        self.callbacks = default_callbacks(self.cfg, remote=self.plan.cache is not None) + list(callbacks or [])
        self.state = TrainState(init_from=str(self.plan.init_source.resolve()) if self.plan.init_source else None)

    # -- setup ------------------------------------------------------------------------------------------------------
    def setup(self):
        import deepspeed  # imported here so config errors surface without DeepSpeed's start-up cost

        plan = self.plan
        init_distributed(self.cfg.train.collective_timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._lock_run_dir()
        check_ranks_agree(plan, self.rank)  # before any rank writes into run_dir
        log = current_run_log()
        if log is not None:
            log.attach(self.run_dir, fresh_errors=self.rank == 0)
        dist.barrier()  # rank 0 has cleared the last attempt's errors before any rank can record one
        if self.rank == 0 and plan.resume_note:
            print(f"note: {plan.resume_note}", flush=True)
        if self.rank == 0 and plan.data_changed:
            print(f"note: {plan.data_changed}", flush=True)
        for change in plan.config_changes if self.rank == 0 else ():
            print(f"warning: config changed since checkpoint {plan.resume_tag} (--allow-config-change): {change}",
                  flush=True)
        for w in plan.warnings if self.rank == 0 else ():
            print(f"warning: {w}", flush=True)
        self.stop = StopRequest(self.cfg.train.max_hours)
        self.stop.install()
        self.device = claim_device(self.world)
        self.mid_step = MidStep(self.stop, self.cfg.train.heartbeat_seconds, self.rank, self.device)

        torch.manual_seed(self.cfg.seed)  # identical initial weights on every rank
        model = self.family.build_model(self.cfg.model)
        weights_only = plan.init_source is not None and not self.cfg.train.init_from_optimizer
        if weights_only:  # fp32 weights from any world size, ZeRO stage and EP size, or from an export
            state = (plan.foreign_state if plan.foreign_state is not None
                     else load_state_dict(plan.init_source, trusted=plan.trust_checkpoint))
            load_weights_into(model, state, plan.init_source)
            plan.foreign_state = None
        # The full model is built and loaded on every rank; EP then keeps this rank's experts (and MegaBlocks, on
        # CUDA, replaces the expert computation) before the optimizer sees the parameters. EP's expert parameters go
        # into DeepSpeed's MoE groups (optimizer_groups), which ZeRO partitions over the expert-data-parallel group.
        model = parallelize(model, self.cfg, plan.zero_stage, plan.dtype)
        o = self.cfg.optim
        optimizer = make_optimizer(optimizer_groups(model, param_groups(model, o)), o, self.device)
        # Each group's peak lr; set_lr puts peak * lr_factor into every group before each step.
        self.peak_lrs = [g["lr"] for g in optimizer.param_groups]
        ds_config = plan.ds_config
        if plan.reshard == "universal":  # this attempt loads DeepSpeed's universal checkpoint
            ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        lean_overflow_check(self.optimizer)  # bf16 ZeRO-1/2: one foreach norm instead of a check per gradient
        set_collective_timeout(self.cfg.train.collective_timeout)  # also on the groups DeepSpeed just made
        self.resolved = resolved_settings(self.engine.module, self.cfg, plan, self.device)
        if self.rank == 0:
            print(resolved_line(self.resolved), flush=True)
            if plan.microbatch:
                print(plan.microbatch.why, flush=True)

        self.checkpointer = Checkpointer(self.cfg, self.run_dir, self.engine, self.optimizer, plan.ds_config,
                                         self.rank, self.world, trusted=plan.trust_checkpoint,
                                         data_fingerprint=plan.data_fingerprint)
        self.state.horizon = schedule_horizon(self.cfg, plan.dataset_samples)
        run_id, parent = self._start_point(weights_only)
        if self.rank == 0:
            self.checkpointer.prepare_run_dir(plan.resume_tag, self.state)
        dist.barrier()
        self.tracker = Tracker(self.cfg, self.run_dir, self.rank, run_id,
                               self.state.step if plan.resume_tag else None, tags=parent,
                               params={f"resolved.{k}": v for k, v in self.resolved.items()})
        if not plan.resume_tag:  # a new run's config, ds_config and data as MLflow artifacts and dataset inputs
            sources = self.cfg.data.sources
            self.tracker.log_run_inputs(self.run_dir, list(zip([s.name for s in sources] or [None],
                                                               (spec for _, spec in plan.shard_specs()))),
                                        plan.val_dirs)
        self.dataset = plan.build_dataset(self.rank)
        if plan.resumed_loader is not None:  # the exact position of this rank's streams (dealt to this world size)
            self.dataset.load_state_dict(plan.resumed_loader[self.rank])
        elif self.state.batches_consumed:  # a checkpoint from before loader states (migrate.py): the count alone
            self.dataset.load_state_dict({"batches_consumed": self.state.batches_consumed})
        self.data = make_loader(self.dataset, self.cfg.data.num_workers)

    def _lock_run_dir(self):
        """One training per run directory: rank 0 takes the lock before anything is written there, and every rank
        learns the outcome, so a refused second training exits on all of its ranks at once."""
        self.lock, error = RunDirLock(self.run_dir), None
        if self.rank == 0:
            try:
                self.lock.acquire()
            except ConfigError as e:
                error = str(e)
        error = broadcast_object(error)
        if error:
            raise ConfigError(error)

    def _start_point(self, weights_only: bool) -> tuple[str | None, dict | None]:
        """Continue the run's checkpoint, or start from train.init_from: (MLflow run id to continue, parent tags)."""
        plan = self.plan
        if plan.resume_tag:
            client = self.checkpointer.load(plan.resume_tag, plan.reshard, self.state)
            return client.get("mlflow_run_id"), None
        if plan.init_source is None:
            return None, None
        if not weights_only:
            self.checkpointer.load_init_optimizer(plan.init_source)
        if self.rank == 0:
            print(f"initialized from {plan.init_source} "
                  f"({'weights' if weights_only else 'weights and optimizer moments'})", flush=True)
        return None, parent_tags(plan.init_source, self.cfg.train.init_from_optimizer)

    # -- the loop ---------------------------------------------------------------------------------------------------
    def fit(self):
        cbs, status = self.callbacks, "FAILED"
        self.stopped_by = "train.max_steps"
        self.collective = "the first step's collectives"  # what a collective timeout waited in (its error line)
        for cb in cbs:
            cb.on_fit_start(self)
        try:
            while self.state.step < self.cfg.train.max_steps:
                if self.budget_spent():
                    self.stopped_by = "budget"
                    break  # resumed after the word or epoch budget was spent
                for cb in cbs:
                    cb.on_step_start(self)
                try:
                    rec = self.run_step(self.read_step())
                except StopMidStep as e:
                    self._stopped_mid_step(e)
                    break
                stopping = self.after_step(rec)
                if stopping is not None:
                    stopping.on_stop(self)
                    break
            self.checkpointer.wait()  # the last save whole (or its failure raised) before the run reports its end
            status = "FINISHED" if self.stopped_by in ("train.max_steps", "budget") else "KILLED"
        except BaseException as e:
            self._settle_save(e)
            lost = self._failed(e)
            if lost is None:
                raise
            raise lost from e
        finally:
            self.stop.restore()
            for cb in cbs:
                cb.on_fit_end(self, status)

    def after_step(self, rec: dict) -> Callback | None:
        """The callbacks on step record ``rec`` (pipeline/train/callbacks.py), then the checkpoint when one is due;
        the first callback that stops the run after this step, or None."""
        cbs = self.callbacks
        for cb in cbs:
            cb.on_step_end(self, rec)
        for cb in cbs:
            cb.check(self, rec)
        stopping = [(cb, why) for cb in cbs if (why := cb.stop_reason(self, rec))]
        reasons = set().union(*(cb.save_reasons(self, rec) for cb in cbs))
        self.collective = f"the checkpoint save of step {self.state.step}"
        if (reasons or stopping) and self.may_save():
            for cb in cbs:
                cb.before_save(self)
            self.checkpointer.save(self.state, self.data.state_dict(), self.tracker,
                                   milestone="milestone" in reasons, best="best" in reasons)
        if not stopping:
            return None
        self.checkpointer.wait()  # the run stops: its checkpoint whole before it is named
        cb, self.stopped_by = stopping[0]
        return cb

    def read_step(self) -> list:
        """This step's microbatches from the loader (the loader position advances by grad_accum_steps).

        Remote data: a shard that cannot be fetched (pipeline/data/remote.py: after the retries) is not raised here,
        where the other ranks already wait in the step's first collective; it is kept in ``fetch_failure`` and the
        step's token-count all-reduce tells every rank (run_step), which then checkpoint the last complete step
        together and stop."""
        n = self.cfg.train.grad_accum_steps
        self.step_started = time.perf_counter()
        self.mid_step.start(self.state.step + 1)
        self.micro, self.fetch_failure = [], None
        if self.plan.cache is not None:  # the position to checkpoint if this step cannot be read
            self.step_start_loader = self.data.state_dict()
        for i in range(n):
            try:
                self.micro.append(next(self.data))
            except FetchError as e:
                if self.plan.cache is None:
                    raise
                self.fetch_failure = e
                break
            self.mid_step(i + 1, n, "read")
        return self.micro

    def run_step(self, micro: list) -> dict:
        """One optimizer step on this rank's microbatches, and the run's bookkeeping: lr, non-finite steps, running
        totals, best loss. Returns the step record (identical on every rank)."""
        s = self.state
        lr = self.set_lr()
        skipped_before = self.engine.skipped_steps
        self.collective = f"the collectives of step {s.step + 1} (token counts, gradient reduction, statistics)"
        rec = train_step(self.engine, self.family, self.cfg, micro, s.step, self.device,
                         between=lambda i, n: self.mid_step(i, n, "computed"),
                         unreadable=getattr(self, "fetch_failure", None) is not None)
        if rec.get("unreadable"):
            raise self._unreadable()
        s.batches_consumed += len(micro)
        s.step += 1
        # Non-finite: a loss or gradient norm that is inf/NaN, or DeepSpeed's own overflow check skipping the update
        # (it does on every ZeRO stage). The weights are then those of the last good step. A step without supervised
        # tokens (loss NaN by definition) is skipped but is no sign of divergence.
        overflow = self.engine.skipped_steps > skipped_before
        nonfinite = overflow or not (math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"]))
        rec["nonfinite"] = int(nonfinite and rec["supervised_tokens"] > 0)
        rec["skipped"] = int(rec["skipped"] or overflow)
        rec.update(step=s.step, time=time.time(), lr=lr)
        for k in CUMULATIVE:  # identical on every rank: the per-step values are already all-reduced
            if k in rec:
                s.cumulative[k] = s.cumulative.get(k, 0.0) + rec[k]
                rec[f"total/{k}"] = s.cumulative[k]
        rec["epochs"] = s.cumulative["samples"] / self.plan.dataset_samples
        s.last_loss = rec["loss"]
        if not rec["nonfinite"] and math.isfinite(rec["loss"]) and (s.best is None or rec["loss"] < s.best[0]):
            s.best = (rec["loss"], s.step)
        return rec

    def _unreadable(self) -> FetchError:
        """A rank could not fetch this step's data (read_step): every rank puts its loader back at the last complete
        step, they checkpoint it together (unless it is saved already), and the first rank's error, naming the URL,
        is the run's one line."""
        self.data.load_state_dict(self.step_start_loader)
        errors = [e for e in all_gather_object(str(self.fetch_failure) if self.fetch_failure else None) if e]
        error = errors[0] if errors else "another rank could not fetch its data"
        step, saved = self.state.step, None
        if step and self.may_save() and self.checkpointer.latest(None) != f"step{step:08d}":
            self.collective = f"the checkpoint save of step {step} (data unreadable)"
            self.checkpointer.save(self.state, self.data.state_dict(), self.tracker)
        saved = self.checkpointer.latest(None)
        self.stopped_by = "data that could not be fetched"
        where = (f"checkpoint {saved} holds step {step}: the same command resumes from it once the store answers"
                 if saved else "no checkpoint was written (no step was complete)")
        return FetchError(f"{error}; stopped before step {step + 1}, {where}")

    def set_lr(self) -> float:
        """Put the schedule's lr for 0-based step ``state.step`` into every param group; returns the base group's."""
        factor = lr_factor(self.cfg.optim, self.state.horizon, self.state.step, self.state.cumulative)
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs):
            group["lr"] = peak * factor
        return self.optimizer.param_groups[0]["lr"]

    def may_save(self) -> bool:
        """Whether every callback allows a checkpoint of the current step (none in a non-finite streak)."""
        return all(cb.allow_save(self) for cb in self.callbacks)

    def budget_spent(self) -> bool:
        t, c = self.cfg.train, self.state.cumulative
        return ((t.max_words is not None and c.get("words", 0) >= t.max_words)
                or (t.max_epochs is not None and c.get("samples", 0) >= t.max_epochs * self.plan.dataset_samples))

    def _stopped_mid_step(self, e: StopMidStep):
        self.stopped_by = self.stop.reason or "a stop request on another rank"
        if self.rank == 0:
            print(f"stopping during step {self.state.step + 1} ({e}): {self.stopped_by}; the step is not saved, the "
                  f"last complete checkpoint is {self.checkpointer.latest()}; the same command resumes from it",
                  flush=True)

    def _settle_save(self, e: BaseException):
        """A failing run still completes the background save in flight (an earlier step's, whole in host memory) or
        records its failure, unless the failure is that save's own or a second Ctrl-C (leave now: the incomplete
        checkpoint is skipped by resume, ``latest`` names the one before)."""
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is None or isinstance(e, (KeyboardInterrupt, CheckpointWriteError)):
            return
        failed = checkpointer.settle()
        if failed and self.rank == 0:
            print(f"warning: the checkpoint in flight when the run failed: {failed}", flush=True)

    def _failed(self, e: BaseException):
        """Note why the run failed; the PeerLost to raise instead of ``e`` when a peer rank is gone, else None."""
        lost = not isinstance(e, (CheckpointWriteError, TrainingStopped, LoaderFailed)) and lost_peer(e)
        self.stopped_by = ("the loss of another rank" if lost else "divergence" if isinstance(e, TrainingStopped)
                           else "data that could not be fetched" if isinstance(e, FetchError)
                           else f"an error ({type(e).__name__})")
        if not lost:
            return None
        return peer_lost(e, self.collective, self.state.step + 1, self.cfg.train.collective_timeout,
                         self.checkpointer.latest())


def run(cfg: RunConfig, ds_config_path: str, resume: str = "auto", allow_config_change: bool = False, *,
        trust_checkpoint: bool = False, allow_data_change: bool = False) -> Trainer:
    """A training from start to end in this process (one rank of it); launchers/pretrain.py's main path."""
    trainer = Trainer(cfg, ds_config_path, resume, allow_config_change, trust_checkpoint=trust_checkpoint,
                      allow_data_change=allow_data_change)
    if trainer.plan.finished:  # nothing to do: no process group, no engine, nothing written
        if int(os.environ.get("RANK", "0")) == 0:
            step = trainer.plan.saved["step"]
            print(f"run {trainer.run_dir} already finished at step {step} (train.max_steps {cfg.train.max_steps}); "
                  f"raise train.max_steps (e.g. --set train.max_steps={2 * step}) to train further", flush=True)
        return trainer
    try:
        try:
            trainer.setup()
        except BaseException:
            tracker = getattr(trainer, "tracker", None)
            if tracker is not None:  # created before the failure: its MLflow run must not stay RUNNING
                tracker.finish("FAILED")
            raise
        trainer.fit()
    finally:
        lock = getattr(trainer, "lock", None)
        if lock is not None:
            lock.release()
    shutdown_distributed()
    return trainer

