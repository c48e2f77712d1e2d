"""The Trainer's side effects, one concern per callback (OLMo-core's Trainer callbacks, llm-foundry's).

``Trainer.fit`` runs a step and then calls, for every callback in list order (``default_callbacks``):
``on_step_end`` (add metrics to the step record, write it somewhere), ``check`` (may raise to end the run, after
the record is written), ``stop_reason`` (whether the run stops after this step), ``save_reasons`` / ``allow_save``
(whether this step is checkpointed: some callback wants it, or the run stops, and none forbids it). Hooks run on
every rank; rank-0-only work is decided inside a hook, never by skipping it.

Collectives per step, in order, on every rank (a rank that made another sequence would hang its peers):
    1. the step (pipeline/train/step.py): token counts, plan sync values, gradient reduction, statistics
    2. MixtureMetrics: one all-reduce of the samples and tokens read per source
       RemoteData (remote shard sets only): one all-reduce of the step's fetch counters
    3. Validation (on its cadence): the held-out batches in lockstep and one all-reduce of their sums
    4. StopOnRequest: one all-reduce (MAX) of the stop flag
    5. the checkpoint save, when one is due (pipeline/checkpoint/io.py lists its collectives)
Every other hook is local. The Tracker's start made its own broadcast at setup (pipeline/tracking/tracker.py).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import commands
from pipeline.checkpoint.mirror import Mirror
from pipeline.config import ConfigError, word_milestones
from pipeline.profiling import StepProfiler
from pipeline.train.step import all_reduce_host
from pipeline.train.stop import LoaderFailed, TrainingStopped
from pipeline import validation


class Callback:
    """A side effect of training on a step cadence; every hook is optional."""

    def on_fit_start(self, trainer):
        pass

    def on_step_start(self, trainer):
        pass

    def on_step_end(self, trainer, rec: dict):
        """After the step: add metrics to ``rec`` (the step record, identical on every rank) or write it out."""

    def check(self, trainer, rec: dict):
        """After every on_step_end: raise to end the run."""

    def stop_reason(self, trainer, rec: dict) -> str | None:
        """Why the run stops after this step (checkpointed first), or None."""
        return None

    def on_stop(self, trainer):
        """The first callback whose stop_reason ended the run, after the last save: say so."""

    def save_reasons(self, trainer, rec: dict) -> set:
        """Why this step is checkpointed ("periodic", "milestone", "best"); empty: no reason of this callback."""
        return set()

    def allow_save(self, trainer) -> bool:
        return True

    def before_save(self, trainer):
        pass

    def on_fit_end(self, trainer, status: str):
        """The run ends (FINISHED, KILLED or FAILED), also on an exception."""


class Profile(Callback):
    """train.profile: a torch profiler trace of a window of steps (pipeline/profiling.py)."""

    def on_fit_start(self, trainer):
        self.profiler = StepProfiler(trainer.cfg.train.profile, trainer.run_dir, trainer.rank)

    def on_step_start(self, trainer):
        self.profiler.before_step(trainer.state.step + 1)

    def on_step_end(self, trainer, rec):
        self.profiler.after_step(trainer.state.step)

    def on_fit_end(self, trainer, status):
        self.profiler.close(trainer.state.step)  # a run that ends inside the window still writes what it recorded


class DivergenceGuard(Callback):
    """Non-finite steps (their update is skipped): a warning each, no checkpoint while a streak lasts, and the run
    stops (TrainingStopped, exit 3) after train.max_nonfinite_steps in a row."""

    def on_fit_start(self, trainer):
        self.streak, self.first = 0, None  # consecutive non-finite steps and the first of them

    def on_step_end(self, trainer, rec):
        self.streak = self.streak + 1 if rec["nonfinite"] else 0
        self.first = (self.first or trainer.state.step) if self.streak else None
        if rec["nonfinite"] and trainer.rank == 0:
            print(f"warning: step {trainer.state.step}: non-finite loss {rec['loss']} / grad norm "
                  f"{rec['grad_norm']}: update skipped ({self.streak} in a row, train.max_nonfinite_steps "
                  f"{trainer.cfg.train.max_nonfinite_steps})", flush=True)

    def check(self, trainer, rec):
        limit = trainer.cfg.train.max_nonfinite_steps
        if self.streak >= limit:
            raise TrainingStopped(
                f"training diverged: {self.streak} consecutive non-finite steps ({self.first}-{trainer.state.step}, "
                f"train.max_nonfinite_steps {limit}); no checkpoint was written during them, the last good one is "
                f"{trainer.checkpointer.latest()}. Lower optim.lr or raise "
                "optim.warmup_steps and resume from it")

    def allow_save(self, trainer):
        return self.streak == 0  # never checkpoint a model in a non-finite streak


class MixtureMetrics(Callback):
    """mix/weight/<source> in force at the step; mix/samples|tokens/<source> consumed so far, all ranks."""

    def on_step_end(self, trainer, rec):
        seen = trainer.data.seen()  # name -> (samples, tokens) of this rank; tokens = sequence lengths incl. framing
        names = list(seen)
        vec = all_reduce_host([seen[n][0] for n in names] + [seen[n][1] for n in names], torch.float64,
                              trainer.device)  # NCCL reduces only CUDA tensors
        weights = trainer.dataset.mixture.weights(trainer.state.step - 1)  # the 0-based step just taken
        for i, n in enumerate(names):
            rec[f"mix/weight/{n}"] = float(weights[i])
            rec[f"mix/samples/{n}"] = int(vec[i])
            rec[f"mix/tokens/{n}"] = int(vec[len(names) + i])


FETCH = ("fetched_bytes", "fetches", "cache_hits", "retries")  # summed over ranks; wait_s: the slowest rank's


class RemoteData(Callback):
    """Remote shard sets (pipeline/data/remote.py): per step, over every rank, the bytes fetched, shards fetched,
    cache hits and retries (``fetch/<name>``, summed) and the time the loader waited on the network
    (``fetch/wait_s``, the slowest rank's: the step waits for it) with its share of the step (``fetch/wait_share``);
    the run's totals for the summary."""

    def on_fit_start(self, trainer):
        self.totals = dict.fromkeys((*FETCH, "wait_s"), 0.0)
        trainer.fetch_totals = self.totals

    def on_step_end(self, trainer, rec):
        mine = dict.fromkeys((*FETCH, "wait_s"), 0.0)
        for b in trainer.micro:
            for k, v in (b.fetch or {}).items():
                if k in mine:
                    mine[k] += v
        sums = all_reduce_host([mine[k] for k in FETCH], torch.float64, trainer.device)
        wait = all_reduce_host([mine["wait_s"]], torch.float64, trainer.device, dist.ReduceOp.MAX)[0]
        for k, v in zip(FETCH, sums):
            rec[f"fetch/{k}"] = int(v)
            self.totals[k] += v
        rec["fetch/wait_s"] = wait
        self.totals["wait_s"] += wait
        rec["fetch/wait_share"] = wait / max(time.perf_counter() - trainer.step_started, 1e-9)


class Throughput(Callback):
    """Step time, tokens/s, TFLOP/s per device, MFU (train.peak_flops_per_device) and the padding ratio over the
    steps since the last console line."""

    def on_fit_start(self, trainer):
        self.interval = [0, 0]  # tokens computed, real tokens since the last console line

    def on_step_end(self, trainer, rec):
        dt = time.perf_counter() - trainer.step_started
        self.interval = [self.interval[0] + rec["tokens_computed"], self.interval[1] + rec["tokens"]]
        rec["padding_ratio"] = self.interval[0] / self.interval[1] if self.interval[1] else float("nan")
        rec.update(step_time=dt, tokens_per_s=rec["tokens"] / dt,
                   tflops_per_device=rec.get("flops", 0.0) / trainer.world / dt / 1e12)
        if trainer.cfg.train.peak_flops_per_device:
            rec["mfu"] = rec["tflops_per_device"] * 1e12 / trainer.cfg.train.peak_flops_per_device
        if torch.cuda.is_available():  # this rank's allocator peak since start-up, GiB (bench/gpu_report.py reads it)
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            rec["predicted_mem_gib"] = float(trainer.resolved["memory_model_gib"])  # pipeline/train/memory.py
        if _console_step(trainer):
            self.interval = [0, 0]


class Validation(Callback):
    """eval.every: the held-out metrics (pipeline/validation.py) into the step record, printed and plotted
    (RUN_DIR/validation.png), and checkpoint.keep_best's ``best`` checkpoint."""

    def on_fit_start(self, trainer):
        cfg, self.seconds, self.started = trainer.cfg, 0.0, time.perf_counter()
        self.batches = validation.heldout_batches(cfg, trainer.family, trainer.plan.val_dirs, trainer.plan.cache)
        self.new_best = False
        self.history = []  # rank 0: the validation records of metrics.jsonl, for the plot
        self.train_loss = []  # rank 0: (step, training loss), drawn beside them
        self.chance = validation.chance(self.batches)
        metrics = trainer.run_dir / "metrics.jsonl"
        if trainer.rank == 0 and metrics.is_file():  # a resumed run's plot keeps the steps before the restart
            for ln in metrics.read_text().splitlines():
                rec = json.loads(ln)
                if "loss" in rec and "step" in rec:
                    self.train_loss.append((rec["step"], rec["loss"]))
                if any(k.startswith("val/") for k in rec):
                    self.history.append({k: v for k, v in rec.items() if k == "step" or k.startswith("val/")})

    def on_step_end(self, trainer, rec):
        step, every = trainer.state.step, trainer.cfg.eval.every
        self.new_best = False
        if trainer.rank == 0 and math.isfinite(rec.get("loss", math.nan)):
            self.train_loss.append((step, rec["loss"]))
        if not (step % every == 0 or step == trainer.cfg.train.max_steps):
            return
        trainer.collective = f"the validation after step {step}"
        val = validation.evaluate(trainer.engine.module, trainer.cfg, trainer.family, self.batches, trainer.device,
                                  trainer.rank, trainer.world)
        self.seconds += val["val/seconds"]
        train_seconds = time.perf_counter() - self.started - self.seconds
        val["val/time_share"] = self.seconds / max(train_seconds + self.seconds, 1e-9)
        if trainer.rank == 0:
            shown = " | ".join(f"{k.removeprefix('val/')} {v:.4f}" for k, v in val.items()
                               if k.startswith(("val/loss", "val/accuracy", "val/perplexity", "val/f1")))
            print(f"validation at step {step}: {shown} | {val['val/seconds']:.1f} s "
                  f"({100 * val['val/time_share']:.1f}% of the run's time)", flush=True)
            self.history.append({"step": step, **val})
            plot = validation.plot_history(self.history, trainer.run_dir / "validation.png", self.train_loss,
                                           self.chance, title=_plot_title(trainer, self.batches))
            if plot is not None:
                trainer.tracker.log_artifact(plot)
        rec.update(val)
        self.new_best = trainer.may_save() and self._improves_best(trainer, val)  # a checkpoint is written below

    def _improves_best(self, trainer, val: dict) -> bool:
        """Whether ``val`` improves checkpoint.keep_best (then the state's val_best is this step)."""
        key, mode, best = trainer.cfg.checkpoint.keep_best, trainer.cfg.checkpoint.best_mode, trainer.state.val_best
        if key is None:
            return False
        if key not in val:
            raise ConfigError(f"checkpoint.keep_best: {key} is not a validation metric of this run (it has "
                              f"{', '.join(k for k in val if k not in ('val/seconds', 'val/time_share'))})")
        v = val[key]
        if not math.isfinite(v) or (best is not None and not (v < best[0] if mode == "min" else v > best[0])):
            return False
        trainer.state.val_best = (v, trainer.state.step)
        return True

    def save_reasons(self, trainer, rec):
        return {"best"} if self.new_best else set()


class MetricsFile(Callback):
    """Rank 0: every step record as a line of RUN_DIR/metrics.jsonl (cut back to the resume point at setup)."""

    def on_fit_start(self, trainer):
        self.file = open(trainer.run_dir / "metrics.jsonl", "a") if trainer.rank == 0 else None

    def on_step_end(self, trainer, rec):
        if self.file:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def on_fit_end(self, trainer, status):
        if self.file:
            self.file.close()


class SamplesFile(Callback):
    """train.log_samples: the sample ids of every step, per rank (RUN_DIR/samples-rank<R>.jsonl)."""

    def on_fit_start(self, trainer):
        self.file = open(trainer.run_dir / f"samples-rank{trainer.rank}.jsonl", "a")

    def on_step_end(self, trainer, rec):
        ids = [s for b in trainer.micro for s in b.sample_ids]
        self.file.write(json.dumps({"step": trainer.state.step, "ids": ids}) + "\n")

    def before_save(self, trainer):
        self.file.flush()

    def on_fit_end(self, trainer, status):
        self.file.close()


class Track(Callback):
    """MLflow (pipeline/tracking/tracker.py): the step record every tracking.every steps, at the last step and with every
    validation; at the end metrics.jsonl (a finished run) and the run's status. The tracker never stalls training."""

    def on_step_end(self, trainer, rec):
        step = trainer.state.step
        validated = any(k.startswith("val/") for k in rec)
        if step % trainer.cfg.tracking.every == 0 or step == trainer.cfg.train.max_steps or validated:
            trainer.tracker.log_metrics({k: v for k, v in rec.items() if k != "step"}, step)

    def on_fit_end(self, trainer, status):
        try:
            if status == "FINISHED" and trainer.rank == 0:
                trainer.tracker.log_artifact(trainer.run_dir / "metrics.jsonl")
            trainer.tracker.finish(status)
        except Exception as e:  # noqa: BLE001 - tracking never masks the training's own outcome
            print(f"warning: tracking: could not finish the MLflow run ({type(e).__name__}: {e})", flush=True)


class MirrorCheckpoints(Callback):
    """checkpoint.mirror (pipeline/checkpoint/mirror.py): rank 0 uploads each complete checkpoint in a thread of its
    own (the step never waits); the run's end waits for the last upload."""

    def on_fit_start(self, trainer):
        self.mirror = Mirror(trainer.cfg, trainer.run_dir) if trainer.rank == 0 else None
        if self.mirror is not None:
            trainer.checkpointer.after_complete.append(self.mirror.submit)

    def on_fit_end(self, trainer, status):
        if self.mirror is not None:
            self.mirror.wait()


class Console(Callback):
    """Rank 0: a step line every train.log_every steps and at the last, ending with this attempt's elapsed time and
    an estimate of the time left (``eta``); the run's closing summary."""

    def on_fit_start(self, trainer):
        self.start_step, self.started = trainer.state.step, time.perf_counter()
        c = trainer.state.cumulative
        self.start_words, self.start_samples = c.get("words", 0.0), c.get("samples", 0.0)

    def on_step_end(self, trainer, rec):
        if _console_step(trainer) and trainer.rank == 0:
            print(f"step {trainer.state.step}/{trainer.cfg.train.max_steps} | loss {rec['loss']:.4f} | lr "
                  f"{rec['lr']:.3e} | grad_norm {rec['grad_norm']:.3f} | tok/s {rec['tokens_per_s']:.0f} | "
                  f"TFLOP/s/dev {rec['tflops_per_device']:.3f} | step {rec['step_time'] * 1000:.0f} ms | "
                  f"{_fetch_note(rec)}{self.timing(trainer)}", flush=True)

    def timing(self, trainer) -> str:
        """``elapsed 1m02s eta 3m10s``: the ETA at this attempt's pace (validations and saves included) to whichever
        limit ends the run first; a limit other than train.max_steps is named."""
        t, c, step = trainer.cfg.train, trainer.state.cumulative, trainer.state.step
        elapsed = time.perf_counter() - self.started
        budgets = {"train.max_steps": (step - self.start_step, t.max_steps - step)}
        if t.max_words is not None:
            budgets["train.max_words"] = (c.get("words", 0.0) - self.start_words, t.max_words - c.get("words", 0.0))
        if t.max_epochs is not None:
            total = t.max_epochs * trainer.plan.dataset_samples
            budgets["train.max_epochs"] = (c.get("samples", 0.0) - self.start_samples, total - c.get("samples", 0.0))
        deadline = trainer.stop.deadline  # train.max_hours, on the clock StopRequest checks
        if deadline is not None:
            budgets["train.max_hours"] = (None, deadline - time.monotonic())
        eta = estimate_remaining(elapsed, budgets)
        if eta is None:
            return f"elapsed {duration(elapsed)} eta ?"
        seconds, limit = eta
        return f"elapsed {duration(elapsed)} eta {duration(seconds)}" + (
            "" if limit == "train.max_steps" else f" ({limit})")

    def on_fit_end(self, trainer, status):
        if trainer.rank == 0:
            print(run_summary(trainer, status, trainer.state.step - self.start_step,
                              time.perf_counter() - self.started), flush=True)


def run_summary(trainer, status: str, steps_this_attempt: int, seconds: float) -> str:
    """The run's last lines: how far it got, where its checkpoints and tracking live, how to export it."""
    c, s, ckpt_dir = trainer.state.cumulative, trainer.state, trainer.checkpointer.ckpt_dir
    latest = trainer.checkpointer.latest(None)
    best = f"{s.best[0]:.4f} at step {s.best[1]}" if s.best else "n/a"
    final = f"{s.last_loss:.4f}" if steps_this_attempt else "n/a (no step this attempt)"
    m, sec = divmod(int(seconds), 60)
    took = f"{m // 60}h{m % 60:02d}m{sec:02d}s" if m >= 60 else f"{m}m{sec:02d}s"
    lines = [
        f"==== run {trainer.run_dir} {status.lower()}: step {s.step}/{trainer.cfg.train.max_steps} "
        f"(stopped by {trainer.stopped_by}), {steps_this_attempt} steps in {took} ====",
        f"loss: final {final}, best {best} | tokens {c.get('tokens', 0):.4g} | samples "
        f"{c.get('samples', 0):.4g} | skipped steps {c.get('skipped', 0):.0f} | non-finite steps "
        f"{c.get('nonfinite', 0):.0f}",
        f"checkpoints: {ckpt_dir} (latest {latest or 'none'})",
    ]
    fetched = getattr(trainer, "fetch_totals", None)
    if fetched is not None:  # remote shard sets (callbacks.RemoteData), this attempt
        lines.append(f"data fetched: {megabytes(fetched['fetched_bytes'])} in {fetched['fetches']:.0f} shards "
                     f"(all ranks), {fetched['cache_hits']:.0f} cache hits, {fetched['retries']:.0f} retries, "
                     f"{fetched['wait_s']:.1f} s waiting on the network; cache {trainer.plan.cache.directory}")
    if latest:
        lines.append(f"export: {commands.python()} tools/convert_checkpoint.py --checkpoint {trainer.run_dir} "
                     f"--output exports/{trainer.run_dir.name}")
    if trainer.tracker.uri:
        lines.append(f"mlflow: run {trainer.tracker.run_id} in {trainer.tracker.uri} "
                     f"({commands.mlflow()} ui --backend-store-uri {trainer.tracker.uri})")
    lines.append(f"log: {trainer.run_dir / 'train.log'}, metrics: {trainer.run_dir / 'metrics.jsonl'}")
    return "\n".join(lines)


def _fetch_note(rec: dict) -> str:
    """The step line's remote-data part: ``fetched 1.2 MB (1 shard), 3 hits, 0 retries, net wait 4 ms | ``."""
    if "fetch/fetched_bytes" not in rec:
        return ""
    n = rec["fetch/fetches"]
    return (f"fetched {megabytes(rec['fetch/fetched_bytes'])} ({n} shard{'s' if n != 1 else ''}), "
            f"{rec['fetch/cache_hits']} hits, {rec['fetch/retries']} retries, net wait "
            f"{rec['fetch/wait_s'] * 1000:.0f} ms | ")


def megabytes(n: float) -> str:
    """Bytes for a person: 812 B, 45.1 kB, 3.2 MB, 1.25 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{n:.0f} B"


def duration(seconds: float) -> str:
    """A console duration: 42s, 1m02s, 2h03m, 3d04h (two units at most, the larger first)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s // 60 % 60:02d}m"
    return f"{s // 86400}d{s // 3600 % 24:02d}h"


def estimate_remaining(elapsed: float, budgets: dict) -> tuple[float, str] | None:
    """(seconds left, the limit that ends the run first) at the pace of ``elapsed`` seconds so far, or None.

    ``budgets``: limit name -> (done, left). ``done`` units (steps, words, samples) took ``elapsed`` seconds, so
    ``left`` more take ``elapsed * left / done``; ``done`` None means ``left`` is already seconds (a wall-clock
    deadline). A limit with nothing done yet has no pace and gives no estimate; one already spent gives 0."""
    found = []
    for name, (done, left) in budgets.items():
        if done is None:
            found.append((max(0.0, left), name))
        elif left <= 0:
            found.append((0.0, name))
        elif done > 0:
            found.append((elapsed * left / done, name))
    return min(found, key=lambda f: f[0]) if found else None


class SaveCadence(Callback):
    """checkpoint.every_steps and the last step ("periodic"); checkpoint.at_steps and at_words ("milestone":
    survives keep_last)."""

    def on_fit_start(self, trainer):
        # Words consumed before the current step: the restored total on resume, so a milestone saved before the kill
        # (words <= total) is not saved again and one the kill came before is saved at the step that crosses it
        self.words = trainer.state.cumulative.get("words", 0.0)
        self.milestones = word_milestones(trainer.cfg)

    def save_reasons(self, trainer, rec):
        step, c = trainer.state.step, trainer.cfg.checkpoint
        before, self.words = self.words, trainer.state.cumulative.get("words", 0.0)
        reasons = set()
        if step % c.every_steps == 0 or step == trainer.cfg.train.max_steps:
            reasons.add("periodic")
        if any(before < w <= self.words for w in self.milestones) or step in c.at_steps:
            reasons.add("milestone")
        return reasons


class Budget(Callback):
    """train.max_words / train.max_epochs: the run stops (checkpointed) at the step that spends the budget."""

    def stop_reason(self, trainer, rec):
        return "budget" if trainer.budget_spent() else None

    def on_stop(self, trainer):
        if trainer.rank == 0:
            t, c = trainer.cfg.train, trainer.state.cumulative
            print(f"budget reached: {c.get('words', 0.0):.0f} words (train.max_words {t.max_words}), "
                  f"{c['samples'] / trainer.plan.dataset_samples:.3f} epochs (train.max_epochs {t.max_epochs})",
                  flush=True)


class StopOnRequest(Callback):
    """SIGTERM / SIGUSR1, the launcher's death, train.max_hours on any rank (pipeline/train/stop.py): every rank
    stops after the same step, checkpointed. A DataLoader worker that died on any rank (its loader restarted and
    finished the step: pipeline/data/loader.py StreamLoader) stops every rank the same way, and then the run fails
    (LoaderFailed, exit 1) with one line naming the worker, the shard it was reading and the checkpoint."""

    DIED = 2.0  # the flag of a rank whose loader lost a worker (above a stop request's 1.0: MAX says which)

    def stop_reason(self, trainer, rec):
        trainer.collective = f"the stop-flag all-reduce after step {trainer.state.step}"
        died = getattr(trainer.data, "worker_died", None)
        local = self.DIED if died else float(trainer.stop.requested())
        flag = all_reduce_host([local], torch.float32, trainer.device, dist.ReduceOp.MAX)
        if flag[0] >= self.DIED:
            self.failure = died or "a data loader worker of another rank died (its error line names it)"
            return "a data loader worker died"
        return (trainer.stop.reason or "a stop request on another rank") if flag[0] else None

    def on_stop(self, trainer):
        saved = trainer.checkpointer.last_saved or "not written (non-finite step)"
        if getattr(self, "failure", None):
            raise LoaderFailed(f"{self.failure}; the loader restarted from its position and finished step "
                               f"{trainer.state.step}, checkpoint {saved}; the same command resumes")
        if trainer.rank == 0:
            print(f"stopping at step {trainer.state.step}: {trainer.stopped_by}; checkpoint {saved}; the same "
                  "command resumes", flush=True)


def _plot_title(trainer, batches: list) -> str:
    """validation.png's title: which run, on which held-out data, and what chance means."""
    cfg = trainer.cfg
    val = ", ".join(Path(d).name for d in trainer.plan.val_dirs)
    return (f"{cfg.family} run {trainer.run_dir}: training loss and held-out ({val}, "
            f"{sum(len(b.sample_ids) for b in batches)} sequences); "
            "chance: the commonest target / the targets' entropy")


def _console_step(trainer) -> bool:
    step = trainer.state.step
    return step % trainer.cfg.train.log_every == 0 or step == trainer.cfg.train.max_steps


def default_callbacks(cfg, remote: bool = False) -> list[Callback]:
    """The order is the order of their effects within a step (module docstring): the divergence guard before
    validation (no ``best`` in a non-finite streak) and the console, throughput after the mixture's all-reduce (it
    is part of the step's time), the metrics file after every metric, the budget before stop requests (a run that
    spends its budget stops "by budget"). ``remote``: a source reads a remote shard set (RemoteData's metrics)."""
    cbs = [Profile(), DivergenceGuard(), MixtureMetrics()] + ([RemoteData()] if remote else []) + [Throughput()]
    if cfg.eval.every:
        cbs.append(Validation())
    cbs += [MetricsFile()] + ([SamplesFile()] if cfg.train.log_samples else [])
    cbs += [MirrorCheckpoints()] if cfg.checkpoint.mirror else []
    return cbs + [Track(), Console(), SaveCadence(), Budget(), StopOnRequest()]
