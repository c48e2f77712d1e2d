"""Worker for test_expert_parallel: real DeepSpeed steps of a tiny ProtLingo with expert parallelism.

Rank r of step s trains on microbatches 2r and 2r+1 of ``step_batches(s, world)`` through the engine's own
``train_step`` (exact token normalization, gradient clipping from the ds_config), SGD on the engine's named groups
split by ``optimizer_groups``. After every step each rank writes its parameters under their global names (its local
experts renamed to global ids); then the engine saves a checkpoint, a second engine built from a different
initialization loads it, and each rank checks its own experts, router and shared expert came back bit for bit and
that one more step on both engines agrees bit for bit.
"""
import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from pipeline.config import load_config  # noqa: E402
from pipeline.data.batch import collate  # noqa: E402
from pipeline.data.protein_tokenizer import ProteinTokenizer  # noqa: E402
from pipeline.families import get_family  # noqa: E402

MODEL = ["family=protlingo", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64",
         "model.moe_layers=[0,1]", "model.num_experts=4", "model.memory_layers=[1]", "model.attn_backend=sdpa",
         "data.context_length=48", "objective.lambda_aux=0.05", "objective.lambda_z=0.01", "optim.lr=0.5",
         "optim.weight_decay=0.01"]
CLIP = 0.5  # binds on the first steps: the clipped update checks the global gradient norm over every expert
EXPERT = re.compile(r"(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)")


def run_config():
    return load_config(None, MODEL)


def initial_model(cfg, seed=0):
    """Random init, then every routed expert a copy of expert 0 (upcycling): experts differ only by training."""
    torch.manual_seed(seed)
    model = get_family("protlingo").build_model(cfg.model)
    with torch.no_grad():
        for layer in model.layers:
            experts = layer.ffn.experts
            for e in experts[1:]:
                e.load_state_dict(experts[0].state_dict())
    return model


def step_batches(cfg, step: int, world: int, micro=2, batch=3):
    """world x micro microbatches of ``batch`` random proteins of 8-60 residues (cropped to the context), framed and
    masked by the ProtLingo transform: unequal supervised-token counts."""
    transform = get_family("protlingo").make_transform(cfg)
    rng = np.random.default_rng(1000 + step)
    out = []
    for j in range(world * micro):
        samples = []
        for i in range(batch):
            tokens = rng.choice(ProteinTokenizer.residue_ids(), size=int(rng.integers(8, 61))).astype(np.uint8)
            sample = transform(tokens, np.random.default_rng([step, j, i]))
            samples.append({**sample, "sample_id": f"s{step}/{j}/{i}"})
        out.append(collate(samples, pad_id=get_family("protlingo").pad_id))
    return out


def make_optimizer(model, cfg):
    from pipeline.train import param_groups
    from pipeline.parallel import optimizer_groups

    return torch.optim.SGD(optimizer_groups(model, param_groups(model, cfg.optim)), lr=cfg.optim.lr)


def global_state(module, fp32: bool = False) -> dict:
    """This rank's parameters under the single-process names; ``fp32``: the ZeRO fp32 masters (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from pipeline.parallel.expert_parallel import ExpertParallelMoE

    offsets = {n: m.ep_rank * m.num_local_experts for n, m in module.named_modules()
               if isinstance(m, ExpertParallelMoE)}
    out = {}
    for n, p in module.named_parameters():
        t = safe_get_full_fp32_param(p) if fp32 else p
        m = EXPERT.match(n)
        if m:
            layer = m.group(1)[:-len(".deepspeed_moe.experts.deepspeed_experts.")]
            n = f"{m.group(1)}{int(m.group(2)) + offsets.get(layer, 0)}{m.group(3)}"
        out[n] = t.detach().clone().float()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--ep", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=None)
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist

    from pipeline.train import init_distributed, shutdown_distributed, train_step
    from pipeline.parallel.expert_parallel import apply_expert_parallel

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    cfg = run_config()
    family = get_family("protlingo")
    ds_config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "train_batch_size": 6 * world,
                 "gradient_clipping": CLIP, "zero_optimization": {"stage": args.stage},
                 "bf16": {"enabled": args.bf16}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}

    def build(seed):
        model = initial_model(cfg, seed)
        apply_expert_parallel(model, args.ep, args.stage)
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, cfg), config=ds_config)
        return engine

    engine = build(0)
    cpu = torch.device("cpu")
    recs = []
    for step in range(args.steps):
        batches = step_batches(cfg, step, world)[2 * rank: 2 * rank + 2]
        recs.append(train_step(engine, family, cfg, batches, step=step, device=cpu))
        torch.save(global_state(engine.module), out / f"rank{rank}_step{step + 1}.pt")
    if args.bf16:
        torch.save(global_state(engine.module, fp32=True), out / f"rank{rank}_fp32.pt")
    engine.save_checkpoint(str(out / "ckpt"), tag="final", client_state={}, save_latest=False)
    dist.barrier()

    # Resume: another initialization, then the checkpoint; every rank's own experts must come back exactly.
    resumed = build(7)
    path, _ = resumed.load_checkpoint(str(out / "ckpt"), tag="final")
    assert path is not None
    # The memory's ``addressed`` flags are each rank's own usage record; the checkpoint holds rank 0's, which every
    # rank continues from after a resume (pipeline/models/protlingo.py): compared on rank 0 only.
    def states(module):
        return {k: v for k, v in module.state_dict().items() if rank == 0 or not k.endswith(".addressed")}

    before = states(engine.module)
    after = states(resumed.module)
    restored = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    batches = step_batches(cfg, args.steps, world)[2 * rank: 2 * rank + 2]
    rec_a = train_step(engine, family, cfg, batches, step=args.steps, device=cpu)
    rec_b = train_step(resumed, family, cfg, batches, step=args.steps, device=cpu)
    a, b = states(engine.module), states(resumed.module)
    same_next = rec_a["loss"] == rec_b["loss"] and all(torch.equal(a[k], b[k]) for k in a)
    summary = {"restored": restored, "same_next_step": same_next, "recs": recs,
               "local_experts": [n for n in before if ".deepspeed_experts." in n]}
    (out / f"rank{rank}.json").write_text(json.dumps(summary))
    shutdown_distributed()


if __name__ == "__main__":
    main()
    from pipeline.train import exit_process  # after DeepSpeed: see its docstring

    exit_process(0)
