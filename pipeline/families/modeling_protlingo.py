"""ProtLingo's Hugging Face classes: ProtLingoConfig ("protlingo") and ProtLingoForMaskedLM (AutoModelForMaskedLM).
Registered by pipeline/hf.py, and shipped in every export with the modules they import (pipeline/hf_code.py); this
module imports torch, transformers and pipeline.models only. A ProtLingo without MoE and memory (any dense ESM2) is
exported as transformers' own EsmForMaskedLM instead (protlingo_hf.py)."""
from __future__ import annotations

import torch
from transformers import initialization as hf_init
from transformers.modeling_outputs import MaskedLMOutput

from pipeline.families.hf_base import PipelineConfig, Wrapped, cross_entropy
from pipeline.models.protlingo import LatentNgramMemory, ProtLingo
from pipeline.models.protlingo import ProtLingoConfig as ModelConfig

# transformers' EsmConfig checks this field's type (bool): a ProtLingo config.json read by EsmForMaskedLM.from_pretrained
# is refused with this text instead of loading an ESM-2 with random weights where the MoE and memory were (EsmConfig
# would otherwise accept the file with a warning about the model type).
NOT_AN_ESM = ("no: this is a ProtLingo model (MoE and/or latent memory), not an ESM-2; load it with "
              "AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True)")


class ProtLingoConfig(PipelineConfig):
    """pipeline.models.protlingo.ProtLingoConfig's fields (ESM2 backbone, upcycled MoE, latent N-gram memory).
    Tokenizer: the ESM-2 alphabet (vocab.txt in the export; EsmTokenizer reads it)."""

    model_type = "protlingo"
    model_config_cls = ModelConfig

    def __init__(self, **kwargs):
        kwargs["is_folding_model"] = NOT_AN_ESM
        kwargs.setdefault("pad_token_id", 1)
        kwargs.setdefault("tie_word_embeddings", False)  # the head reads embed.weight itself: one tensor
        super().__init__(**kwargs)


class ProtLingoForMaskedLM(Wrapped):
    config_class = ProtLingoConfig

    def __init__(self, config: ProtLingoConfig):
        super().__init__(config)
        # The reference MoE path (every expert on its own tokens): the one that runs without DeepSpeed.
        self._adopt(ProtLingo(config.model_config()))
        self.post_init()

    def _init_weights(self, module):
        """The memory's non-persistent buffers (never in a checkpoint; transformers leaves them empty after a
        meta-device build) are recomputed; every other tensor is loaded."""
        if isinstance(module, LatentNgramMemory):
            cfg = module.cfg
            radix = 2 ** cfg.memory_bits + 1
            hf_init.copy_(module.radix_powers, radix ** torch.arange(cfg.window, dtype=torch.int64))
            hf_init.copy_(module.bit_values, 2 ** torch.arange(cfg.memory_bits, dtype=torch.int64))

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=None, **kwargs):
        """input_ids, attention_mask: [B, L] (right-padded) -> MaskedLMOutput(loss, logits [B, L, V]); the MoE
        auxiliary losses are not part of ``loss`` (the masked-LM cross-entropy)."""
        logits = self.net(input_ids, self._mask(input_ids, attention_mask)).logits
        loss = cross_entropy(logits, labels)
        if return_dict is False:
            return tuple(t for t in (loss, logits) if t is not None)
        return MaskedLMOutput(loss=loss, logits=logits)
