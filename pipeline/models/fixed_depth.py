"""Fixed-depth control for Eco-RNA (paper 000, A.6): a conventional masked LM of distinct blocks run once.

Same block, tokenizer, tied head and interface as Eco-RNA; ``d_ff`` is chosen so that the parameter count matches
the recurrent model (launchers/configs/eco_rna_control_stage_a.yaml: 9 blocks, d_ff 3128, within 0.03% of Eco-RNA 80M).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from pipeline.models.eco_rna import EcoRNAConfig, EcoRNAOutput, Stack, TiedEmbedding
from pipeline.models.layers import RMSNorm, init_linear_, residual_std, rope_cache


@dataclass
class FixedDepthConfig(EcoRNAConfig):
    """EcoRNAConfig's fields; ``n_prelude + n_core + n_coda`` distinct blocks run once, recurrence fields unused."""

    def num_params(self) -> int:
        d = self.d_model
        return self.vocab_size * d + self.n_blocks * self.block_params() + d  # tied embedding, blocks, final norm

    @property
    def n_blocks(self) -> int:
        return self.n_prelude + self.n_core + self.n_coda

    def forward_flops(self, depth: int, length: int) -> int:
        return self.n_blocks * self.block_flops(length) + 2 * length * self.d_model * self.vocab_size

    def train_flops(self, depths: list, length: int, backward_window: int, n_anchor_readouts: int = 0) -> int:
        return 3 * len(depths) * self.forward_flops(1, length)


class FixedDepthMLM(nn.Module):
    def __init__(self, cfg: FixedDepthConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TiedEmbedding(cfg.vocab_size, cfg.d_model)
        self.blocks = Stack(cfg, cfg.n_blocks)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        nn.init.normal_(self.embed.weight, 0.0, cfg.init_std)
        init_linear_(self, cfg.init_std, residual_std(cfg.init_std, cfg.n_blocks))

    def logits_at_depths(self, tokens: torch.Tensor, attention_mask: torch.Tensor, depths,
                         init_state=None) -> dict[int, torch.Tensor]:
        """Eco-RNA's depth-sweep interface: one forward; every K gets the same logits [B, L, V]."""
        logits = self(tokens, attention_mask).logits
        return {int(k): logits for k in depths}

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, depths=None, init_state=None, *,
                k_max: int | None = None, backward_window: int | None = None,
                anchor_depth: int | None = None, host_mask: torch.Tensor | None = None,
                token_quantum: int | None = None) -> EcoRNAOutput:
        """Eco-RNA's interface; depth arguments, the host mask and the token quantum are accepted and ignored (there
        is no recurrence, and the padded layout needs no host indices and is not bucketed)."""
        if anchor_depth is not None:
            raise ValueError("the fixed-depth control has no recurrent trajectory: set objective.lambda_anchor=0")
        key_mask = attention_mask.bool()
        x = self.embed(tokens)
        cos_sin = rope_cache(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        h = self.norm(self.blocks(x, cos_sin, key_mask))
        return EcoRNAOutput(logits=self.embed(h, as_head=True), state=h, prev_state=h, anchor_logits=None,
                            anchor_rows=None, row_iterations=0, core_calls=0)
