"""The generic Hugging Face wrappers the families' HF classes are built on (pipeline/families/modeling_*.py): a
PreTrainedConfig carrying a pipeline model config's fields, and a PreTrainedModel adopting a pipeline module's
submodules, so the state-dict names are exactly the pipeline's and ``model.safetensors`` is the one file that
``pipeline.load_pretrained`` and ``from_pretrained`` both read. Registration with the Auto classes and export configs:
pipeline/hf.py."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import PreTrainedConfig, PreTrainedModel


IGNORE_INDEX = -100  # = pipeline.objectives.masking.IGNORE_INDEX and transformers' own label convention


def _fields(model_config_cls) -> list[str]:
    return [f.name for f in dataclasses.fields(model_config_cls)]


class PipelineConfig(PreTrainedConfig):
    """A PreTrainedConfig carrying every field of one pipeline model config dataclass (``model_config_cls``) as an
    attribute of the same name; ``model_config()`` rebuilds (and so validates) the dataclass."""

    model_config_cls: type = None

    def __init__(self, **kwargs):
        defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                    for f in dataclasses.fields(self.model_config_cls)}
        for name, default in defaults.items():
            value = kwargs.pop(name, default)
            setattr(self, name, list(value) if isinstance(value, tuple) else value)
        super().__init__(**kwargs)

    def model_config(self):
        return self.model_config_cls(**{name: getattr(self, name) for name in _fields(self.model_config_cls)})

    @classmethod
    def from_model_config(cls, model_cfg, **kwargs):
        return cls(**dataclasses.asdict(model_cfg), **kwargs)


class Wrapped(PreTrainedModel):
    """A PreTrainedModel whose submodules are those of a pipeline module (same parameter objects, same names)."""

    supports_gradient_checkpointing = False
    _supports_sdpa = True

    def _adopt(self, net: torch.nn.Module):
        object.__setattr__(self, "net", net)  # not a registered child: its children are ours, under their own names
        for name, child in net.named_children():
            self.add_module(name, child)
        if list(net.named_parameters(recurse=False)) or list(net.named_buffers(recurse=False)):
            raise TypeError(f"{type(net).__name__} holds tensors outside its submodules")

    def _init_weights(self, module):
        """The pipeline module initializes itself when built; from_pretrained then loads every tensor. A model with
        non-persistent buffers (never in a checkpoint; transformers leaves them empty after a meta-device build)
        recomputes them in its own override."""

    def get_input_embeddings(self):
        return self.embed

    def _mask(self, input_ids, attention_mask):
        """[B, L] bool, True at real tokens (rows right-padded, the pipeline's layout)."""
        return torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()


def cross_entropy(logits, labels):
    if labels is None:
        return None
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
