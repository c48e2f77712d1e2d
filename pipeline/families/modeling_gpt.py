"""RecursiveGPT's and StandardGPT's Hugging Face classes: RecursiveGPTConfig ("recursive_gpt") /
RecursiveGPTForCausalLM and StandardGPTConfig ("standard_gpt") / StandardGPTForCausalLM (AutoModelForCausalLM,
generate). Registered by pipeline/hf.py, and shipped in every export with the modules they import
(pipeline/hf_code.py); this module imports torch, transformers and pipeline.models only."""
from __future__ import annotations

from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutput

from pipeline.families.hf_base import PipelineConfig, Wrapped, cross_entropy
from pipeline.models.recursive_gpt import RecursiveGPT, StandardGPT
from pipeline.models.recursive_gpt import RecursiveGPTConfig as RecursiveModelConfig
from pipeline.models.recursive_gpt import StandardGPTConfig as StandardModelConfig


class RecursiveGPTConfig(PipelineConfig):
    """pipeline.models.recursive_gpt.RecursiveGPTConfig's fields (depth: ``recurrence``, or forward's ``depth``).
    Token ids: the export's sentencepiece model (tokenizer.model, and tokenizer.json for AutoTokenizer); pad, bos and
    eos ids are pipeline.data.tokenizer's SPM_* (written by the export, gpt_hf.config_kwargs)."""

    model_type = "recursive_gpt"
    model_config_cls = RecursiveModelConfig

    def __init__(self, **kwargs):
        kwargs.setdefault("tie_word_embeddings", False)  # untied factorized maps
        kwargs.setdefault("use_cache", False)  # no KV cache: generate recomputes the prefix every step
        super().__init__(**kwargs)


class StandardGPTConfig(RecursiveGPTConfig):
    model_type = "standard_gpt"
    model_config_cls = StandardModelConfig


class _CausalLM(Wrapped, GenerationMixin):
    net_cls: type = None

    def __init__(self, config):
        super().__init__(config)
        self._adopt(self.net_cls(config.model_config()))
        self.post_init()

    def get_output_embeddings(self):
        return None  # untied; nothing for transformers to tie

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # no KV cache (below): generate must not build one

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No KV cache: every step runs the whole sequence so far (the pipeline model has no incremental path)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids, attention_mask=None, depth=None, labels=None, return_dict=None, **kwargs):
        """input_ids, attention_mask: [B, L] (rows right-padded, or unpadded); depth: RecursiveGPT's R' (default
        ``recurrence``); labels: [B, L] (-100 ignored), shifted inside as transformers does -> CausalLMOutput with
        next-token logits [B, L, V]. generate: prompts of one length (no padding), no cache."""
        logits = self.net(input_ids, None if attention_mask is None else attention_mask.bool(), depth)
        loss = None
        if labels is not None:
            loss = cross_entropy(logits[:, :-1], labels[:, 1:])
        if return_dict is False:
            return tuple(t for t in (loss, logits) if t is not None)
        return CausalLMOutput(loss=loss, logits=logits)


class RecursiveGPTForCausalLM(_CausalLM):
    config_class = RecursiveGPTConfig
    net_cls = RecursiveGPT


class StandardGPTForCausalLM(_CausalLM):
    config_class = StandardGPTConfig
    net_cls = StandardGPT
