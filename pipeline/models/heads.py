"""Task heads for supervised adaptation (paper 000, A.5 and A.7) and the model that joins one to a backbone.

Every head reads the backbone's terminal coda features h = N_o(C(W_o s^(K))) [B, L, d] (the representation the tied
LM head reads) with the sequence's attention mask [B, L] (True at real tokens, <cls> at position 0, <eos> at its end):

- :class:`SequenceClassifier` (nRC): a light two-layer classifier over the terminal ``<cls>`` representation h[:, 0]
  -> logits [B, C].
- :class:`PairHead` (secondary structure): a pairwise head over the terminal coda features: per-position projections
  a, b [B, L, c] combined symmetrically into pair features f_ij = a_i * b_j + a_j * b_i [B, L, L, c], two residual
  3 x 3 convolutions over the pair map, one logit per cell -> [B, L, L], symmetric. Padding cells are zero before
  every convolution, so a sequence's logits do not depend on the batch it is in.
- :class:`ReactivityHead` (chemical reactivity): a four-block 1-D convolutional head whose input concatenates the
  terminal representation and its difference from the first-iteration representation, [h_K, h_K - h_1] [B, L, 2d]
  (the difference is zero at K = 1) -> per-nucleotide reactivities [B, L, P] (P = 2 probes: DMS, 2A3). Padding
  positions are zero before every convolution, as above.

:class:`TaskModel` holds a backbone and a head as its two children (state-dict names ``backbone.*`` and ``head.*``).
The backbone contract (Eco-RNA, pipeline/models/eco_rna.py, satisfies it): ``forward(tokens, mask, depths,
init_state, head=False, anchor_depth=..., **wavefront)`` returns ``.features`` [B, L, d] of each row at its own depth
and, with ``anchor_depth=1``, ``.anchor_features`` [n_a, L, d] (no grad) of the state after one iteration for the
rows ``.anchor_rows`` that run deeper; ``features_at_depths(tokens, mask, depths, init_state)`` returns {K: features}
from one trajectory. Nothing here imports DeepSpeed or torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class SequenceClassifier(nn.Module):
    """logits [B, C] = W_2 GELU(W_1 h_cls + b_1) + b_2 of the <cls> features h[:, 0] [B, d]."""

    def __init__(self, d_model: int, n_classes: int, hidden: int):
        super().__init__()
        self.hidden = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, n_classes)

    def forward(self, h: torch.Tensor, h_first: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.hidden(h[:, 0])))


class PairHead(nn.Module):
    """Pair logits [B, L, L] of the coda features (module docstring); symmetric, padding cells included (the loss and
    the metric keep the valid cells only)."""

    def __init__(self, d_model: int, channels: int, blocks: int = 2, kernel: int = 3):
        super().__init__()
        self.a = nn.Linear(d_model, channels)
        self.b = nn.Linear(d_model, channels)
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, kernel, padding=kernel // 2) for _ in range(blocks))
        self.out = nn.Conv2d(channels, 1, 1)

    def forward(self, h: torch.Tensor, h_first: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        m = mask.to(h.dtype)  # [B, L]
        a, b = self.a(h) * m[..., None], self.b(h) * m[..., None]  # [B, L, c], zero at padding
        f = a[:, :, None] * b[:, None] + b[:, :, None] * a[:, None]  # [B, L, L, c], symmetric
        f = f.permute(0, 3, 1, 2)  # [B, c, L, L]
        cell = (m[:, :, None] * m[:, None])[:, None]  # [B, 1, L, L] 1 at cells of two real tokens
        for conv in self.convs:
            f = f + F.gelu(conv(f)) * cell  # zero outside the valid cells before the next convolution
        z = self.out(f)[:, 0]  # [B, L, L]
        return (z + z.transpose(1, 2)) / 2


class ReactivityHead(nn.Module):
    """Reactivities [B, L, P] from [h_K, h_K - h_1] (module docstring): a 1 x 1 convolution to ``channels``, four
    residual blocks (convolution of width ``kernel``, GELU) and a 1 x 1 convolution to the P probes."""

    def __init__(self, d_model: int, channels: int, probes: int = 2, blocks: int = 4, kernel: int = 5):
        super().__init__()
        self.inp = nn.Conv1d(2 * d_model, channels, 1)
        self.blocks = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding=kernel // 2) for _ in range(blocks))
        self.out = nn.Conv1d(channels, probes, 1)

    def forward(self, h: torch.Tensor, h_first: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.to(h.dtype)[:, None]  # [B, 1, L]
        x = torch.cat([h, h - h_first], -1).transpose(1, 2)  # [B, 2d, L]
        x = self.inp(x * m) * m
        for conv in self.blocks:
            x = (x + F.gelu(conv(x))) * m  # zero at padding before the next convolution
        return self.out(x).transpose(1, 2)  # [B, L, P]


HEADS = {"SequenceClassifier": SequenceClassifier, "PairHead": PairHead, "ReactivityHead": ReactivityHead}


def build_head(name: str, kwargs: dict) -> nn.Module:
    """The head a task config names (pipeline/tasks: ``TaskConfig.head``), here and in an export's Hugging Face
    class."""
    if name not in HEADS:
        raise ValueError(f"task head {name!r}: not one of {', '.join(HEADS)}")
    return HEADS[name](**kwargs)


@dataclass
class TaskOutput:
    prediction: torch.Tensor  # the head's output: [B, C] class logits, [B, L, L] pair logits or [B, L, P] values
    row_iterations: int  # core row-applications the backbone executed


class TaskModel(nn.Module):
    """A backbone and a task head (module docstring). ``first``: the head reads the first-iteration features too
    (the reactivity head)."""

    def __init__(self, backbone: nn.Module, head: nn.Module, first: bool = False):
        super().__init__()
        self.backbone, self.head, self.first = backbone, head, first
        self.cfg = getattr(backbone, "cfg", None)  # the backbone's model config, as the evaluators read it

    def no_weight_decay(self) -> set[str]:
        own = self.backbone.no_weight_decay() if hasattr(self.backbone, "no_weight_decay") else set()
        return {f"backbone.{n}" for n in own}

    def lr_groups(self) -> dict[str, list[str]]:
        """The head and the backbone, for optim.lr_scale (a separate learning rate for the head)."""
        groups: dict[str, list[str]] = {"head": [], "backbone": []}
        for n, _ in self.named_parameters():
            groups["head" if n.startswith("head.") else "backbone"].append(n)
        return groups

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, depths, init_state: torch.Tensor,
                **wavefront) -> TaskOutput:
        """Training: each row at its own depth (the backbone's wavefront; ``wavefront``: its k_max, backward_window,
        host_mask, token_quantum)."""
        out = self.backbone(tokens, attention_mask, depths, init_state, head=False,
                            anchor_depth=1 if self.first else None, **wavefront)
        h_first = first_features(out) if self.first else None
        return TaskOutput(self.head(out.features, h_first, attention_mask), out.row_iterations)

    def at_depths(self, tokens: torch.Tensor, attention_mask: torch.Tensor, depths,
                  init_state: torch.Tensor) -> dict[int, torch.Tensor]:
        """{K: the head's prediction with every row at depth K} for each K in ``depths``, from one trajectory (the
        depth sweep: the checkpoint, the head, the inputs and ``init_state`` fixed across K)."""
        depths = sorted({int(k) for k in depths})
        want = sorted(set(depths) | ({1} if self.first else set()))
        feats = self.backbone.features_at_depths(tokens, attention_mask, want, init_state)
        return {k: self.head(feats[k], feats[1] if self.first else None, attention_mask) for k in depths}


def first_features(out) -> torch.Tensor:
    """[B, L, d] each row's first-iteration features: the anchor readout for the rows deeper than 1, the terminal
    features themselves (detached) for the rows at K = 1, so that h_K - h_1 is exactly zero there."""
    h1 = out.features.detach().clone()
    if out.anchor_rows is not None and len(out.anchor_rows):
        h1[out.anchor_rows] = out.anchor_features.to(h1.dtype)
    return h1
