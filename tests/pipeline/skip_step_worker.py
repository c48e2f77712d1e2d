"""Worker for test_skipped_update_keeps_the_schedule: a real DeepSpeed engine (1 rank, gloo) takes a step with no
supervised token (skipped), then normal steps; prints the lr in force at each step and whether the weights moved."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.config import load_config  # noqa: E402
from pipeline.objectives.masking import IGNORE_INDEX  # noqa: E402
from token_norm_worker import SMALL, microbatches  # noqa: E402


def main():
    import dataclasses

    import deepspeed

    from pipeline.train import init_distributed, lr_lambda, param_groups, train_step
    from pipeline.families import get_family

    init_distributed()
    cfg = load_config(None, SMALL + ["optim.warmup_steps=4", "train.max_steps=8", "optim.lr=0.01"])
    family = get_family("eco_rna")
    torch.manual_seed(0)
    model = family.build_model(cfg.model)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim), lr=cfg.optim.lr)
    ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "train_batch_size": 3,
          "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    # No torch scheduler, as in the Trainer: it sets each step's lr from the step itself (Trainer.set_lr).
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    batches = microbatches(sys.argv[1], cfg, n=3)
    empty = dataclasses.replace(batches[0], labels=torch.full_like(batches[0].labels, IGNORE_INDEX))
    want = [cfg.optim.lr * lr_lambda(cfg)(s) for s in range(3)]
    lrs, skipped, changed = [], [], []
    for step, batch in enumerate([empty, batches[1], batches[2]]):
        for group in opt.param_groups:
            group["lr"] = want[step]
        before = [p.detach().clone() for p in model.parameters()]
        skipped.append(train_step(engine, family, cfg, [batch], step, torch.device("cpu"))["skipped"])
        lrs.append(opt.param_groups[0]["lr"])  # neither train_step nor DeepSpeed may have moved it
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))
    print(json.dumps({"lrs": lrs, "want": want, "skipped": skipped, "changed": changed}))


if __name__ == "__main__":
    main()
    from pipeline.train import exit_process  # after DeepSpeed: see its docstring

    exit_process(0)
