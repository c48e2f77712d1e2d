"""Worker for test_token_normalization: one real DeepSpeed optimizer step (SGD, lr 1) on 2 ranks x 2 microbatches,
for each objective in turn (without the auxiliary losses, then with them: a fresh model and engine each, one launch).

Rank r trains on microbatches 2r and 2r+1 of ``microbatches(...)``; rank 0 writes the updated parameters of each
objective's step to ``--out`` as {False: ..., True: ...} (keyed by aux).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.config import load_config  # noqa: E402
from pipeline.data.loader import ShardStream  # noqa: E402
from pipeline.families import get_family  # noqa: E402

SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64", "model.n_prelude=1",
         "model.n_core=2", "model.n_coda=1", "data.context_length=200", "objective.mu_k=3.0",
         "objective.backward_window=2", "objective.anchor_depth=1"]


def run_config(aux: bool):
    weights = ["objective.lambda_fp=0.5", "objective.lambda_anchor=0.7"] if aux else [
        "objective.lambda_fp=0", "objective.lambda_anchor=0"]
    return load_config(None, SMALL + weights)


def microbatches(shards, cfg, n=4):
    """Four microbatches of 3 sequences with unequal supervised-token counts (real Rfam sequences)."""
    ds = ShardStream(shards, rank=0, world_size=1, num_workers=0, micro_batch_size=3, seed=11,
                     transform=get_family("eco_rna").make_transform(cfg), pad_id=0)
    it = iter(ds)
    return [next(it) for _ in range(n)]


def initial_model(cfg):
    torch.manual_seed(0)
    return get_family("eco_rna").build_model(cfg.model)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--shards", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=None)
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist

    from pipeline.train import init_distributed, shutdown_distributed, train_step

    init_distributed()
    rank = dist.get_rank()
    family = get_family("eco_rna")
    out = {}
    for aux in (False, True):
        cfg = run_config(aux)
        model = initial_model(cfg)
        ds_config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "train_batch_size": 12,
                     "gradient_clipping": 0.0, "zero_optimization": {"stage": args.stage},
                     "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          config=ds_config)
        batches = microbatches(args.shards, cfg)[2 * rank: 2 * rank + 2]
        rec = train_step(engine, family, cfg, batches, step=0, device=torch.device("cpu"))
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=args.stage == 3):
            out[aux] = {"state": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}, "rec": rec}
    if rank == 0:
        torch.save(out, args.out)
    shutdown_distributed()


if __name__ == "__main__":
    main()
    from pipeline.train import exit_process  # after DeepSpeed: see its docstring

    exit_process(0)
