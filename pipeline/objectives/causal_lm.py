"""Causal language-modelling objective for RecursiveGPT and the standard baselines (paper 003).

Samples are sentencepiece token records (uint16 shards written by ``python -m data_prep babylm --spm MODEL``, ids
0 <pad>, 1 <s>, 2 </s>, 3 <unk>). A record is randomly cropped to the context, framed ``<s> ... </s>`` and shifted:
``input_ids = framed[:-1]``, ``labels = framed[1:]``, so position t is trained to predict token t + 1.

Per microbatch the loss is the summed token cross-entropy S over the m supervised (non-padding) positions; the engine
divides by the step's global count, giving the mean next-token loss. ``totals["words"]`` counts words seen as the
BabyLM challenge counts them, the whitespace-separated words of the training text (Python's ``str.split``), repeats
over epochs counted: a word counts once when any of its characters is among the microbatch's targets. Every token of a
record is a target exactly once per time the record is drawn (the shift above), so one epoch of uncropped records
counts exactly the words of the text (tests/pipeline/objectives/test_word_count.py); a record cropped to the context
counts the words it keeps, one cut by the crop once. The count is read from the pieces of the ``tokenizer.model`` the
data_prep job copies beside the shards (:func:`word_tables`): a target begins a word where a non-space character
follows a space, the start of the document (<s>) or, across the token boundary, a token that ends in a space.
Counted on the host per microbatch (integers), summed over the accumulation microbatches and the ranks in float64
(exact below 2^53) by the step, kept in the checkpoint's running totals, so a resumed run continues the count
exactly.
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
        tables = word_tables(str(path))
        if tables is not None:
            words = count_words(batch.input_ids, batch.labels, tables)
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


# Unicode whitespace outside ASCII, as UTF-8 bytes: spelled in byte pieces when the vocabulary lacks the character
# (str.split splits on them, so the count must too)
_WIDE_SPACES = tuple(c.encode() for c in map(chr, range(0x80, 0x3001)) if c.isspace())


@functools.lru_cache(maxsize=4)
def word_tables(model_path: str) -> tuple[torch.Tensor, ...] | None:
    """Per piece of a sentencepiece model [V]: (words that begin inside it: space -> non-space transitions after its
    first character, long; whether its first character is a non-space, bool; whether it ends in a space or is a
    special token, bool: what follows it starts fresh; its byte for a byte piece <0xNN>, else -1). "▁" is a space;
    a byte piece is a non-space unless it is ASCII whitespace or part of a wider whitespace character's bytes, which
    :func:`count_words` reads from the sequence. None without a model file."""
    path = Path(model_path)
    if not path.is_file():
        return None
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    inner, starts, ends, byte = [], [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        byte.append(int(piece[3:-1], 16) if sp.is_byte(i) else -1)
        if sp.is_control(i):  # <pad>, <s>, </s>: no text; what follows starts a new word
            inner.append(0)
            starts.append(False)
            ends.append(True)
            continue
        if sp.is_byte(i):
            text = chr(byte[-1]) if byte[-1] < 0x80 else "x"
        elif sp.is_unknown(i):
            text = "x"  # one unknown character
        else:
            text = piece.replace("\u2581", " ")
        space = [c.isspace() for c in text]
        inner.append(sum(1 for a, b in zip(space, space[1:]) if a and not b))
        starts.append(not space[0])
        ends.append(space[-1])
    return torch.tensor(inner), torch.tensor(starts), torch.tensor(ends), torch.tensor(byte)


def _wide_space_bytes(seq: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: the positions of ``seq`` (token ids) that are byte pieces spelling a non-ASCII whitespace
    character (_WIDE_SPACES)."""
    b = byte[seq]  # [B, L], -1 where not a byte piece
    out = torch.zeros_like(seq, dtype=torch.bool)
    L = seq.shape[1]
    for spelled in _WIDE_SPACES:
        n = len(spelled)
        if n > L:
            continue
        hit = torch.ones(seq.shape[0], L - n + 1, dtype=torch.bool)
        for j, v in enumerate(spelled):
            hit &= b[:, j:L - n + 1 + j] == v
        for j in range(n):
            out[:, j:L - n + 1 + j] |= hit
    return out


def count_words(input_ids: torch.Tensor, labels: torch.Tensor, tables) -> int:
    """Words among the supervised targets [B, L] (module docstring): per target, the words beginning inside its
    piece, plus one when its piece begins with a non-space and the token before it (``input_ids`` at the same
    position: the shift) ends in a space or is special (<s> opens every record, and a crop's first target counts
    the word it cuts into once)."""
    inner, starts, ends, byte = tables
    V = len(inner)
    valid = (labels != IGNORE_INDEX) & (labels >= 0) & (labels < V)
    tgt = labels.clamp(min=0, max=V - 1)
    prev = input_ids.clamp(min=0, max=V - 1)
    n_inner, begins, after_space = inner[tgt], starts[tgt], ends[prev]
    if bool((byte[tgt] >= 0x80).any()):  # wide whitespace spelled in bytes: read from the sequence itself
        seq = torch.cat([prev[:, :1], tgt], 1)  # framed[t] = input_ids[t]; framed[t + 1] = labels[t]
        wide = _wide_space_bytes(seq, byte)
        begins = begins & ~wide[:, 1:]
        after_space = after_space | wide[:, :-1]
    n = n_inner + (begins & after_space).long()
    return int((n * valid).sum())


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
