#!/usr/bin/env python
"""Bytes a real training step sends through torch.distributed, against tools/scaling.py's prediction.

    python bench/comm_volume.py --ds_config ds_configs/zero2.json [--case ds_configs/zero3.json KEY=VALUE ...]
        [--config CONFIG] [--set key=value ...] [--nproc 2] [--steps 3] [--shards DIR] [--out DIR]

Launches ``--nproc`` ranks (DeepSpeed's launcher, gloo on CPU) that train every case (a ds_config, with overrides of
its own for --case) in turn, each built exactly as launchers/pretrain.py builds a run (pipeline.train.Trainer: the
model, ZeRO, expert parallelism, the loader), for ``--steps`` optimizer steps through the engine's own
``train_step``, with every torch.distributed collective counted (CollectiveCounter). The first step of each case is
left out (ZeRO-3 records its module trace there). It prints, per case and step, the bytes per rank that were counted
and that ``tools/scaling.py`` predicts for the same config, resolved ds_config, world size and K_max, per phase
(forward, backward, after the optimizer step), and their ratio; writes OUT/comm_volume.json; exit 0 when every step
of every case agrees within ``--tolerance`` (default 10 %), 1 otherwise, 2 on bad input.

Counting convention (the one tools/scaling.py predicts in): the bytes one rank sends under the bandwidth-optimal
algorithm of each collective on a group of p ranks (ring / NCCL): all_reduce 2 (p-1)/p n, reduce_scatter and
all_gather (p-1)/p n of the full (unsharded) buffer, reduce and broadcast (p-1)/p n, all_to_all the bytes that leave
the rank; object collectives count as the tensor collectives they run on. Calls made inside a counted call (an
all_gather_object's all_gather) are not counted twice.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402


def _numel_bytes(t) -> int:
    return t.numel() * t.element_size()


def _list_bytes(ts) -> int:
    return sum(_numel_bytes(t) for t in ts)


def _all_to_all_single_sent(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_):
    """Bytes of ``input`` that go to other ranks (the row block for this rank stays)."""
    p, me = dist.get_world_size(group), dist.get_rank(group)
    row = _numel_bytes(input) // max(1, input.shape[0]) if input.dim() else _numel_bytes(input)
    splits = list(input_split_sizes) if input_split_sizes else [input.shape[0] // p] * p
    return row * (sum(splits) - splits[me]), _numel_bytes(input)


# op -> (argument index or name of the buffer, function of (payload bytes, p) -> bytes this rank sends).
# Payload: the full buffer of the collective (the input of a reduce-scatter, the output of an all-gather).
_RING = lambda n, p: (p - 1) / p * n  # noqa: E731
_OPS = {
    "all_reduce": (lambda a, k: _numel_bytes(_arg(a, k, 0, "tensor")), lambda n, p: 2 * (p - 1) / p * n),
    "reduce": (lambda a, k: _numel_bytes(_arg(a, k, 0, "tensor")), _RING),
    "broadcast": (lambda a, k: _numel_bytes(_arg(a, k, 0, "tensor")), _RING),
    "reduce_scatter_tensor": (lambda a, k: _numel_bytes(_arg(a, k, 1, "input")), _RING),
    "_reduce_scatter_base": (lambda a, k: _numel_bytes(_arg(a, k, 1, "input")), _RING),
    "reduce_scatter": (lambda a, k: _list_bytes(_arg(a, k, 1, "input_list")), _RING),
    "all_gather_into_tensor": (lambda a, k: _numel_bytes(_arg(a, k, 0, "output_tensor")), _RING),
    "_all_gather_base": (lambda a, k: _numel_bytes(_arg(a, k, 0, "output_tensor")), _RING),
    "all_gather": (lambda a, k: _list_bytes(_arg(a, k, 0, "tensor_list")), _RING),
    "all_gather_coalesced": (lambda a, k: sum(_list_bytes(x) for x in _arg(a, k, 0, "output_tensor_lists")), _RING),
    "all_reduce_coalesced": (lambda a, k: _list_bytes(_arg(a, k, 0, "tensors")), lambda n, p: 2 * (p - 1) / p * n),
    "all_to_all": (lambda a, k: _list_bytes(_arg(a, k, 1, "input_tensor_list")), _RING),
}


def _arg(args, kwargs, index, name):
    return kwargs[name] if name in kwargs else args[index]


class CollectiveCounter:
    """Counts the bytes every torch.distributed collective of this process sends, per ``category`` (set by the
    caller with :meth:`phase`) and per op.

    It wraps the functions in ``torch.distributed.distributed_c10d`` and their re-exports in ``torch.distributed``
    (DeepSpeed's comm backend calls ``torch.distributed.X``, and caches ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` when its backend is built: install the counter before ``init_distributed``).
    """

    def __init__(self):
        self.bytes = defaultdict(float)  # (phase, op) -> bytes this rank sent
        self.calls = defaultdict(int)
        self.current = "setup"
        self._saved = []
        self._local = threading.local()

    def phase(self, name: str):
        self.current = name

    def _wrap(self, op: str, fn):
        counter = self
        payload, sent = _OPS.get(op, (None, None))

        def counted(*args, **kwargs):
            if getattr(counter._local, "inside", False):
                return fn(*args, **kwargs)
            counter._local.inside = True
            try:
                group = kwargs.get("group")
                if op == "all_to_all_single":
                    if group is None and len(args) > 4:
                        group = args[4]
                    nbytes, _ = _all_to_all_single_sent(*args, **kwargs)
                else:
                    p = dist.get_world_size(group)
                    nbytes = sent(payload(args, kwargs), p) if p > 1 else 0.0
                counter.bytes[(counter.current, op)] += nbytes
                counter.calls[(counter.current, op)] += 1
                return fn(*args, **kwargs)
            finally:
                counter._local.inside = False

        counted.__wrapped__ = fn
        return counted

    def install(self):
        for op in [*_OPS, "all_to_all_single"]:
            for module in (c10d, dist):
                fn = getattr(module, op, None)
                if fn is not None:
                    self._saved.append((module, op, fn))
                    setattr(module, op, self._wrap(op, fn))
        return self

    def uninstall(self):
        for module, op, fn in reversed(self._saved):
            setattr(module, op, fn)
        self._saved.clear()

    def totals(self) -> dict:
        """{phase: {op: [bytes, calls]}}."""
        out: dict = defaultdict(dict)
        for (ph, op), b in self.bytes.items():
            out[ph][op] = [b, self.calls[(ph, op)]]
        return dict(out)


# --------------------------------------------------------------------------------------------------------------------
# Worker: one rank of the measured run
# --------------------------------------------------------------------------------------------------------------------
def worker(args) -> int:
    """Every case of ``--cases`` (a JSON list of {ds_config, overrides}) in turn, in this one process group; rank 0
    writes one record per case to ``--out``."""
    counter = CollectiveCounter().install()  # before DeepSpeed's comm backend caches its collectives
    import gc

    from pipeline.config import load_config
    from pipeline.train import Trainer, shutdown_distributed, train_step

    records = []
    for case in json.loads(Path(args.cases).read_text()):
        cfg = load_config(args.config, case["overrides"])
        trainer = Trainer(cfg, case["ds_config"], resume="never")
        trainer.setup()
        _mark_phases(trainer.engine, counter)
        per_step = []
        for step in range(args.steps):
            micro = [next(trainer.data) for _ in range(cfg.train.grad_accum_steps)]
            trainer.set_lr()
            counter.bytes.clear()
            counter.calls.clear()
            counter.phase("forward")
            rec = train_step(trainer.engine, trainer.family, cfg, micro, step, trainer.device)
            counter.phase("after")
            trainer.state.step += 1
            per_step.append({"totals": counter.totals(), "sync": _sync_values(trainer, micro, step),
                             "loss": rec["loss"]})
        trainer.tracker.finish("FINISHED")
        trainer.lock.release()
        records.append({"world_size": dist.get_world_size(), "steps": per_step, **case})
        del trainer
        gc.collect()
    counter.uninstall()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(records, indent=1))
    shutdown_distributed()
    return 0


def _mark_phases(engine, counter):
    """Attribute each collective to the forward, the backward or the optimizer step of the microbatch it serves:
    ``engine.backward`` and ``engine.step`` set their phase for their duration, everything else is "forward"."""
    for name in ("backward", "step"):
        fn = getattr(engine, name)

        def marked(*args, _fn=fn, _name=name, **kwargs):
            counter.phase(_name)
            try:
                return _fn(*args, **kwargs)
            finally:
                counter.phase("forward")

        setattr(engine, name, marked)


def _sync_values(trainer, micro, step) -> list:
    """Each microbatch's synchronized plan values (Eco-RNA: the K_max every rank ran), as train_step computed them."""
    plans = [trainer.family.plan(b, trainer.cfg, step=step, stream=b.origin[0], index=b.origin[1]) for b in micro]
    out = []
    for p in plans:
        vals = {k: torch.tensor(v) for k, v in p.sync_max.items()}
        for v in vals.values():
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        out.append({k: int(v) for k, v in vals.items()})
    return out


def measure(args, cases: list[tuple[str, list]]) -> list[dict]:
    """Launch one measured run of --nproc ranks that trains every (ds_config, overrides) case in turn; returns one
    record per case: per step the bytes per phase and op, and the ds_config the run resolved."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = args.shards
    if shards is None:  # the shipped Rfam sample, sharded as the quickstart does
        shards = out / "shards"
        if not (shards / "manifest.json").is_file():
            subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input",
                            str(REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"), "--output",
                            str(shards), "--shard-size", "300"], cwd=REPO, check=True, capture_output=True)
    specs = []
    for ds_config, extra in cases:
        run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=out))
        specs.append({"ds_config": str(Path(ds_config).resolve()), "run_dir": str(run_dir),
                      "overrides": [f"data.train_shards={shards}", f"run_dir={run_dir}", "tracking.enabled=false",
                                    *args.overrides, *extra]})
    (out / "cases.json").write_text(json.dumps(specs, indent=1))
    record = out / "counted.json"
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.nproc), "--master_port",
           str(port), str(Path(__file__).resolve()), "--worker", "--cases", str(out / "cases.json"),
           "--config", str(args.config), "--steps", str(args.steps), "--out", str(record)]
    with open(out / "run.log", "w") as log:
        rc = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0 or not record.is_file():
        tail = (out / "run.log").read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"the measured run failed (exit {rc}); {out / 'run.log'} ends: " + " | ".join(tail))
    records = json.loads(record.read_text())
    for r in records:
        r["resolved_ds_config"] = json.loads((Path(r["run_dir"]) / "ds_config.json").read_text())
    return records


def compare(data: dict, config: str, tolerance: float) -> tuple[list[dict], str]:
    """Per step after the first: counted vs predicted bytes per phase and in total; and the printed table."""
    from pipeline.config import load_config
    from tools.scaling import plan

    cfg = load_config(config, data["overrides"])
    rows, lines = [], [f"== {Path(data['ds_config']).name} " + " ".join(
        o for o in data["overrides"] if not o.startswith(("data.train_shards=", "run_dir=", "tracking.")))]
    phases = ("forward", "backward", "step")
    for i, step in enumerate(data["steps"][1:], start=2):
        k_max = [s["k_max"] for s in step["sync"]] if step["sync"] and "k_max" in step["sync"][0] else None
        pl = plan(cfg, data["resolved_ds_config"], data["world_size"], k_max=k_max)
        counted = {ph: sum(b for b, _ in step["totals"].get(ph, {}).values()) for ph in phases}
        predicted = {ph: sum(c.bytes for c in pl.traffic if c.phase == ph) for ph in phases}
        total_c, total_p = sum(counted.values()), sum(predicted.values())
        rows.append({"step": i, "k_max": k_max, "counted": counted, "predicted": predicted,
                     "ratio": total_c / total_p if total_p else float("nan")})
        lines.append(f"step {i}" + (f" (K_max {k_max})" if k_max else "") + ": " + ", ".join(
            f"{ph} {counted[ph] / 1e6:.3f} / {predicted[ph] / 1e6:.3f} MB" for ph in phases)
            + f"; total counted {total_c / 1e6:.3f} MB, predicted {total_p / 1e6:.3f} MB, ratio "
              f"{rows[-1]['ratio']:.3f}")
    mean = sum(r["ratio"] for r in rows) / len(rows)
    ok = all(abs(r["ratio"] - 1) <= tolerance for r in rows)
    lines.append(f"counted / predicted bytes per rank and step: mean {mean:.3f}, "
                 f"{'within' if ok else 'NOT within'} {tolerance:.0%} on every step")
    return rows, "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds_config", action="append", default=[], help="a DeepSpeed config to measure (repeatable)")
    p.add_argument("--case", action="append", nargs="+", default=[], metavar=("DS_CONFIG", "KEY=VALUE"),
                   help="a DeepSpeed config and overrides of its own, e.g. --case ds_configs/zero3.json "
                        "objective.fixed_wavefront=true (repeatable; all cases run in one launch)")
    p.add_argument("--config", default=str(REPO / "launchers" / "configs" / "eco_rna_demo.yaml"),
                   help="a run config file (default: the Eco-RNA demo)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every case")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is left out (at least 2)")
    p.add_argument("--shards", default=None, help="shard directory (default: the shipped sample, sharded)")
    p.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cases", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    cases = [(d, []) for d in args.ds_config] + [(c[0], c[1:]) for c in args.case]
    if not cases:
        print("error: give --ds_config or --case", file=sys.stderr)
        return 2
    if args.steps < 2 or args.nproc < 2:
        print("error: --steps and --nproc must be at least 2", file=sys.stderr)
        return 2
    for d, _ in cases:
        if not Path(d).is_file():
            print(f"error: {d}: no such DeepSpeed config", file=sys.stderr)
            return 2
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="comm_volume-")
    results, ok = [], True
    for data in measure(args, cases):
        rows, table = compare(data, args.config, args.tolerance)
        print(table)
        ok = ok and all(abs(r["ratio"] - 1) <= args.tolerance for r in rows)
        results.append({"ds_config": data["ds_config"], "overrides": data["overrides"], "rows": rows,
                        "counted": data["steps"]})
    (Path(args.out) / "comm_volume.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    from pipeline.train import exit_process  # after DeepSpeed: see its docstring

    exit_process(main())
