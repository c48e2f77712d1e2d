"""Typed run configuration: dataclasses per component, YAML loading, ``--set`` overrides, validation.

Every section is a dataclass that validates itself in ``__post_init__`` with a ValueError naming the field. YAML
goes through :func:`from_dict`, which refuses unknown keys and wrong types with the dotted key path (and the file
name), so a typo never silently falls back to a default. Loading is strict: a key given twice in one YAML mapping,
a non-finite number (``.nan``, ``.inf``) and a boolean where a number is expected are refused, and a malformed file
is reported with its line and column.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.data.length_window import length_window_problem
from pipeline.config_files import apply_overrides, check_finite, load_yaml, read_config_text, read_yaml  # noqa: F401
from pipeline.errors import ConfigError  # noqa: F401 - re-exported: pipeline.config.ConfigError is public


def _check(cond: bool, name: str, msg: str):
    if not cond:
        raise ConfigError(f"{name}: {msg}")


# --------------------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------------------
MASKING_KINDS = ("token", "span", "last_segment")


@dataclass
class MaskingConfig:
    """Which non-special positions are supervised and how they are corrupted (paper 000, A.2).

    ``kind: token`` selects positions independently; ``kind: span`` unions randomly placed spans of length
    max(1, floor(Y)), Y ~ Exp(mean span_mean), clipped at the sequence boundary, until the target count is reached.
    Either way a non-empty row supervises q = max(1, min(floor(select_prob |U|), |U|)) unique positions; each is then
    replaced by <mask> (mask_prob), a random canonical base (random_prob) or kept. ``kind: last_segment`` supervises
    exactly the tokens after the last <sep> (question/answer records such as ``data_prep synthetic-hops``; select_prob
    is unused, and a record without <sep>, or longer than the context, is an error).
    """

    kind: str = "token"  # token | span | last_segment
    select_prob: float = 0.15  # p_sel
    span_mean: float = 3.0  # mu_span, for kind: span
    mask_prob: float = 0.8
    random_prob: float = 0.1

    def __post_init__(self):
        _check(self.kind in MASKING_KINDS, "data.masking.kind",
               f"must be one of {', '.join(MASKING_KINDS)}, got {self.kind!r}")
        _check(self.span_mean > 0, "data.masking.span_mean", f"must be > 0, got {self.span_mean}")
        _check(0 < self.select_prob <= 1, "data.masking.select_prob", f"must be in (0, 1], got {self.select_prob}")
        _check(self.mask_prob >= 0 and self.random_prob >= 0 and self.mask_prob + self.random_prob <= 1,
               "data.masking.mask_prob", "mask_prob and random_prob must be >= 0 and sum to <= 1")


@dataclass
class SourceConfig:
    """One mixture source: a shard directory with manifest.json, or brace-notation tar paths without one."""

    name: str  # key in schedule weights, in logged metrics (mix/*/<name>) and in sample ids
    shards: str  # DIR (manifest.json) or e.g. data/shards/x/x-{000000..000007}.tar (counted by reading the tars once)
    molecule: str | None = None  # rna | dna: overrides data.molecule for this source's random replacements
    weight: float | None = None  # constant weight, when data.schedule is empty

    def __post_init__(self):
        _check(bool(self.name) and "/" not in self.name and ":" not in self.name, "data.sources.name",
               f"must be a non-empty name without '/' or ':', got {self.name!r}")
        _check(self.molecule in (None, "rna", "dna"), f"data.sources[{self.name}].molecule",
               f"must be 'rna' or 'dna', got {self.molecule!r}")
        _check(self.weight is None or self.weight >= 0, f"data.sources[{self.name}].weight",
               f"must be >= 0, got {self.weight}")


@dataclass
class MixtureStageConfig:
    """Stage of a mixture schedule over optimizer steps [previous until_step, until_step); see pipeline/data/mixture.py.

    ``weights`` ({source: w}, unnormalized, missing sources 0) hold at the stage's start; ``ramp: linear`` moves them
    linearly to ``end_weights`` at until_step, ``ramp: stepped`` in ``ramp_levels`` equal plateaus.
    """

    until_step: int | None = None  # exclusive end; null only for the last stage (then it runs to the end)
    weights: Any = None  # {source name: weight}
    ramp: str = "constant"  # constant | linear | stepped
    end_weights: Any = None  # {source name: weight} reached at until_step (linear / stepped)
    ramp_levels: int = 4  # stepped: number of plateaus from weights to end_weights, both included

    def __post_init__(self):
        for name in ("weights", "end_weights"):
            w = getattr(self, name)
            if w is None:
                continue
            _check(isinstance(w, dict) and all(isinstance(k, str) for k in w), f"data.schedule.{name}",
                   f"expected a mapping of source name to weight, got {w!r}")
            for k, v in w.items():
                _check(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                       f"data.schedule.{name}.{k}", f"expected a number >= 0, got {v!r}")
        _check(self.weights is not None, "data.schedule.weights", "every stage needs weights")
        _check(self.until_step is None or self.until_step >= 1, "data.schedule.until_step",
               f"must be >= 1, got {self.until_step}")


@dataclass
class DataConfig:
    # Single source: a directory with manifest.json (relative to the repo root or cwd), or brace-notation tar paths.
    # Ignored when ``sources`` is set.
    train_shards: str = "data/shards/rfam_demo"
    molecule: str = "rna"  # 'rna' | 'dna': which canonical bases random replacement draws from
    context_length: int = 128  # tokens including <cls> and <eos>; longer records are randomly cropped
    num_workers: int = 0  # DataLoader worker processes per rank (may change on resume)
    # The number of sample streams the data is dealt into, fixed for the whole run (the loader state keeps it):
    # rank r of R reads streams r*S/R .. (r+1)*S/R - 1. A checkpoint continues on any number of ranks that divides it
    # with the same data order and no sample repeated or skipped. None = ranks x max(1, num_workers) at the run's
    # start; set it to a multiple of every world size the run may continue on (e.g. 8 for 1, 2, 4 or 8 ranks).
    loader_streams: int | None = None
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    sources: list[SourceConfig] = field(default_factory=list)  # a mixture; empty = train_shards alone
    schedule: list[MixtureStageConfig] = field(default_factory=list)  # empty = constant sources[].weight
    pack: bool = False  # pack whole documents, <eos>-separated, into rows of context_length (causal LMs)
    # Cross-shard shuffle: each loader stream's epoch is permuted in consecutive windows of this many samples (on top
    # of the shard and in-shard permutations); stateless, so resume stays exact. Holds ~this many samples in memory.
    # 0 = off. Must not change on resume.
    shuffle_buffer: int = 0
    # Each loader stream interleaves the samples of this many shards at a time (seeded; resume stays exact), so a
    # shard set with one domain or class per shard still gives mixed batches. 1 = one shard after another (the order
    # of checkpoints from before this key). Must not change on resume.
    mix_shards: int = 4
    # Length-aware batching: each loader stream sorts every window of this many consecutive samples by length (after
    # cropping) and cuts it into microbatches (train.max_tokens_per_microbatch if set, else micro_batch_size rows;
    # then a multiple of it), emitted in a seeded random order: microbatches of similar lengths, almost no padding.
    # Holds this many samples per stream in memory; resume stays exact. 0 = off (draw order). Not with pack. Must
    # not change on resume.
    length_window: int = 0
    # Check each shard's sha256 against the manifest the first time a rank opens it (a corrupt or swapped shard
    # fails with one error line instead of training on wrong data). Sources without a manifest are not checked.
    verify: bool = True
    # Held-out shard directories read by the validation on a cadence (eval.every; pipeline/validation.py). null: the
    # val/ split that `data_prep --val-fraction` writes beside the training shards (DIR/val for DIR/train), when it
    # exists. Not a resume invariant: which set is validated on does not change what is trained on.
    val_shards: list[str] | None = None
    # Remote shard sets (any shard path may be s3://, gs:// or https://; docs/data.md, "Remote shard sets"): each shard
    # is fetched whole into this directory before it is read. One per run, shared by the ranks of a node (a lock per
    # shard: no shard fetched twice); null = $TMPDIR/bioseq-shards-<hash of run_dir>, node-local. Put it on local
    # disk: its locks are flock, and a shared filesystem would share the cache (and its limit) between nodes.
    cache_dir: str | None = None
    # The cache's size limit in bytes (downloads in progress counted at full size). Least recently used shards that
    # no process reads or holds prefetched are evicted; it must hold the largest shard (refused at start otherwise),
    # and about (prefetch_shards + 1) shards per loader process of the node for the loader never to wait.
    cache_bytes: int = 16 * 2**30
    # Shards each loader stream fetches ahead in the background (0: none, the loader fetches on demand).
    prefetch_shards: int = 2
    # Transient errors (connection reset or refused, timeouts, HTTP 5xx and 429, throttling, a cut download) are
    # retried this often, after fetch_backoff_s x 2^i seconds (at most 30); then the run stops, checkpointed, with
    # one line naming the URL.
    fetch_retries: int = 5
    fetch_backoff_s: float = 1.0

    def __post_init__(self):
        _check(self.molecule in ("rna", "dna"), "data.molecule", f"must be 'rna' or 'dna', got {self.molecule!r}")
        _check(isinstance(self.cache_bytes, int) and not isinstance(self.cache_bytes, bool) and self.cache_bytes > 0,
               "data.cache_bytes", f"must be a positive number of bytes, got {self.cache_bytes!r}")
        _check(self.prefetch_shards >= 0, "data.prefetch_shards", f"must be >= 0, got {self.prefetch_shards}")
        _check(self.fetch_retries >= 0, "data.fetch_retries", f"must be >= 0, got {self.fetch_retries}")
        _check(self.fetch_backoff_s >= 0, "data.fetch_backoff_s", f"must be >= 0, got {self.fetch_backoff_s}")
        _check(self.context_length >= 8, "data.context_length", f"must be >= 8, got {self.context_length}")
        _check(self.num_workers >= 0, "data.num_workers", f"must be >= 0, got {self.num_workers}")
        _check(self.loader_streams is None or self.loader_streams >= 1, "data.loader_streams",
               f"must be >= 1 (or null), got {self.loader_streams}")
        _check(self.shuffle_buffer >= 0, "data.shuffle_buffer", f"must be >= 0, got {self.shuffle_buffer}")
        _check(self.mix_shards >= 1, "data.mix_shards", f"must be >= 1, got {self.mix_shards}")
        _check(self.length_window >= 0, "data.length_window", f"must be >= 0 (0 = off), got {self.length_window}")
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        _check(not dup, "data.sources", f"duplicate source name {dup[0]!r}" if dup else "")
        _check(bool(self.sources) or not self.schedule, "data.schedule", "needs data.sources")
        if self.sources and not self.schedule:
            _check(all(s.weight is not None for s in self.sources) or len(self.sources) == 1, "data.sources.weight",
                   "every source needs a weight when there is no data.schedule")
        if self.schedule:
            _check(all(s.weight is None for s in self.sources), "data.sources.weight",
                   "give weights either per source or in data.schedule, not both")
        if self.sources:
            self.mixture()  # validates stage order, ramps and source names

    def mixture(self):
        """The MixtureSchedule of ``sources`` / ``schedule`` (ValueErrors name the field)."""
        from pipeline.data.mixture import MixtureSchedule

        names = [s.name for s in self.sources]
        try:
            if not self.schedule:
                return MixtureSchedule.constant(names, {s.name: (s.weight if s.weight is not None else 1.0)
                                                        for s in self.sources})
            return MixtureSchedule.from_stages(names, [dataclasses.asdict(st) for st in self.schedule])
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    schedule_steps: int | None = None  # length of the cosine; defaults to train.max_steps
    weight_decay: float = 0.1  # matrices only: gains, biases and what the model names in no_weight_decay() are exempt
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # written into the ds_config as gradient_clipping; 0 disables
    # {group: multiplier} of optim.lr for the parameter groups a model names in lr_groups() (ProtLingo:
    # memory_tables); the schedule scales every group alike
    lr_scale: Any = None
    # torch's fused AdamW kernel (one launch per step instead of a foreach chain): auto = on CUDA; true / false.
    # Same update up to rounding (tests/pipeline/test_lean_step.py).
    fused: Any = "auto"

    def __post_init__(self):
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(self.fused in ("auto", True, False), "optim.fused", f"must be auto, true or false, got {self.fused!r}")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas",
               f"must be two numbers in [0, 1), got {self.betas}")
        _check(self.grad_clip >= 0, "optim.grad_clip", f"must be >= 0, got {self.grad_clip}")
        _check(self.schedule_steps is None or self.schedule_steps >= 1, "optim.schedule_steps", "must be >= 1")
        _check(self.lr_scale is None or (isinstance(self.lr_scale, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for k, v in self.lr_scale.items())), "optim.lr_scale", f"expected {{group: number > 0}}, got {self.lr_scale!r}")


@dataclass
class ProfileConfig:
    """train.profile: record ``steps`` optimizer steps from step ``start`` (1-based) with torch.profiler on rank 0."""
    start: int = 2  # after the first step, which pays one-off costs (allocations, kernel selection)
    steps: int = 2

    def __post_init__(self):
        _check(self.start >= 1, "train.profile.start", f"must be >= 1, got {self.start}")
        _check(self.steps >= 1, "train.profile.steps", f"must be >= 1, got {self.steps}")


@dataclass
class TrainConfig:
    max_steps: int = 100  # optimizer steps
    micro_batch_size: int = 8  # sequences per rank per microbatch
    grad_accum_steps: int = 1
    global_batch_size: int | None = None  # if set, must equal micro_batch_size * grad_accum_steps * world_size
    precision: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    log_every: int = 10
    log_samples: bool = False  # write the sample ids of every step to RUN_DIR/samples-rankN.jsonl
    peak_flops_per_device: float | None = None  # e.g. 989e12 for H100/H200 bf16 dense; enables the MFU metric
    # Dynamic batch size: a microbatch takes sequences until one more would make B x max_len (padded tokens) exceed
    # this budget; micro_batch_size is then unused by the loader. Must be >= data.context_length. auto: the largest
    # budget the device's memory holds by the family's memory model (pipeline/train/memory.py), with
    # global_batch_tokens kept: grad_accum_steps is then derived (fewer, larger microbatches; the same update, the
    # loss being normalized by the step's exact token count). Resolved at a run's first start, kept on resume.
    max_tokens_per_microbatch: int | str | None = None
    # The global batch in tokens (every rank's microbatches of a step, rows x padded length): required by, and only
    # used with, max_tokens_per_microbatch: auto.
    global_batch_tokens: int | None = None
    # BabyLM-style budget: stop once the objective's running "words" total reaches it (e.g. 10_000_000).
    max_words: int | None = None
    max_epochs: float | None = None  # stop after this many passes over the training data (BabyLM: at most 10)
    # Start a new run from another run's weights (staged training, an upcycled ESM2): a run directory, a checkpoint
    # tag directory or an export (model.safetensors + config.yaml). Used only when this run has no checkpoint of its
    # own; once it has one, --resume auto continues from that. Step, learning-rate schedule, loader and MLflow run
    # start anew; the model config must match the source's. --init-from on the command line overrides it. A family
    # with Family.import_weights also starts from another code base's checkpoint (ProtLingo: an ESM2 Hugging Face
    # directory or fair-esm .pt, upcycled at start).
    init_from: str | None = None
    # Also load the source's AdamW moments (a DeepSpeed checkpoint of the same world size and ZeRO stage); this run's
    # own lr, betas, eps, weight decay and schedule apply from step 0 either way.
    init_from_optimizer: bool = False
    # Expert parallelism (ProtLingo MoE, ZeRO stage 1-2): each group of this many ranks holds the routed experts once,
    # num_experts / expert_parallel_size per rank; it must divide model.num_experts and the world size. 1 = every
    # rank holds every expert as an ordinary data-parallel parameter (the only choice under ZeRO-3).
    expert_parallel_size: int = 1
    # Stop the run (with one error line) after this many consecutive optimizer steps whose loss or gradient norm
    # is not finite; DeepSpeed skips such updates, so a run stuck on them would otherwise spin without learning.
    max_nonfinite_steps: int = 20
    # Wall-clock deadline in hours from the start of this process: on reaching it the run saves a checkpoint and
    # exits cleanly (resume continues). null = no deadline.
    max_hours: float | None = None
    # A step that runs longer than this prints "step N: microbatch i of n ..." every so many seconds (rank 0), so a
    # long accumulation is seen to progress.
    heartbeat_seconds: float = 60.0
    # Seconds a collective waits for the other ranks before every live rank gives up with one line naming the step
    # and the last complete checkpoint: a frozen peer (SIGSTOP, swapping, a hung device) is otherwise waited on for
    # good. DeepSpeed's own default (10 min); raise it when a checkpoint save or the first step takes longer.
    collective_timeout: float = 600.0
    # none | blocks: recompute every transformer block's activations in backward (pipeline/parallel/checkpointing.py)
    activation_checkpointing: str = "none"
    # {start: S, steps: N}: steps S .. S+N-1 recorded with torch.profiler on rank 0 (pipeline/profiling.py); null: off
    profile: ProfileConfig | None = None
    # Every RMSNorm as one fused operator each way (pipeline/models/norm_op.py: torch's fused kernels on CUDA, fp32
    # math inside; half the activation memory of the plain formula); false: the plain autograd formula.
    fused_norm: bool = True
    # none | blocks: torch.compile each transformer block (fusing RoPE, QK-norm, SwiGLU and the residual adds;
    # pipeline/parallel/kernels.py). Dynamic shapes, so the wavefront's changing row counts do not recompile.
    compile: str = "none"
    # With compile: blocks, each compiled block replays CUDA graphs (torch.compile's mode "reduce-overhead": one
    # launch per graph instead of one per kernel; a graph per distinct shape, which objective.token_buckets bounds on
    # the packed layout). CUDA only (elsewhere torch.compile runs its default mode); checked by bench/gpu.sh.
    cuda_graphs: bool = False

    def __post_init__(self):
        _check(self.max_steps >= 1, "train.max_steps", f"must be >= 1, got {self.max_steps}")
        _check(self.heartbeat_seconds > 0, "train.heartbeat_seconds", f"must be > 0, got {self.heartbeat_seconds}")
        _check(self.collective_timeout > 0, "train.collective_timeout", f"must be > 0, got {self.collective_timeout}")
        _check(self.compile in ("none", "blocks"), "train.compile", f"must be none or blocks, got {self.compile!r}")
        _check(isinstance(self.fused_norm, bool), "train.fused_norm", f"must be true or false, got {self.fused_norm!r}")
        _check(not self.cuda_graphs or self.compile == "blocks", "train.cuda_graphs",
               "replays compiled blocks: needs train.compile: blocks")
        _check(self.activation_checkpointing in ("none", "blocks"), "train.activation_checkpointing",
               f"must be none or blocks, got {self.activation_checkpointing!r}")
        _check(self.micro_batch_size >= 1, "train.micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        _check(self.grad_accum_steps >= 1, "train.grad_accum_steps", f"must be >= 1, got {self.grad_accum_steps}")
        _check(self.precision in ("auto", "fp32", "bf16"), "train.precision",
               f"must be auto, fp32 or bf16, got {self.precision!r}")
        _check(self.log_every >= 1, "train.log_every", f"must be >= 1, got {self.log_every}")
        budget = self.max_tokens_per_microbatch
        _check(budget is None or budget == "auto" or (isinstance(budget, int) and budget >= 1),
               "train.max_tokens_per_microbatch", f"must be an integer >= 1, auto or null, got {budget!r}")
        _check(self.global_batch_tokens is None or self.global_batch_tokens >= 1, "train.global_batch_tokens",
               f"must be >= 1, got {self.global_batch_tokens}")
        _check(budget != "auto" or self.global_batch_tokens is not None, "train.global_batch_tokens",
               "train.max_tokens_per_microbatch: auto needs it: the global batch in tokens that auto keeps")
        _check(budget != "auto" or self.grad_accum_steps == 1, "train.grad_accum_steps",
               f"is derived from train.global_batch_tokens under max_tokens_per_microbatch: auto; remove it (got "
               f"{self.grad_accum_steps})")
        _check(budget != "auto" or self.global_batch_size is None, "train.global_batch_size",
               "counts sequences; with max_tokens_per_microbatch: auto the global batch is train.global_batch_tokens")
        _check(self.init_from is None or bool(self.init_from), "train.init_from", "must be a path or null")
        _check(self.init_from is not None or not self.init_from_optimizer, "train.init_from_optimizer",
               "needs train.init_from")
        _check(self.expert_parallel_size >= 1, "train.expert_parallel_size",
               f"must be >= 1, got {self.expert_parallel_size}")
        _check(self.max_nonfinite_steps >= 1, "train.max_nonfinite_steps",
               f"must be >= 1, got {self.max_nonfinite_steps}")
        _check(self.max_hours is None or (math.isfinite(self.max_hours) and self.max_hours > 0), "train.max_hours",
               f"must be a number > 0 or null, got {self.max_hours}")


# The BabyLM challenge's checkpoint schedule, in words seen (repeats over epochs counted): every 1M to 10M, every 10M
# to 100M, every 100M to 1,000M. Entrants publish each as a branch chck_1M, chck_2M, ... (tools/convert_checkpoint.py
# --milestones). checkpoint.at_words: babylm takes it, babylm/N the same schedule divided by N (babylm/1000: every
# 1,000 words to 10,000, ...: a demo's milestones), both cut at train.max_words (word_milestones).
BABYLM_MILESTONES = tuple(m * 1_000_000 for m in (*range(1, 11), *range(20, 101, 10), *range(200, 1001, 100)))
WORD_PRESET = "babylm"


def _word_preset_scale(spec: str) -> int | None:
    """N of "babylm" (1) or "babylm/N"; None for anything else."""
    name, sep, scale = spec.partition("/")
    if name != WORD_PRESET:
        return None
    if not sep:
        return 1
    return int(scale) if scale.isdigit() and int(scale) >= 1 and 1_000_000 % int(scale) == 0 else None


@dataclass
class CheckpointConfig:
    every_steps: int = 50  # also saved at the end of training
    keep_last: int = 3  # older step checkpoints are deleted; 0 keeps all. Milestones (below) are never deleted
    # milestones: save when the running words total first reaches each; a list, or the challenge's schedule by name
    # (babylm, babylm/N: BABYLM_MILESTONES above; word_milestones resolves it)
    at_words: list[int] | str = field(default_factory=list)
    at_steps: list[int] = field(default_factory=list)  # milestones: save at each of these optimizer steps
    # A validation metric (e.g. val/loss, val/loss_K4; its name in metrics.jsonl): every evaluation that improves
    # it saves a checkpoint and points checkpoints/best at it; keep_last never deletes the one best names.
    keep_best: str | None = None
    best_mode: str = "min"  # min (losses) | max (accuracies)
    # The step waits only while its state is copied to host memory; the files, digests, COMPLETE, latest and
    # rotation follow in a writer thread, one save at a time (pipeline/checkpoint/background.py). false: the step
    # waits for the whole save.
    background: bool = True
    mirror: str | None = None  # an fsspec URL: each complete checkpoint copied there (pipeline/checkpoint/mirror.py)

    def __post_init__(self):
        _check(self.mirror is None or isinstance(self.mirror, str) and "://" in self.mirror and not self.mirror.lower(
        ).startswith(("http:", "https:")), "checkpoint.mirror", f"a writable fsspec URL (s3://bucket/prefix, gs://..., "
               f"file:///path), got {self.mirror!r}")
        _check(self.keep_best is None or self.keep_best.startswith("val/"), "checkpoint.keep_best",
               f"must name a validation metric (val/...), got {self.keep_best!r}")
        _check(self.best_mode in ("min", "max"), "checkpoint.best_mode", f"must be min or max, got {self.best_mode!r}")
        _check(isinstance(self.background, bool), "checkpoint.background", f"must be true or false, got "
               f"{self.background!r}")
        _check(self.every_steps >= 1, "checkpoint.every_steps", f"must be >= 1, got {self.every_steps}")
        _check(self.keep_last >= 0, "checkpoint.keep_last", f"must be >= 0, got {self.keep_last}")
        _check(all(s >= 1 for s in self.at_steps), "checkpoint.at_steps", f"steps must be >= 1, got {self.at_steps}")
        if isinstance(self.at_words, str):
            _check(_word_preset_scale(self.at_words) is not None, "checkpoint.at_words",
                   f"a list of word totals, {WORD_PRESET} or {WORD_PRESET}/N with N dividing 1,000,000 (the "
                   f"challenge's schedule divided by N), got {self.at_words!r}")
        else:
            _check(all(w >= 1 for w in self.at_words), "checkpoint.at_words",
                   f"word totals must be >= 1, got {self.at_words}")


@dataclass
class TrackingConfig:
    enabled: bool = True
    experiment: str = "eco-rna"
    run_name: str | None = None
    # Default: mlflow.db beside the run directory (runs/mlflow.db, one store for the checkout's runs; a run directory
    # with its own RUN_DIR/mlflow.db keeps it); MLFLOW_TRACKING_URI overrides both.
    tracking_uri: str | None = None
    # Bound in seconds on any single tracking call (start run, log metrics, log artifact): a hung tracking server
    # must not stall training.
    timeout_s: float = 10.0
    # Steps between the step records sent to MLflow (sent from a background thread; metrics.jsonl has every step).
    # train.log_every is the console's cadence.
    every: int = 1
    # Seconds between the samples of rank 0's host (CPU, memory, disk, network; GPUs with nvidia-ml-py) that MLflow's
    # system-metrics monitor logs as system/...; 0 = off. MLflow's own default (10 s) leaves a 30 s run 2 points.
    system_metrics_s: float = 5.0

    def __post_init__(self):
        _check(math.isfinite(self.timeout_s) and self.timeout_s > 0, "tracking.timeout_s",
               f"must be > 0, got {self.timeout_s}")
        _check(self.every >= 1, "tracking.every", f"must be >= 1, got {self.every}")
        _check(math.isfinite(self.system_metrics_s) and self.system_metrics_s >= 0, "tracking.system_metrics_s",
               f"must be >= 0 (0 = off), got {self.system_metrics_s}")


@dataclass
class EvalConfig:
    """Validation on a cadence (pipeline/validation.py): the family's held-out metrics on data.val_shards."""

    every: int = 0  # optimizer steps between validations (and after the last step); 0 = no validation
    max_samples: int | None = 1000  # the first N sequences of the validation shards (manifest order); null = all
    batch_size: int = 16  # sequences per forward pass, per rank
    seed: int = 0  # crops, masks and (Eco-RNA) the initial-state table: the same set on every evaluation
    depths: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # Eco-RNA: the K read out (one trajectory)

    def __post_init__(self):
        _check(self.every >= 0, "eval.every", f"must be >= 0 (0 = off), got {self.every}")
        _check(self.max_samples is None or self.max_samples >= 1, "eval.max_samples",
               f"must be >= 1 or null, got {self.max_samples}")
        _check(self.batch_size >= 1, "eval.batch_size", f"must be >= 1, got {self.batch_size}")
        _check(self.seed >= 0, "eval.seed", f"must be >= 0, got {self.seed}")
        _check(bool(self.depths) and all(k >= 1 for k in self.depths), "eval.depths",
               f"must be a non-empty list of depths >= 1, got {self.depths}")


SECTIONS = {
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "tracking": TrackingConfig,
    "eval": EvalConfig,
}


@dataclass
class RunConfig:
    family: str
    model: Any  # the family's model config dataclass
    objective: Any  # the family's objective config dataclass
    run_dir: str = "runs/eco_rna_demo"
    seed: int = 1234
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Supervised adaptation (docs/adaptation.md): the task's config dataclass (pipeline/tasks), None for pretraining
    task: Any = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __post_init__(self):
        _check(bool(self.run_dir), "run_dir", "must be a non-empty path")
        _check(0 <= self.seed < 2**63, "seed", f"must be an integer in [0, 2^63), got {self.seed}")
        budget = self.train.max_tokens_per_microbatch
        if budget != "auto":  # auto: checked as a number once resolved at the run's start (pipeline/train/memory.py)
            _check(budget is None or budget >= self.data.context_length, "train.max_tokens_per_microbatch",
                   f"{budget} < data.context_length {self.data.context_length}: a cropped sequence would not fit")
            why = length_window_problem(self.data.length_window, pack=self.data.pack, max_tokens=budget,
                                        micro_batch_size=self.train.micro_batch_size,
                                        context_length=self.data.context_length)
            _check(why is None, "data.length_window", why or "")
        _check(self.checkpoint.keep_best is None or self.eval.every > 0, "checkpoint.keep_best",
               "needs validation: set eval.every")

    def check_world_size(self, world_size: int):
        """Batch arithmetic: global = micro x accumulation x world size."""
        t = self.train
        if t.global_batch_size is not None:
            got = t.micro_batch_size * t.grad_accum_steps * world_size
            _check(got == t.global_batch_size, "train.global_batch_size",
                   f"{t.global_batch_size} != micro_batch_size {t.micro_batch_size} x grad_accum_steps "
                   f"{t.grad_accum_steps} x world size {world_size} = {got}")


# --------------------------------------------------------------------------------------------------------------------
# Generic dict -> dataclass conversion with key paths in every error
# --------------------------------------------------------------------------------------------------------------------
def word_milestones(cfg) -> list[int]:
    """checkpoint.at_words as word totals, sorted: the list, or the preset's schedule (BABYLM_MILESTONES divided by
    N) up to train.max_words when the run has a word budget (the milestones it can reach)."""
    at = cfg.checkpoint.at_words
    if not isinstance(at, str):
        return sorted(set(at))
    scale = _word_preset_scale(at)
    words = [w // scale for w in BABYLM_MILESTONES]
    budget = cfg.train.max_words
    return [w for w in words if budget is None or w <= budget]


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be null")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, prefix=key + ".")
    # bool is a subclass of int in Python: true is never an integer or a number here, and 1 is never true.
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 3e-4, without a dot, as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{key}: unsupported type {tp}")


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError naming the key."""
    where = prefix.rstrip(".") or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{prefix}{bad[0]!r}: config keys must be names, got {type(bad[0]).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown config key (known: {', '.join(sorted(names))})")
    kwargs = {k: _convert(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # a required field missing
        raise ConfigError(f"{where}: {e}") from None
    except ValueError as e:  # a section's own check (model and objective configs): keep its key, make it one line
        msg = " ".join(str(e).split())
        raise ConfigError(msg if msg.startswith(prefix) and prefix else f"{where}: {msg}") from None


def build_config(raw: dict) -> RunConfig:
    from pipeline.families import get_family  # families import models; keep config importable on its own

    raw = dict(raw)
    bad = [k for k in raw if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{bad[0]!r}: config keys must be names, got {type(bad[0]).__name__}")
    check_finite(raw)
    family_name = raw.get("family", "eco_rna")
    if not isinstance(family_name, str):
        raise ConfigError(f"family: expected a string, got {family_name!r}")
    family = get_family(family_name)
    model = from_dict(family.config_cls, raw.pop("model", {}) or {}, prefix="model.")
    objective = from_dict(family.objective_cls, raw.pop("objective", {}) or {}, prefix="objective.")
    task = raw.pop("task", None)
    if task is not None:  # the task's config dataclass (pipeline/tasks/base.py)
        from pipeline.tasks import task_section

        task = task_section(task, from_dict)
    raw["family"] = family_name
    hints = typing.get_type_hints(RunConfig)
    names = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown config key (known: {', '.join(sorted(names))})")
    kwargs = {k: _convert(v, hints[k], k) for k, v in raw.items() if k != "family"}
    cfg = RunConfig(family=family_name, model=model, objective=objective, task=task, **kwargs)
    # A masked LM's losses are per sequence (paper 000, Eq. 7-10) and its attention is bidirectional: packing would
    # let documents attend to each other. Only the causal LMs mask attention per packed document.
    _check(not cfg.data.pack or family.packable, "data.pack",
           f"family {family_name} is a masked LM with per-sequence losses and bidirectional attention; "
           "packing is for the causal LMs (set data.pack: false)")
    if task is not None:  # the adapted model's spec: the family's checks and the task's (pipeline/tasks/base.py)
        from pipeline.tasks import training_spec

        family = training_spec(cfg)
    family.check_config(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (or the defaults when ``path`` is None) plus overrides -> validated RunConfig.

    Errors carry the file name so the user knows where to look.
    """
    raw = load_yaml(path) if path is not None else {}
    raw = apply_overrides(raw, list(overrides))
    try:
        return build_config(raw)
    except ConfigError as e:
        if path is None:  # the key names it: nothing else to blame
            raise
        key = str(e).split(": ", 1)[0]  # errors start with the key they are about
        given = [o for o in overrides if _related(o.partition("=")[0], key)]
        where = f"--set {given[-1]}" if given else path  # the value the user typed, else the file it came from
        raise ConfigError(f"{where}: {e}") from None


def _related(a: str, b: str) -> bool:
    """Whether config keys ``a`` and ``b`` are the same or one holds the other (a section, or a list's element:
    ``optim.betas`` holds ``optim.betas[1]``)."""
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
