#!/usr/bin/env python
"""Benchmark: what the DeepSpeed engine costs per step against a plain PyTorch loop, and 2-rank scaling on CPU.

    python bench/engine.py [--quick] [--steps 12 --warmup 3] [--skip-p4] [--skip-scaling]

P4 (one process, gloo, world size 1): the project's real training step, built by pipeline/train's Trainer from
launchers/configs/eco_rna_80m.yaml's objective and ds_configs/zero2.json (ZeRO-2, fp32 on CPU), against a plain loop
over the same model (same initial weights), the same microbatches, the same loss function (the family's plan and
loss: depth sampling, wavefront, auxiliary terms) and torch.optim.AdamW with the same parameter groups and gradient
clipping, without DeepSpeed, one torch thread on both sides (--threads). The engine step is a step of the Trainer's
own loop, Trainer.fit, timed by a callback that runs first in its list (paired_steps_callback): read_step, set_lr,
train_step (token-count and K_max all-reduces, engine.backward / engine.step per microbatch, the statistics
all-gather and all-reduce, the grad norm), every default callback (mixture metrics' all-reduce, the non-finite
checks, metrics.jsonl, the tracker's log_metrics every 5 steps and at the last (MLflow, sqlite in the run
directory), the console line, the StopRequest all-reduce); the bench's callback vetoes checkpoints. The plain step
is plan + loss + backward(sum / n) + clip_grad_norm_ + AdamW.step + zero_grad. Batches are drawn from the real loader
before timing (bench/data.py measures the loader), and each engine step is paired with a plain step on the same batch
and the same depths, in alternating order, so both see the same machine state. P4 = median over steps of engine /
plain. (The bench once copied fit's step by hand and broke when fit gained state; it now runs fit itself.)

Model (small, not tiny: compute dominates the step as on real runs): Eco-RNA d 256, 4 heads of 64 (2 KV), SwiGLU
1024, 1 prelude + 2 core + 1 coda blocks (4.08M parameters), context 256, 8 rows per microbatch, one microbatch per
step, depths from the paper's law (mu_K 4, sigma 0.5, W_bwd 4, anchor K_a 1) capped at 8 so that one step stays
near a second, on the shipped Rfam sample (data_prep'd into a temp dir).

scaling: tokens/s of the real launcher (python -m deepspeed.launcher.runner --num_gpus N launchers/pretrain.py
--ds_config ds_configs/zero2.json) at world size 2 over world size 1, one thread per rank (OMP_NUM_THREADS=1), the
demo Eco-RNA (d 128, context 128, 8 rows x 2 microbatches per rank), read off metrics.jsonl (tokens per step over
the time between consecutive steps' records, median after warm-up). Ideal on 2 free cores: 2.0.

Prints RESULT P4 (and P4.cpu, the same ratio in process CPU time, which other load on the host cannot inflate)
and RESULT scaling; exits non-zero when a training fails. --quick: fewer steps (under 3 minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SAMPLE_FASTA = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"

P4_MODEL = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=1024", "model.n_prelude=1",
            "model.n_core=2", "model.n_coda=1", "objective.k_cap=8"]
# eco_rna_80m.yaml's token-budget batching (max_tokens_per_microbatch 16384, length_window 8192) is turned off: with it
# the "8 rows" would be 64 rows of 256 tokens and a step 25-40 s (tests/bench/test_bench_batches.py).
P4_RUN = ["data.context_length=256", "data.num_workers=0", "data.shuffle_buffer=0", "train.micro_batch_size=8",
          "train.max_tokens_per_microbatch=null", "data.length_window=0",
          "train.grad_accum_steps=1", "optim.warmup_steps=2", "train.log_every=5", "tracking.every=5",
          "checkpoint.every_steps=1000000"]


def p4_config(shards: Path, run_dir: Path, steps: int = 1000000):
    """P4's RunConfig: eco_rna_80m.yaml's objective on the small model and batch of the module docstring, ``steps``
    optimizer steps."""
    from pipeline.config import load_config

    return load_config(REPO / "launchers" / "configs" / "eco_rna_80m.yaml",
                       P4_MODEL + P4_RUN + [f"train.max_steps={steps}", f"data.train_shards={shards}",
                                            f"run_dir={run_dir}"])


def model_text(cfg) -> str:
    m, o = cfg.model, cfg.objective
    return (f"Eco-RNA d{m.d_model} {m.n_prelude}+{m.n_core}xK+{m.n_coda} blocks ctx{cfg.data.context_length} "
            f"{cfg.train.micro_batch_size} rows, mu_K {o.mu_k:g} cap {o.k_cap} W {o.backward_window}")


def build_shards(out: Path) -> Path:
    """The shipped Rfam sample as 8 shards, by the real data_prep CLI (as the tests build theirs)."""
    subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                    str(out), "--shard-size", "300", "--progress", "off"], cwd=REPO, check=True, capture_output=True)
    return out


# --------------------------------------------------------------------------------------------------------------------
# P4
# --------------------------------------------------------------------------------------------------------------------
class PreDrawn:
    """The loader with its next batches drawn before timing (bench/data.py measures the loader): Trainer.fit's
    read_step takes them from here; everything else (seen, state_dict) is the loader's own."""

    def __init__(self, loader, batches: list):
        self.loader, self.batches = loader, iter(batches)

    def __next__(self):
        return next(self.batches)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def paired_steps_callback(batches: list, plain_step, warmup: int = 0):
    """A Trainer callback that times every step Trainer.fit takes and runs the plain step on the same batch next to it.

    It goes first in the callback list, so step i's time runs from its on_step_start to its on_step_start of step i+1
    (or its on_fit_end after the last): every other callback's hooks, read_step, run_step and after_step, all of what
    fit does per step. The plain step runs outside that window, after the engine's on even steps and before it on odd
    ones. It vetoes every checkpoint (the last step would save one; a save is no part of a step's cost)."""
    from pipeline.train import Callback

    class PairedSteps(Callback):
        def __init__(self):
            self.engine, self.plain = [], []  # per step: (wall s, process CPU s)
            self.open = None  # the step whose engine time is running

        def on_step_start(self, trainer):
            self._close(trainer)
            i = trainer.state.step  # 0-based: the step fit is about to take
            if i % 2:
                self._plain(i)
            self.open, self.t0, self.c0 = i, time.perf_counter(), time.process_time()

        def _plain(self, i):
            t0, c0 = time.perf_counter(), time.process_time()
            plain_step(i, batches[i])
            self.plain.append((time.perf_counter() - t0, time.process_time() - c0))

        def _close(self, trainer):
            if self.open is None:
                return
            i, self.open = self.open, None
            self.engine.append((time.perf_counter() - self.t0, time.process_time() - self.c0))
            if i % 2 == 0:
                self._plain(i)
            print(f"P4 step {i + 1}/{len(batches)}{' (warm-up)' if i < warmup else ''}: engine "
                  f"{self.engine[-1][0] * 1e3:.0f} ms, plain {self.plain[-1][0] * 1e3:.0f} ms", flush=True)

        def allow_save(self, trainer):
            return False

        def on_fit_end(self, trainer, status):
            if status == "FINISHED":  # a failed step is no measurement: the error propagates from fit
                self._close(trainer)

    return PairedSteps()


def measure_p4(shards: Path, run_dir: Path, steps: int, warmup: int, threads: int = 1) -> dict:
    import torch

    from pipeline.train import Trainer, param_groups, shutdown_distributed

    total = warmup + steps
    cfg = p4_config(shards, run_dir, total)
    trainer = Trainer(cfg, str(REPO / "ds_configs" / "zero2.json"), resume="never")
    try:
        trainer.setup()  # DeepSpeed ZeRO-2 engine, loader, tracker: the real path
        family, engine = trainer.family, trainer.engine
        # One thread on both sides: on a shared 2-core host a multi-threaded step stalls at every parallel region
        # whenever another process holds a core (steps measured 10x slower), which buries the overhead in noise.
        torch.set_num_threads(threads)
        # The plain side: the same architecture from the same seed (the Trainer seeds before building its model).
        torch.manual_seed(cfg.seed)
        plain = family.build_model(cfg.model)
        with torch.no_grad():  # identical starting weights (DeepSpeed keeps the module's own parameters)
            for a, b in zip(plain.parameters(), engine.module.parameters()):
                a.copy_(b)
        opt = torch.optim.AdamW(param_groups(plain, cfg.optim), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                eps=cfg.optim.eps)
        clip = cfg.optim.grad_clip

        def plain_step(i, micro):
            # Same batch and depths as the engine's step i (plan is seeded by step and microbatch).
            plans = [family.plan(b, cfg, step=i, stream=0, index=j) for j, b in enumerate(micro)]
            n = sum(b.num_supervised for b in micro)
            for b, p in zip(micro, plans):
                out = family.loss(plain, b, cfg, p)
                (out.sum_loss / n).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        n = cfg.train.grad_accum_steps
        batches = [[next(trainer.data) for _ in range(n)] for _ in range(total)]
        trainer.data = PreDrawn(trainer.data, [b for step in batches for b in step])
        paired = paired_steps_callback(batches, plain_step, warmup)
        trainer.callbacks.insert(0, paired)  # first: its window holds every other callback's hooks (its docstring)
        trainer.fit()  # the Trainer's own loop: whatever fit does per step is in the engine's time
    finally:
        lock = getattr(trainer, "lock", None)
        if lock is not None:
            lock.release()
        shutdown_distributed()
    if len(paired.engine) != total or len(paired.plain) != total:
        raise RuntimeError(f"P4: Trainer.fit took {len(paired.engine)} of {total} steps")
    (t_engine, c_engine), (t_plain, c_plain) = (list(zip(*x[warmup:])) for x in (paired.engine, paired.plain))
    ratios = [e / p for e, p in zip(t_engine, t_plain)]
    k_max = [max(family.plan(b, cfg, step=i, stream=0, index=j).sync_max["k_max"] for j, b in enumerate(batches[i]))
             for i in range(warmup, total)]
    return {"ratio": statistics.median(ratios), "engine_ms": statistics.median(t_engine) * 1e3,
            "plain_ms": statistics.median(t_plain) * 1e3, "ratios": ratios, "threads": threads,
            "cpu_ratio": statistics.median(e / p for e, p in zip(c_engine, c_plain)), "model": model_text(cfg),
            "k_max": k_max, "n_params": sum(p.numel() for p in plain.parameters())}


# --------------------------------------------------------------------------------------------------------------------
# scaling
# --------------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


SCALING_CONFIG = REPO / "launchers" / "configs" / "eco_rna_demo.yaml"


def scaling_overrides(shards: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}",
            "train.log_every=1000000", f"checkpoint.every_steps={steps + 1}", "tracking.enabled=false"]


def launch(nproc: int, shards: Path, run_dir: Path, steps: int) -> list:
    """One training by the real launcher (the demo config); its metrics.jsonl records."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
           str(free_port()), str(REPO / "launchers" / "pretrain.py"), "--ds_config",
           str(REPO / "ds_configs" / "zero2.json"), "--config", str(SCALING_CONFIG)]
    for o in scaling_overrides(shards, run_dir, steps):
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"world size {nproc}: the launcher exited with {proc.returncode}:\n{tail}")
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    print(f"scaling: world size {nproc}: {len(records)} steps, {time.perf_counter() - t0:.1f} s incl. start-up",
          flush=True)
    return records


def throughput(records: list, warmup: int) -> tuple[float, float]:
    """(tokens/s over the steps after ``warmup``: tokens of each step over the time since the previous record,
    median; the trainer's own tokens_per_s median, which leaves out the per-step stop check)."""
    per_step = [r["tokens"] / (r["time"] - prev["time"]) for prev, r in zip(records, records[1:])
                if r["step"] > warmup]
    own = [r["tokens_per_s"] for r in records if r["step"] > warmup]
    return statistics.median(per_step), statistics.median(own)


def measure_scaling(shards: Path, tmp: Path, steps: int, warmup: int) -> dict:
    out = {}
    for n in (1, 2):
        records = launch(n, shards, tmp / f"scaling_ws{n}", steps)
        out[n] = throughput(records, warmup)
        out[f"tokens{n}"] = records[-1]["tokens"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps (under 3 minutes on two cores)")
    p.add_argument("--steps", type=int, default=None, help="timed P4 steps (default 12, --quick 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed P4 steps first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for P4, both sides (default 1)")
    p.add_argument("--scaling-steps", type=int, default=None, help="steps per scaling launch (default 30, --quick 12)")
    p.add_argument("--skip-p4", action="store_true")
    p.add_argument("--skip-scaling", action="store_true")
    args = p.parse_args(argv)
    steps = args.steps or (6 if args.quick else 12)
    scaling_steps = args.scaling_steps or (12 if args.quick else 30)
    if steps < 1 or args.warmup < 0 or scaling_steps < 8:
        p.error("need --steps >= 1, --warmup >= 0, --scaling-steps >= 8")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (other processes skew timings)")
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        tmp = Path(tmp)
        shards = build_shards(tmp / "shards")
        if not args.skip_scaling:  # first: P4's process group and threads stay in this process until it exits
            s = measure_scaling(shards, tmp, scaling_steps, warmup=4)
            (w1, own1), (w2, own2) = s[1], s[2]
            print(f"scaling: tokens/s ws1 {w1:.0f} (trainer's own figure {own1:.0f}), ws2 {w2:.0f} ({own2:.0f}); "
                  f"tokens per step {s['tokens1']} / {s['tokens2']}; {os.cpu_count()} CPU cores")
            print(f"RESULT scaling {w2 / w1:.3f} tokens/s at world size 2 / world size 1, real launcher, ZeRO-2, "
                  f"demo Eco-RNA d128 ctx128, 8 rows x 2 microbatches per rank, 1 thread per rank; ideal 2.0 on 2 "
                  f"free cores")
        if not args.skip_p4:
            r = measure_p4(shards, tmp / "p4", steps, args.warmup, args.threads)
            print(f"P4: {r['n_params'] / 1e6:.2f}M parameters, {r['threads']} torch thread(s), K_max per timed step "
                  f"{r['k_max']}; median step engine {r['engine_ms']:.0f} ms, plain {r['plain_ms']:.0f} ms; "
                  f"per-step ratios {[round(x, 3) for x in r['ratios']]}; process CPU time ratio (median) "
                  f"{r['cpu_ratio']:.3f}")
            print(f"RESULT P4 {r['ratio']:.3f} DeepSpeed ZeRO-2 engine step / plain PyTorch AdamW step, same model, "
                  f"batches and loss, median of {steps} paired steps ({r['model']}; world 1, gloo, fp32, "
                  f"{r['threads']} torch thread{'s' if r['threads'] > 1 else ''}); target <= 1.15")
            print(f"RESULT P4.cpu {r['cpu_ratio']:.3f} the same as process CPU time (engine / plain, median of the "
                  f"paired steps): what other processes on the host cannot inflate")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    from pipeline.train import exit_process  # after DeepSpeed: see its docstring

    exit_process(main())
