"""Paper 003: the recursive causal decoder (RecursiveGPT, one shared block applied R times) and its standard baseline
(StandardGPT, n_layers distinct blocks), causal LM on sentencepiece text."""
from __future__ import annotations

from pipeline.data.tokenizer import SPM_PAD_ID
from pipeline.families.base import (Activations, Depth, Family, Proxies, Scaling, layer_count, norm_extra,
                                    objective_validation, register_family, sentencepiece_tokenizer)
from pipeline.models.recursive_gpt import (DecoderBlock, RecursiveGPT, RecursiveGPTConfig, StandardGPT,
                                           StandardGPTConfig)
from pipeline.objectives import causal_lm


def recurrence_depth(cfg) -> tuple[int, str]:
    """Depth.trained of RecursiveGPT: ``objective.train_depth`` or its recurrence R."""
    td, r = cfg.objective.train_depth, cfg.model.recurrence
    return (int(td), f"objective.train_depth {td}") if td else (r, f"model.recurrence {r}")


def _decoder_activations(n):
    """Bytes per token a decoder keeps (tests/pipeline/test_memory_model.py holds them to the saved tensors), with
    ``n(cfg, k_max)`` differentiated blocks. A block: its input, the normalized input, raw and rotated q and k, v,
    SDPA's output, the gated heads (o_proj's input), the residual sum, the normalized MLP input, the MLP's two d_ff
    (the up projection, GELU's output); the mask SDPA makes for packed documents or padding (L a token); fp32: the
    two norms' and the per-head QK norms' rstd, SDPA's log-sum-exp, the head gates. Outside: token ids, the
    factorized embedding's E-wide output, the final norm, the head's input (and its E-wide projection), the fp32
    log-softmax over the vocabulary."""
    def activations(cfg, a: int, k_max: float | None) -> Activations:
        m = cfg.model
        d, H, L, fused = m.d_model, m.n_heads, cfg.data.context_length, cfg.train.fused_norm
        block = (11 * d + 2 * m.d_ff + L) * a + (2 + 4 * H) * 4 + norm_extra(fused, a) * 4 * d
        e = m.e * a if m.factorized else 0
        other = 8 + 2 * e + 2 * d * a + 4 + 4 * m.vocab_size + norm_extra(fused, a) * d
        return Activations(block=block, blocks=n(cfg, k_max), block_input=d * a, other=other)

    return activations


def narrow_twin(cfg) -> list[str]:
    """Proxies.narrow: head_dim 8, MLP width 128 (mlp_ratio 16 / n_heads), E = 4 n_heads when factorized (E < H
    kept); heads, steps or layers, norms and the vocabulary kept."""
    m = cfg.model
    return [f"model.d_model={8 * m.n_heads}", f"model.mlp_ratio={16 / m.n_heads!r}",
            f"model.embed_dim={4 * m.n_heads if m.factorized else 'null'}"]


_COMMON = dict(objective_cls=causal_lm.CausalLMObjectiveConfig, make_transform=causal_lm.make_transform,
               plan=causal_lm.plan, loss=causal_lm.loss, tokenizer="sentencepiece",
               make_tokenizer=sentencepiece_tokenizer, text=True, pad_id=SPM_PAD_ID, packable=True,
               blocks=(DecoderBlock,), validate=objective_validation(causal_lm.loss, causal_lm.plan, "lm_loss"))

RECURSIVE_GPT = register_family(Family(
    name="recursive_gpt", config_cls=RecursiveGPTConfig, build_model=RecursiveGPT,
    # evaluation and the export default to the depth the run trained at (objective.train_depth, else R)
    depth=Depth(selectable=True, trained=recurrence_depth, sweep=lambda cfg: [recurrence_depth(cfg)[0]],
                default=lambda cfg: recurrence_depth(cfg)[0]),
    # the shared block runs R times, every one differentiated; each step's norms once
    scaling=Scaling(activations=_decoder_activations(lambda cfg, k_max: k_max or recurrence_depth(cfg)[0]),
                    depth_law=lambda cfg, rows: (float(cfg.model.recurrence), [(cfg.model.recurrence, 1.0)]),
                    module_calls=lambda cfg, k_max: {"block": (k_max, k_max)},
                    train_flops=lambda cfg, pmf: (3 * cfg.model.forward_flops(length=cfg.data.context_length,
                                                                              depth=pmf[0][0]), 0.0)),
    hf="pipeline.families.gpt_hf:RECURSIVE_EXPORT",
    proxies=Proxies(narrow=narrow_twin, shapes=lambda cfg: narrow_twin(cfg) + ["model.recurrence=1"]), **_COMMON))

STANDARD_GPT = register_family(Family(
    name="standard_gpt", config_cls=StandardGPTConfig, build_model=StandardGPT,
    depth=Depth(trained=layer_count, sweep=lambda cfg: [cfg.model.n_layers]),  # its only depth
    scaling=Scaling(activations=_decoder_activations(lambda cfg, k_max: cfg.model.n_layers)),
    hf="pipeline.families.gpt_hf:STANDARD_EXPORT",
    proxies=Proxies(narrow=narrow_twin, shapes=lambda cfg: narrow_twin(cfg) + ["model.n_layers=1"]), **_COMMON))
