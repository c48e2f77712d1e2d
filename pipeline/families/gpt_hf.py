"""RecursiveGPT's and StandardGPT's Hugging Face exports (tools/convert_checkpoint.py): the classes of modeling_gpt.py
(AutoModelForCausalLM and AutoModel), config.json's sentencepiece ids, trained context and default depth (the depth
the run trained at), and the tokenizer as a transformers fast tokenizer (tokenizer.json, converted from the run's
sentencepiece model; pipeline/data/hf_tokenizers.py)."""
from __future__ import annotations

from pipeline.families.base import HFExport
from pipeline.families.modeling_gpt import (RecursiveGPTConfig, RecursiveGPTForCausalLM, RecursiveGPTModel,
                                            StandardGPTConfig, StandardGPTForCausalLM, StandardGPTModel)


def config_kwargs(cfg, depth: int | None) -> dict:
    """The sentencepiece ids, the trained context (max_position_embeddings = data.context_length) and, for a
    RecursiveGPT, the default depth: ``depth``, else the family's Depth.default (the depth the run trained at)."""
    from pipeline.data.tokenizer import SPM_BOS_ID, SPM_EOS_ID, SPM_PAD_ID
    from pipeline.families import get_family

    out = {"pad_token_id": SPM_PAD_ID, "bos_token_id": SPM_BOS_ID, "eos_token_id": SPM_EOS_ID,
           "max_position_embeddings": int(cfg.data.context_length)}
    depth = depth or get_family(cfg.family).depth.default(cfg)
    if depth is not None:
        out["recurrence"] = int(depth)
    return out


def card(hf_cfg) -> tuple[list, list]:
    lines = [f"- trained context (config.json max_position_embeddings): {hf_cfg.max_position_embeddings} tokens"]
    if isinstance(hf_cfg, RecursiveGPTConfig):
        lines.append(f"- default depth (config.json recurrence): {hf_cfg.recurrence} applications of the shared block "
                     f"(the depth the run trained at; the model's R is {hf_cfg.trained_recurrence})")
        return lines, ["out = model(**tokenizer(\"Once upon a time\", return_tensors=\"pt\"), depth=8)  # any depth",
                       "deeper = AutoModelForCausalLM.from_pretrained(\"EXPORT_DIR\", trust_remote_code=True, "
                       "recurrence=8)"]
    return lines, []


def write_tokenizer(out, cfg, spm=None) -> None:
    """tokenizer.json and its config, converted from the run's sentencepiece model (nothing without one:
    --no-tokenizer)."""
    from pipeline.data.hf_tokenizers import sentencepiece_tokenizer

    if spm is not None:
        sentencepiece_tokenizer(spm, model_max_length=int(cfg.data.context_length)).save_pretrained(str(out))


_COMMON = dict(modeling="pipeline.families.modeling_gpt", config_kwargs=config_kwargs, write_tokenizer=write_tokenizer,
               example="Once upon a time", card=card)
# AutoModel: the base model, which the BabyLM pipeline's fine-tuning (GLUE / SuperGLUE) loads and reads
# last_hidden_state of
RECURSIVE_EXPORT = HFExport(config_cls=RecursiveGPTConfig, models=(("AutoModelForCausalLM", RecursiveGPTForCausalLM),
                                                                   ("AutoModel", RecursiveGPTModel)),
                            architectures=("RecursiveGPTForCausalLM",), **_COMMON)
STANDARD_EXPORT = HFExport(config_cls=StandardGPTConfig, models=(("AutoModelForCausalLM", StandardGPTForCausalLM),
                                                                 ("AutoModel", StandardGPTModel)),
                           architectures=("StandardGPTForCausalLM",), **_COMMON)
