"""Tiny protein models the protein-task tests evaluate: a random ESM2 written by ``transformers`` (a Hugging Face
directory, what a user of ESM2 has; evaluate.py reads it as it is) and a random ProtLingo with MoE and memory
written as a pipeline export (model.safetensors + config.yaml). No weights can be downloaded here."""
from __future__ import annotations

from pathlib import Path

import torch

from conftest import REPO

FIXTURES = REPO / "tests" / "fixtures"


def esm_config(hidden=32, layers=2, heads=4, ffn=64, init=0.02):
    """``init``: the weights' std (transformers' initializer_range); 0.5 gives attention with a positional pattern
    that a contact head can weigh, 0.02 (ESM's) near-uniform maps."""
    from transformers import EsmConfig

    return EsmConfig(vocab_size=33, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=ffn, max_position_embeddings=1026, position_embedding_type="rotary",
                     token_dropout=True, emb_layer_norm_before=False, mask_token_id=32, pad_token_id=1,
                     layer_norm_eps=1e-5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     initializer_range=init)


def write_hf_esm(out: Path, seed=0, **shape) -> Path:
    """A random EsmForMaskedLM saved with save_pretrained (config.json + model.safetensors, its contact head too)."""
    from transformers import EsmForMaskedLM

    torch.manual_seed(seed)
    EsmForMaskedLM(esm_config(**shape)).eval().save_pretrained(str(out))
    return out


def hf_esm(path: Path):
    """The directory loaded by plain transformers, with eager attention (its attention maps are returned)."""
    from transformers import EsmForMaskedLM

    return EsmForMaskedLM.from_pretrained(str(path), attn_implementation="eager").eval()


TINY_PROTLINGO = ["model.d_model=32", "model.n_layers=3", "model.n_heads=4", "model.d_ff=64",
                  "model.moe_layers=[0,2]", "model.moe_shared_hidden=32", "model.memory_layers=[1]",
                  "model.memory_latent=16", "model.router_init_std=1.0", "data.context_length=128"]


def write_protlingo_export(out: Path, seed=0) -> Path:
    """A random ProtLingo (MoE in blocks 0 and 2, memory before block 1, non-zero memory tables) of the demo config's
    kind, as an export the launchers load."""
    from safetensors.torch import save_file

    from pipeline.config import dump_yaml, load_config
    from pipeline.families import get_family

    cfg = load_config(REPO / "launchers/configs/protlingo_demo.yaml", [*TINY_PROTLINGO, f"run_dir={out / 'run'}"])
    torch.manual_seed(seed)
    model = get_family(cfg.family).build_model(cfg.model)
    with torch.no_grad():
        for mem in model.memory.values():
            mem.tables.normal_(0, 0.5)
            mem.conv.weight.normal_(0, 0.3)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.yaml").write_text(dump_yaml(cfg))
    return out
