"""ProtLingo's Hugging Face export (tools/convert_checkpoint.py): the classes of modeling_protlingo.py with the ESM-2
tokenizer; a ProtLingo without MoE and memory (any dense ESM2) is written as transformers' own EsmForMaskedLM
instead ("esm" format: esm_config, esm_state_dict; vocab.txt for EsmTokenizer), which plain transformers loads."""
from __future__ import annotations

import torch

from pipeline.families.base import HFExport
from pipeline.families.modeling_protlingo import ProtLingoConfig, ProtLingoForMaskedLM
from pipeline.families.protlingo import ESM_FORMAT
from pipeline.models import protlingo as model


def is_dense_esm(model_cfg) -> bool:
    """A ProtLingo config without MoE and memory is an ESM2: exported as transformers' EsmForMaskedLM."""
    return not model_cfg.moe_layers and not model_cfg.memory_layers


def esm_config(model_cfg, max_position_embeddings: int = 1026):
    """transformers' EsmConfig of a dense ProtLingo config (the inverse of protlingo.config_from_hf)."""
    from transformers import EsmConfig

    if not is_dense_esm(model_cfg):
        raise ValueError("model.moe_layers / model.memory_layers: an EsmForMaskedLM has neither")
    return EsmConfig(vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.d_model,
                     num_hidden_layers=model_cfg.n_layers, num_attention_heads=model_cfg.n_heads,
                     intermediate_size=model_cfg.d_ff, layer_norm_eps=model_cfg.layer_norm_eps,
                     rope_theta=model_cfg.rope_theta, position_embedding_type="rotary",
                     token_dropout=model_cfg.token_dropout, mask_token_id=model_cfg.mask_token_id,
                     pad_token_id=model_cfg.pad_token_id, emb_layer_norm_before=False, hidden_act="gelu",
                     max_position_embeddings=max_position_embeddings, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, tie_word_embeddings=True)


def esm_state_dict(state: dict, model_cfg) -> dict[str, torch.Tensor]:
    """A dense ProtLingo state dict -> EsmForMaskedLM's names (protlingo._hf_names, the map hf_to_protlingo
    inverts). The decoder is tied to the embedding (not written); the contact head, which ProtLingo does not train,
    is written as zeros (regression [1, n_layers * n_heads], bias [1]), and the rotary inverse frequencies
    [head_dim / 2] as transformers computes them, so that loading initializes nothing."""
    from transformers.models.esm.modeling_esm import EsmRotaryEmbedding

    names = model._hf_names(model_cfg.n_layers)
    extra = sorted(set(state) - set(names))
    if extra:
        raise ValueError(f"not a dense ProtLingo state dict: {extra[:3]} have no EsmForMaskedLM name")
    out = {names[k]: v for k, v in state.items()}
    dtype = state["embed.weight"].dtype
    out["esm.contact_head.regression.weight"] = torch.zeros(1, model_cfg.n_layers * model_cfg.n_heads, dtype=dtype)
    out["esm.contact_head.regression.bias"] = torch.zeros(1, dtype=dtype)
    out["esm.rotary_embeddings.inv_freq"] = EsmRotaryEmbedding.compute_default_rope_parameters(
        esm_config(model_cfg))[0]  # fp32 whatever the export's dtype, as transformers keeps it
    return out


def esm_vocab() -> list[str]:
    """EsmTokenizer's vocab.txt lines: the ESM-2 alphabet in id order (pipeline.data.protein_tokenizer.VOCAB)."""
    from pipeline.data.protein_tokenizer import VOCAB

    return list(VOCAB)


def write_tokenizer(out, cfg=None, spm=None) -> None:
    """The ESM-2 alphabet as EsmTokenizer reads it: vocab.txt, tokenizer_config.json."""
    from pathlib import Path

    from transformers import EsmTokenizer

    out = Path(out)
    (out / "vocab.txt").write_text("\n".join(esm_vocab()) + "\n")
    EsmTokenizer(str(out / "vocab.txt")).save_pretrained(str(out))


def foreign(cfg):
    """A dense ProtLingo is written as transformers' EsmForMaskedLM (positions for the context and <cls>/<eos>)."""
    if not is_dense_esm(cfg.model):
        return None
    return ESM_FORMAT, esm_config(cfg.model, max(1026, cfg.data.context_length + 2))


EXPORT = HFExport(config_cls=ProtLingoConfig, models=(("AutoModelForMaskedLM", ProtLingoForMaskedLM),),
                  architectures=("ProtLingoForMaskedLM",), modeling="pipeline.families.modeling_protlingo",
                  foreign=foreign, to_foreign=esm_state_dict,
                  foreign_usage=("from transformers import AutoTokenizer, EsmForMaskedLM  # a standard ESM-2 directory",
                                 "model = EsmForMaskedLM.from_pretrained(\"EXPORT_DIR\")",
                                 "tokenizer = AutoTokenizer.from_pretrained(\"EXPORT_DIR\")"),
                  write_tokenizer=write_tokenizer, example="MKTAYIAKQRQISFVKSH<mask>SRQ")
