"""ESM's unsupervised contact head on ProtLingo (and dense ESM2) models, and the contact precision metric.

ESM predicts contacts from its attention maps (Rao et al., "Transformer protein language models are unsupervised
structure learners", ICLR 2021): every layer's and head's map, <cls> and <eos> removed, symmetrized (A + A^T) and
average-product corrected (A - a_i a_j / a), then a logistic regression over the layers x heads channels. The
regression weights are ESM2's (the ``contact_head.regression`` of a Hugging Face ESM2 directory or fair-esm's
``*-contact-regression.pt``); the attention maps are the model's own. ``contact_probs`` equals Hugging Face's
``EsmForMaskedLM.predict_contacts`` on a dense model (tests/pipeline/eval/test_contacts.py, <= 1e-5).

Metric (CASP / ESM convention, as in paper 002's Table 2): of the top L / k predicted pairs with sequence separation
|i - j| >= ``min_separation`` (24: long range), the fraction that are true contacts (C-beta within 8 angstrom), for
k = 1, 2, 5.
"""
from __future__ import annotations

import torch

from pipeline.models.layers import apply_rope


def attention_maps(model, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Every block's softmax attention of a ProtLingo model: [B, layers, heads, L, L] (float32), read with forward
    hooks on the attention modules (their inputs are recomputed into probabilities: SDPA returns none)."""
    maps, hooks = [], []

    def capture(module, args, _output):
        x, (cos, sin), key_mask = args
        B, L, _ = x.shape
        split = lambda t: t.view(B, L, module.n_heads, module.head_dim).transpose(1, 2).float()  # noqa: E731
        q = apply_rope(split(module.q(x)), cos, sin)
        k = apply_rope(split(module.k(x)), cos, sin)
        scores = q @ k.transpose(-1, -2) / module.head_dim ** 0.5  # [B, H, L, L]
        scores = scores.masked_fill(~key_mask[:, None, None, :].bool(), float("-inf"))
        maps.append(scores.softmax(-1))

    for layer in model.layers:
        hooks.append(layer.attn.register_forward_hook(capture))
    try:
        with torch.no_grad():
            model(tokens, attention_mask)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(maps, dim=1)


def contact_probs(attentions: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor, eos_id: int = 2) -> torch.Tensor:
    """attentions [B, layers, heads, L, L] -> contact probabilities [B, L - 2, L - 2] between the residues (<cls>
    and the last position dropped, <eos> zeroed), as ESM's contact head computes them. ``weight`` [1, layers x
    heads], ``bias`` [1]: the logistic regression."""
    m = attention_mask.to(attentions.dtype)
    a = attentions * m[:, None, None, None, :] * m[:, None, None, :, None]  # padding neither attends nor is attended
    keep = tokens.ne(eos_id).to(a.dtype)
    a = a * (keep[:, None, :] * keep[:, :, None])[:, None, None]
    a = a[..., :-1, :-1][..., 1:, 1:]
    B, layers, heads, L, _ = a.shape
    a = a.reshape(B, layers * heads, L, L)
    a = a + a.transpose(-1, -2)  # symmetrize
    a = a - a.sum(-1, keepdim=True) * a.sum(-2, keepdim=True) / a.sum((-1, -2), keepdim=True)  # APC
    return torch.sigmoid(a.permute(0, 2, 3, 1) @ weight.to(a.dtype).T + bias.to(a.dtype)).squeeze(-1)


def precision_at_l(probs: torch.Tensor, contacts: torch.Tensor, min_separation: int = 24,
                   fractions: tuple[int, ...] = (1, 2, 5)) -> dict[str, float]:
    """probs, contacts: [L, L] for one protein (contacts bool, True where C-beta atoms are within 8 angstrom) ->
    {"P@L": ..., "P@L/2": ..., "P@L/5": ...}: the precision of the top L / k pairs i < j with j - i >=
    ``min_separation``, ranked by probability (ties broken by position: stable)."""
    L = probs.shape[-1]
    i, j = torch.triu_indices(L, L, offset=min_separation)
    order = torch.sort(probs[i, j], descending=True, stable=True).indices
    truth = contacts[i, j][order]
    out = {}
    for k in fractions:
        n = min(L // k, truth.numel())
        out["P@L" if k == 1 else f"P@L/{k}"] = float(truth[:n].float().mean()) if n else float("nan")
    return out


def contacts_from_coordinates(cb: torch.Tensor, threshold: float = 8.0) -> torch.Tensor:
    """C-beta coordinates [L, 3] (NaN where missing) -> contact map [L, L] bool (a missing atom is no contact)."""
    d = torch.cdist(cb, cb)
    return (d < threshold) & ~torch.isnan(d)
