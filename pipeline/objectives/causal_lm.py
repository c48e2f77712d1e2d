"""Causal language-modelling objective for RecursiveGPT and the standard baselines (paper 003).

Samples are sentencepiece token records (uint16 shards written by ``python -m data_prep babylm --spm MODEL``, ids
0 <pad>, 1 <s>, 2 </s>, 3 <unk>). A record is randomly cropped to the context, framed ``<s> ... </s>`` and shifted:
``input_ids = framed[:-1]``, ``labels = framed[1:]``, so position t is trained to predict token t + 1.

Per microbatch the loss is the summed token cross-entropy S over the m supervised (non-padding) positions; the engine
divides by the step's global count, giving the mean next-token loss. ``totals["words"]`` counts the words among the
targets (sentencepiece pieces that start a word, "▁..."), read from the ``tokenizer.model`` the data_prep job copies
beside the shards, so a run can log words seen, the unit of the BabyLM budgets (10M / 100M words).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError
from pipeline.data.tokenizer import SPM_BOS_ID as BOS_ID
from pipeline.data.tokenizer import SPM_EOS_ID as EOS_ID
from pipeline.data.tokenizer import SPM_NAME
from pipeline.objectives.eco_rna import LossOutput
from pipeline.objectives.masking import IGNORE_INDEX


@dataclass
class CausalLMObjectiveConfig:
    train_depth: int | None = None  # recurrent depth used in training; null = the model's own (R, or n_layers)
    count_words: bool = True  # totals["words"] from the shards' tokenizer.model (skipped when it is absent)

    def __post_init__(self):
        if self.train_depth is not None and self.train_depth < 1:
            raise ConfigError(f"objective.train_depth: must be >= 1 or null, got {self.train_depth}")


@dataclass
class Plan:
    """Host facts of a microbatch, read before it moves to the device so that the loss reads nothing back."""

    sync_max: dict = field(default_factory=dict)  # nothing to synchronize across ranks: the depth is fixed
    supervised: int | None = None  # supervised targets
    padded: bool = True  # some row has padding (else the model gets no mask: SDPA's causal kernel, no check per layer)
    words: int | None = None  # words among the targets (count_words), when counted
    tokens: int | None = None  # real tokens (the attention mask's sum), when the loss's FLOP count needs them
    real_index: torch.Tensor | None = None  # [T] long on the host: flat positions of the real tokens (MoE routing)


def plan(batch, cfg, *, step: int, stream: int, index: int) -> Plan:
    """batch: on the host (the loader's)."""
    words = None
    if cfg.objective.count_words:
        path = spm_model_path(cfg)
        table = word_start_table(str(path))
        if table is not None:
            words = count_words(batch.labels, table)
        elif cfg.train.max_words is not None or cfg.checkpoint.at_words:
            raise ConfigError(f"train.max_words / checkpoint.at_words: word counting needs {path}")
    return Plan(supervised=batch.num_supervised, padded=not bool(batch.attention_mask.all()), words=words)


def make_transform(cfg):
    """Crop to the context, frame with <s>/</s>, shift. ``context_length`` counts the model's input positions."""
    body = cfg.data.context_length - 1  # framed length body + 2 -> inputs and labels of length body + 1

    def transform(tokens: np.ndarray, rng: np.random.Generator) -> dict:
        if len(tokens) > body:
            start = int(rng.integers(0, len(tokens) - body + 1))
            tokens = tokens[start:start + body]
        framed = np.concatenate([[BOS_ID], tokens.astype(np.int64), [EOS_ID]])
        return {"input_ids": framed[:-1], "labels": framed[1:].copy()}

    return transform


def spm_model_path(cfg) -> Path:
    """The sentencepiece model data_prep wrote beside the (first) training source's shards: the shard directory, or
    the folder of a brace pattern's first tar (found from the pattern, without reading any shard)."""
    from braceexpand import braceexpand

    from pipeline.data.streams import is_url_pattern

    spec = str(cfg.data.sources[0].shards if cfg.data.sources else cfg.data.train_shards)
    return (Path(next(iter(braceexpand(spec)))).parent if is_url_pattern(spec) else Path(spec)) / SPM_NAME


@functools.lru_cache(maxsize=4)
def word_start_table(model_path: str) -> torch.Tensor | None:
    """bool [V]: True for pieces that begin a word ("▁..."); None without a model file."""
    path = Path(model_path)
    if not path.is_file():
        return None
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    return torch.tensor([sp.id_to_piece(i).startswith("\u2581") for i in range(sp.get_piece_size())])


def count_words(labels: torch.Tensor, table: torch.Tensor) -> int:
    """Words among the supervised targets [B, L]: pieces that start a word (sentencepiece's dummy prefix gives a
    line's first word its "▁" too; specials and a crop's leading word fragment do not count)."""
    valid = (labels != IGNORE_INDEX) & (labels >= 0) & (labels < len(table))
    ids = labels.clamp(min=0, max=len(table) - 1)
    return int((table.to(labels.device)[ids] & valid).sum())


def loss(model, batch, cfg, p: Plan) -> LossOutput:
    """batch on the model's device; model: the DeepSpeed engine or a bare RecursiveGPT / StandardGPT. Counts come
    from the plan (host), the loss statistic stays on the device."""
    depth = cfg.objective.train_depth
    # packed rows carry document_ids / position_ids: attention and positions stay within each document
    logits = model(batch.input_ids, batch.attention_mask if p.padded else None, depth,
                   document_ids=batch.document_ids, position_ids=batch.position_ids)  # [B, L, V]
    S = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                        reduction="sum")
    m = p.supervised if p.supervised is not None else int((batch.labels != IGNORE_INDEX).sum())
    B, L = batch.input_ids.shape
    totals = {"flops": 3 * B * cfg.model.forward_flops(L, depth)}  # forward + backward (twice the forward)
    if p.words is not None:
        totals["words"] = p.words
    return LossOutput(S, m, {"lm_loss": (S.detach(), m)}, totals)
