"""Worker for test_export_hf: real 2-process trainings of tiny models of every family through the engine
(pipeline.train.Trainer: deepspeed.initialize, AdamW, the real loader on real shards), 2 steps each on one ZeRO
stage, checkpointed by the Trainer as any run is; then the logits of the model the DeepSpeed engine holds after its
last step on a fixed input, computed on every rank through the engine (under ZeRO-3 the parameters are partitioned:
each forward gathers them, a collective) and written by rank 0 to RUN_DIR/engine_logits.pt.

    torchrun --nproc_per_node 2 tests/tools/export_worker.py --stage 3 --out DIR --rna SHARDS --protein SHARDS \
        --text SHARDS [--ep] [--mlflow]

Eco-RNA runs at the export's default depth (pipeline.hf.hf_config: the trained mean depth, rounded) from the
evaluation initial state (state_table, seed 0): the convention its Hugging Face class uses.
"""
import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
CONFIGS = REPO / "launchers" / "configs"

COMMON = ["train.max_steps=2", "train.init_from=null", "train.log_every=1", "checkpoint.every_steps=1000", "train.micro_batch_size=4",
          "optim.warmup_steps=1"]
MODELS = {
    "eco_rna": ("eco_rna_demo.yaml", "rna", ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                                              "model.d_ff=64", "data.context_length=48", "model.attn_backend=sdpa"]),
    "recursive_gpt": ("recursive_gpt_demo.yaml", "text", ["model.vocab_size=320", "model.d_model=16",
                                                          "model.embed_dim=8", "model.n_heads=2", "model.recurrence=2",
                                                          "data.context_length=32"]),
    # MoE (shared + 4 routed experts) and the latent N-gram memory: ProtLingoForMaskedLM
    "protlingo": ("protlingo_demo.yaml", "protein", ["model.d_model=32", "model.n_heads=2", "model.n_layers=2",
                                                     "model.d_ff=64", "model.moe_layers=[1]",
                                                     "model.moe_shared_hidden=32", "model.memory_layers=[0]",
                                                     "model.memory_latent=16", "data.context_length=48"]),
    # the dense recipe (no MoE, no memory: an ESM2), exported as transformers' EsmForMaskedLM
    "esm2": ("esm2_continued.yaml", "protein", ["model.d_model=32", "model.n_heads=2", "model.n_layers=2",
                                                "model.d_ff=64", "model.moe_shared_hidden=32", "data.context_length=48"]),
}
EP_MODEL = ("protlingo_ep2", "protlingo", ["model.moe_layers=[0,1]", "train.expert_parallel_size=2"])


def run_config(name: str, out: Path, shards: dict, mlflow: bool = False, extra=()):
    from pipeline.config import load_config

    yaml, data, overrides = MODELS[name]
    tracking = [] if mlflow else ["tracking.enabled=false"]
    return load_config(CONFIGS / yaml, [*overrides, *COMMON, *tracking, *extra, f"run_dir={out}",
                                        f"data.train_shards={shards[data]}"])


def fixed_input(cfg):
    """(input_ids [2, L], attention_mask [2, L] bool): two framed sequences, the second right-padded."""
    if cfg.family == "eco_rna":
        from pipeline.data.tokenizer import NucleotideTokenizer as Tok

        seqs, pad = ["GGCUAGCUAACGUAGCUAGGAUCCGAUA", "ACGUACGGAUUC"], Tok.pad_id
        enc = [Tok(cfg.data.molecule).encode(s, add_special=True) for s in seqs]
    elif cfg.family == "protlingo":
        from pipeline.data.protein_tokenizer import MASK_ID, ProteinTokenizer

        seqs, pad = ["MKTAYIAKQRQISFVKSHFSRQLEERLG", "MSLNAEQKA"], 1
        enc = [ProteinTokenizer().encode(s, add_special=True) for s in seqs]
        enc[0][5] = MASK_ID  # a masked position: token dropout's rescaling is exercised too
    else:
        from pipeline.data.tokenizer import SPM_PAD_ID

        g = torch.Generator().manual_seed(0)
        enc, pad = [torch.randint(4, cfg.model.vocab_size, (n,), generator=g).numpy() for n in (20, 11)], SPM_PAD_ID
    L = max(len(e) for e in enc)
    ids = torch.full((2, L), pad, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.bool)
    for i, e in enumerate(enc):
        ids[i, :len(e)] = torch.as_tensor(e, dtype=torch.long)
        mask[i, :len(e)] = True
    return ids, mask


@torch.no_grad()
def engine_logits(engine, cfg, ids, mask) -> dict:
    if cfg.family == "eco_rna":
        from pipeline.eval.reconstruction import state_table
        from pipeline.hf import hf_config
        from pipeline.models.eco_rna import initial_state

        K = hf_config(cfg).num_loops
        s0 = initial_state(cfg.model, mask, table=state_table(cfg.model, cfg.data.context_length, 0))
        return {"logits": engine(ids, mask, K, s0).logits, "num_loops": K}
    if cfg.family == "protlingo":
        return {"logits": engine(ids, mask).logits}
    return {"logits": engine(ids, mask)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rna", required=True)
    p.add_argument("--protein", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--ep", action="store_true", help="also ProtLingo with expert parallelism 2 (ZeRO-1/2)")
    p.add_argument("--mlflow", action="store_true", help="Eco-RNA tracked in MLflow (sqlite in its run dir)")
    p.add_argument("--local_rank", type=int, default=None)
    args = p.parse_args()

    import torch.distributed as dist

    from pipeline.train import Trainer, init_distributed, shutdown_distributed

    init_distributed()
    shards = {"rna": args.rna, "protein": args.protein, "text": args.text}
    runs = [(name, name, []) for name in MODELS] + ([EP_MODEL] if args.ep else [])
    ds_config = str(REPO / "ds_configs" / f"zero{args.stage}.json")
    for run_name, model, extra in runs:
        cfg = run_config(model, args.out / run_name, shards, args.mlflow and model == "eco_rna", extra)
        trainer = Trainer(cfg, ds_config)
        try:
            trainer.setup()
            trainer.fit()
            trainer.engine.eval()
            ids, mask = fixed_input(cfg)
            result = engine_logits(trainer.engine, cfg, ids, mask)  # every rank: a collective under ZeRO-3 and EP
        finally:
            trainer.lock.release()
        if dist.get_rank() == 0:
            torch.save({**result, "input_ids": ids, "attention_mask": mask}, args.out / run_name / "engine_logits.pt")
        trainer.engine.destroy()
        dist.barrier()
    shutdown_distributed()


if __name__ == "__main__":
    main()
    from pipeline.train import exit_process  # after DeepSpeed: see its docstring

    exit_process(0)
