"""RecursiveGPT's and StandardGPT's Hugging Face exports (tools/convert_checkpoint.py): the classes of modeling_gpt.py,
the sentencepiece ids in config.json, and the tokenizer as a transformers fast tokenizer (tokenizer.json, converted
from the run's sentencepiece model; pipeline/data/hf_tokenizers.py)."""
from __future__ import annotations

from pipeline.families.base import HFExport
from pipeline.families.modeling_gpt import (RecursiveGPTConfig, RecursiveGPTForCausalLM, StandardGPTConfig,
                                            StandardGPTForCausalLM)


def config_kwargs(cfg, depth: int | None) -> dict:
    from pipeline.data.tokenizer import SPM_BOS_ID, SPM_EOS_ID, SPM_PAD_ID

    return {"pad_token_id": SPM_PAD_ID, "bos_token_id": SPM_BOS_ID, "eos_token_id": SPM_EOS_ID}


def write_tokenizer(out, cfg, spm=None) -> None:
    """tokenizer.json and its config, converted from the run's sentencepiece model (nothing without one:
    --no-tokenizer)."""
    from pipeline.data.hf_tokenizers import sentencepiece_tokenizer

    if spm is not None:
        sentencepiece_tokenizer(spm).save_pretrained(str(out))


_COMMON = dict(modeling="pipeline.families.modeling_gpt", config_kwargs=config_kwargs, write_tokenizer=write_tokenizer,
               example="Once upon a time")
RECURSIVE_EXPORT = HFExport(config_cls=RecursiveGPTConfig, models=(("AutoModelForCausalLM", RecursiveGPTForCausalLM),),
                            architectures=("RecursiveGPTForCausalLM",), **_COMMON)
STANDARD_EXPORT = HFExport(config_cls=StandardGPTConfig, models=(("AutoModelForCausalLM", StandardGPTForCausalLM),),
                           architectures=("StandardGPTForCausalLM",), **_COMMON)
