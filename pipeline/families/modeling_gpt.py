"""RecursiveGPT's and StandardGPT's Hugging Face classes: RecursiveGPTConfig ("recursive_gpt") /
RecursiveGPTForCausalLM / RecursiveGPTModel and StandardGPTConfig ("standard_gpt") / StandardGPTForCausalLM /
StandardGPTModel (AutoModelForCausalLM with generate; AutoModel, the base model the BabyLM pipeline's fine-tuning
reads). Registered by pipeline/hf.py, and shipped in every export with the modules they import (pipeline/hf_code.py);
this module imports torch, transformers and pipeline.models only.

The configs carry, beside the pipeline model config's fields, the names the ecosystem reads (written into
config.json, derived from those fields and never set on their own): ``hidden_size`` (d_model), ``num_attention_heads``
(n_heads), ``num_hidden_layers`` (blocks a token passes at the default depth: ``recurrence`` applications of the
shared block, or n_layers), ``vocab_size`` (a model field already) and ``max_position_embeddings`` (the trained
context, data.context_length: lm-evaluation-harness sizes its windows by it and would assume 2,048 without it).

Depth of a RecursiveGPT: ``recurrence`` is the depth forward runs at by default. An export sets it to the depth the
run was trained at (objective.train_depth, else the model's R), and ``from_pretrained(EXPORT, recurrence=K)`` or
forward's ``depth`` choose another. ``trained_recurrence`` is the model's own R, the number of per-step norm sets its
weights hold (structure, not a choice); exports written before it existed have only ``recurrence`` (= R).
"""
from __future__ import annotations

import dataclasses

from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from pipeline.families.hf_base import PipelineConfig, Wrapped, cross_entropy
from pipeline.models.recursive_gpt import RecursiveGPT, StandardGPT
from pipeline.models.recursive_gpt import RecursiveGPTConfig as RecursiveModelConfig
from pipeline.models.recursive_gpt import StandardGPTConfig as StandardModelConfig

DERIVED = ("hidden_size", "num_attention_heads", "num_hidden_layers")  # config.json names computed from the fields


class _GPTConfig(PipelineConfig):
    """The fields of a pipeline decoder config, the ecosystem's names (module docstring) and the trained context
    ``max_position_embeddings`` (None in exports written before it was recorded). Token ids: the export's
    sentencepiece model (tokenizer.model, and tokenizer.json for AutoTokenizer); pad, bos and eos ids are
    pipeline.data.tokenizer's SPM_* (written by the export, gpt_hf.config_kwargs). ``depth_field``: the field that
    holds the default depth (num_hidden_layers follows it)."""

    depth_field = "n_layers"

    def __init__(self, max_position_embeddings: int | None = None, **kwargs):
        for name in DERIVED:  # config.json holds them for readers of the file; they always follow the fields
            kwargs.pop(name, None)
        kwargs.setdefault("tie_word_embeddings", False)  # untied factorized maps
        kwargs.setdefault("use_cache", False)  # no KV cache: generate recomputes the prefix every step
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)
        self.hidden_size = self.d_model
        self.num_attention_heads = self.n_heads
        self.num_hidden_layers = self.default_depth()

    def default_depth(self) -> int:
        return int(getattr(self, self.depth_field))


class RecursiveGPTConfig(_GPTConfig):
    """pipeline.models.recursive_gpt.RecursiveGPTConfig's fields, ``recurrence`` being the default depth and
    ``trained_recurrence`` the model's R (module docstring)."""

    model_type = "recursive_gpt"
    model_config_cls = RecursiveModelConfig
    depth_field = "recurrence"

    def __init__(self, trained_recurrence: int | None = None, **kwargs):
        self.trained_recurrence = trained_recurrence
        super().__init__(**kwargs)
        if int(self.recurrence) < 1:
            raise ValueError(f"recurrence: the default depth must be >= 1, got {self.recurrence}")

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == self.depth_field and "num_hidden_layers" in self.__dict__:  # a depth set after loading
            super().__setattr__("num_hidden_layers", int(value))

    def model_config(self):
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self.model_config_cls)}
        if self.trained_recurrence is not None:
            fields["recurrence"] = self.trained_recurrence  # the weights' norm sets; recurrence is only a default
        return self.model_config_cls(**fields)

    @classmethod
    def from_model_config(cls, model_cfg, recurrence: int | None = None, **kwargs):
        """``recurrence``: the default depth (None: the model's R)."""
        fields = dataclasses.asdict(model_cfg)
        fields["trained_recurrence"] = fields["recurrence"]
        if recurrence is not None:
            fields["recurrence"] = int(recurrence)
        return cls(**fields, **kwargs)


class StandardGPTConfig(_GPTConfig):
    model_type = "standard_gpt"
    model_config_cls = StandardModelConfig

    @classmethod
    def from_model_config(cls, model_cfg, recurrence: int | None = None, **kwargs):
        """``recurrence``: a standard stack has one depth, its n_layers (anything else is refused)."""
        if recurrence is not None and int(recurrence) != model_cfg.n_layers:
            raise ValueError(f"a standard decoder runs its {model_cfg.n_layers} layers, got depth {recurrence}")
        return super().from_model_config(model_cfg, **kwargs)


def key_mask(attention_mask):
    """[B, L] bool, True at real tokens, from the attention masks callers pass: [B, L] (right-padded rows, the
    pipeline's layout) or a causal [B, L, L] one such as the BabyLM fine-tuning's --causal mask
    (padding mask repeated per query and lower-triangular): a key is real when any query may attend to it. The
    model is causal by construction, so the triangle itself adds nothing."""
    if attention_mask is None:
        return None
    m = attention_mask.bool()
    return m.any(1) if m.dim() == 3 else m


class _Base(Wrapped):
    net_cls: type = None

    def __init__(self, config):
        super().__init__(config)
        self._adopt(self.net_cls(config.model_config()))
        self.post_init()

    def _depth(self, depth):
        """forward's ``depth``, else the config's default (recurrence, or the standard stack's None)."""
        if depth is not None:
            return depth
        return self.config.recurrence if isinstance(self.config, RecursiveGPTConfig) else None


class _CausalLM(_Base, GenerationMixin):
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
        ``config.recurrence``); labels: [B, L] (-100 ignored), shifted inside as transformers does -> CausalLMOutput
        with next-token logits [B, L, V]. generate: prompts of one length (no padding), no cache."""
        logits = self.net(input_ids, key_mask(attention_mask), self._depth(depth))
        loss = None
        if labels is not None:
            loss = cross_entropy(logits[:, :-1], labels[:, 1:])
        if return_dict is False:
            return tuple(t for t in (loss, logits) if t is not None)
        return CausalLMOutput(loss=loss, logits=logits)


class _Model(_Base):
    """The base model (AutoModel): last_hidden_state [B, L, H], the final-normed states the LM head reads. The
    head's weights are loaded too (one model.safetensors for every class) but not run."""

    def forward(self, input_ids, attention_mask=None, depth=None, return_dict=None, **kwargs):
        hidden = self.net.features(input_ids, key_mask(attention_mask), self._depth(depth))
        if return_dict is False:
            return (hidden,)
        return BaseModelOutput(last_hidden_state=hidden)


class RecursiveGPTForCausalLM(_CausalLM):
    config_class = RecursiveGPTConfig
    net_cls = RecursiveGPT


class StandardGPTForCausalLM(_CausalLM):
    config_class = StandardGPTConfig
    net_cls = StandardGPT


class RecursiveGPTModel(_Model):
    config_class = RecursiveGPTConfig
    net_cls = RecursiveGPT


class StandardGPTModel(_Model):
    config_class = StandardGPTConfig
    net_cls = StandardGPT
