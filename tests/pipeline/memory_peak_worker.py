"""Measures one training step's peak memory on the CPU for tests/pipeline/test_memory_model.py, in a process of its
own: ``python memory_peak_worker.py CONFIG OUT.json [--set K=V ...]``.

Peak: the process's resident high-water mark (VmHWM, reset through /proc/self/clear_refs before the step) minus its
resident size before the model was built, with glibc returning every block of 64 KiB or more to the system when it
is freed (MALLOC_MMAP_THRESHOLD_, set by the test), so that resident memory follows the live tensors as
torch.cuda.max_memory_allocated does on a GPU. The step is the second on its engine: the first allocates AdamW's
moments, which the memory model counts as states."""
import gc
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main():
    import torch

    from bench.step_proxies import build_engine
    from pipeline.config import load_config
    from pipeline.data.loader import make_loader
    from pipeline.distributed import init_distributed
    from pipeline.train.memory import step_memory
    from pipeline.train.plan import RunPlan
    from pipeline.train.step import train_step

    config, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_config(config, overrides)
    plan = RunPlan(cfg, str(REPO / "ds_configs" / "zero2.json"), resume="never", world_size=1)
    batch = next(make_loader(plan.build_dataset(0), 0))
    init_distributed(600)
    gc.collect()
    base = status("VmRSS")
    engine = build_engine(cfg)
    device = torch.device("cpu")
    train_step(engine, plan.family, cfg, [batch], 1, device)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    train_step(engine, plan.family, cfg, [batch], 2, device)
    peak = status("VmHWM") - base
    model = step_memory(cfg, plan.family, zero_stage=2, world=1, bf16=False)  # Eco-RNA cases: a fixed depth
    tokens = batch.input_ids.numel()
    Path(out).write_text(json.dumps({"measured": peak, "predicted": model.peak(tokens), "tokens": tokens,
                                     "states": model.state_total, "per_token": model.per_token}))


if __name__ == "__main__":
    main()
    from pipeline.train import exit_process

    exit_process(0)
