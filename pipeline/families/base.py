"""A model family's spec (torchtitan's ModelSpec): everything the rest of the pipeline knows about one family, in one
place, and the registry that names them.

The engine, checkpointing, evaluation, inference, export and the scaling model ask a :class:`Family` and never
branch on a family's name: adding a family is one module that builds a spec and calls :func:`register_family` (see
pipeline/families/eco_rna.py, protlingo.py and gpt.py; tests/test_family_spec.py registers a toy one from outside
the package). ``get_family(name)`` reads the registry; an unknown name is a ConfigError naming the known ones.

Layering: pipeline.families sits above the models and objectives and below pipeline.config and everything that
trains, loads or exports (tests/test_import_layers.py). A spec therefore holds plain callables of its own layer or
below, and the two things that need more are kept out of the training import path:

* Hugging Face export classes import transformers' model zoo (seconds, and nothing a training needs). They live in
  per-family modules of this package (classes in ``modeling_*.py`` over the generic wrappers of hf_base.py, the export
  declarations in ``*_hf.py``) and the spec names
  an :class:`HFExport` object by a dotted path string, ``"module:NAME"``, imported on first use by
  :meth:`Family.hf_export`; pipeline/hf.py registers them with the Auto classes and builds export configs
  generically.
* Nothing here reads a RunConfig's module: hooks take a RunConfig and read its fields (duck-typed), so
  pipeline.config may keep importing this package to build one.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.errors import ConfigError


# ---- depth semantics ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Depth:
    """What "depth" means for a family: the one hook evaluation sweeps, inference, HF exports, choose_depth and the
    depth cap (pipeline/eval/cli.py) ask.

    selectable: a depth can be chosen after training (Eco-RNA's core iterations K, RecursiveGPT's R'); the others
        have one depth and refuse an explicit one.
    trained: RunConfig -> (the deepest depth the model was trained at, the config key that says so): the depth cap
        of sweeps is a multiple of it.
    sweep: RunConfig -> the depths an evaluation sweeps when none are given.
    default: RunConfig -> the depth inference and an HF export run at when none is given (Eco-RNA: the training
        law's mean, rounded); None: the model's own (one depth, or the recurrence in its config).
    """

    selectable: bool = False
    trained: Callable = None
    sweep: Callable = lambda cfg: list(range(1, 9))  # noqa: E731 - the 1-8 default of launchers/evaluate.py
    default: Callable = lambda cfg: None  # noqa: E731


def layer_count(cfg) -> tuple[int, str]:
    """Depth.trained of a model with one depth: its layer count."""
    return int(cfg.model.n_layers), f"model.n_layers {cfg.model.n_layers}"


# ---- inference ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MaskedLMInference:
    """pipeline/inference.py's hooks for a masked LM (the families without one are refused there).

    residue_ids: () -> LongTensor of the vocabulary ids of residues (what predict_masked ranks).
    prepare: (RunConfig, seed) -> per-model state the forward reuses (Eco-RNA: the evaluation initial-state table),
        or None.
    forward: (model, RunConfig, prepared, tokens [b, L], mask [b, L], depth) -> (logits [b, L, V], the hidden state
        the LM head reads [b, L, d], depths per row or None, row iterations). ``depth``: None for a one-depth family,
        else (tol, max_depth): iterate each row until its relative displacement is below tol, at most max_depth
        (tol 0: a fixed depth).
    variants: the benchmark whose scoring score_variants reproduces: "rnagym" or "proteingym".
    """

    residue_ids: Callable
    forward: Callable
    variants: str
    prepare: Callable = lambda cfg, seed: None  # noqa: E731


# ---- supervised adaptation (pipeline/tasks) ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Adaptation:
    """How the family's backbone feeds a task head (pipeline/tasks; pipeline/models/heads.py: TaskModel and the
    backbone contract it relies on).

    width: model config -> d, the width of the features a head reads.
    forward: (model: a TaskModel or its engine, Batch, RunConfig, plan) -> TaskOutput: the training forward, each row
        at the depth the family's plan drew (Eco-RNA: the right-aligned wavefront of the objective's depth law, its
        initial state drawn from the plan).
    eval_state: (RunConfig, attention mask [B, L], seed) -> the initial state [B, L, d] every depth of a sweep
        starts from (Eco-RNA: the seed-fixed evaluation table), or None for a family without one.
    hf: "module:NAME" of the HFExport of adapted models (Hugging Face classes with the task head), or None.
    flops: (RunConfig, plan, Batch, first: bool) -> the backbone's training FLOPs of a microbatch (its rows' own
        depths; with ``first`` the readout of the first iteration too); task heads are not counted.
    """

    width: Callable
    forward: Callable
    eval_state: Callable = lambda cfg, mask, seed: None  # noqa: E731
    hf: str | None = None
    flops: Callable = lambda cfg, plan, batch, first: 0.0  # noqa: E731


# ---- the scaling model (tools/scaling.py) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Activations:
    """What autograd keeps per token of a microbatch's token budget (rows x padded length), in bytes: a family's
    ``Scaling.activations``, the activation term of the memory model (pipeline/train/memory.py).

    block: one differentiated transformer block (the mean over the blocks where they differ); blocks: the
    differentiated blocks a token passes (Eco-RNA: prelude + coda + core x min(K_max, W)); block_input: a block's
    input alone (what activation checkpointing keeps per block); other: everything outside the blocks
    (embeddings, the recurrence's own tensors, heads, losses)."""

    block: float
    blocks: float
    block_input: float
    other: float

    def per_token(self, checkpointed: bool = False) -> float:
        if checkpointed:  # each block keeps its input; one block's activations are rebuilt at a time
            return self.blocks * self.block_input + self.block + self.other
        return self.blocks * self.block + self.other


def norm_extra(fused: bool, act_bytes: int) -> int:
    """Bytes per normalized element an RMSNorm or LayerNorm saves beyond its input when not fused: the plain
    formula keeps the fp32 input copy and the fp32 normalized output (8 bytes) where the fused operator keeps the
    input alone (act_bytes; in fp32 the copy is the input itself)."""
    return 0 if fused else 8 - act_bytes


def _one_depth(cfg, rows: int) -> tuple[float, list]:
    return 1.0, [(1, 1.0)]


def _forward_flops(cfg, pmf: list) -> tuple[float, float]:
    return 3 * cfg.model.forward_flops(length=cfg.data.context_length, depth=None), 0.0


@dataclass(frozen=True, kw_only=True)
class Scaling:
    """tools/scaling.py's per-family hooks (its module docstring has the model they feed).

    depth_law: (RunConfig, rows) -> (E[K_max] over ``rows`` iid depth draws, [(K, P(K))]).
    drawn_depth: the training draws a depth per sequence (Eco-RNA): the plan reports E[K_max], and a per-step
        ZeRO-3 re-gather is named as the fixed wavefront's to avoid.
    per_step_depth: RunConfig -> whether the depth (and so the core's call count) is drawn per microbatch: ZeRO-3's
        module trace then breaks and the plan reports E[K_max].
    wavefront_depth: RunConfig -> the fixed number of core steps every microbatch runs (a fixed wavefront), or None.
    module_calls: (RunConfig, k_max) -> {top-level parameter prefix: (forward calls, backward calls)} of one
        microbatch; prefixes not named run (1, 1).
    activations: (RunConfig, activation dtype bytes, k_max or None) -> Activations per token; k_max None: the
        deepest recurrence a microbatch may run (the bound a memory budget is sized for).
    train_flops: (RunConfig, pmf) -> (mean, variance) of one sequence's training FLOPs.
    """

    activations: Callable
    depth_law: Callable = _one_depth
    drawn_depth: bool = False
    per_step_depth: Callable = lambda cfg: False  # noqa: E731
    wavefront_depth: Callable = lambda cfg: None  # noqa: E731
    module_calls: Callable = lambda cfg, k_max: {}  # noqa: E731
    train_flops: Callable = _forward_flops


# ---- what runs -------------------------------------------------------------------------------------------------------
def padded_execution(model, cfg, probe) -> dict:
    """Family.execution of a model whose blocks run on padded rows [B, L, d] (packed documents in rows with
    ``data.pack``): the layout and the attention kernel for activations like ``probe`` (device, dtype)."""
    from pipeline.models.layers import attention_kernel

    return {"layout": "packed-rows" if cfg.data.pack else "padded",
            "attention": attention_kernel(getattr(cfg.model, "attn_backend", "auto"), probe)}


# ---- the CPU proxies of a GPU step (bench/step_proxies.py, bench/flops_check.py) ------------------------------------
def _no_overrides(cfg) -> list:
    return []


@dataclass(frozen=True, kw_only=True)
class Proxies:
    """What bench/step_proxies.py (OPS, SYNC, SHAPES) and bench/flops_check.py (FLOPs executed against accounted)
    ask of a family; everything else there (the counted microbatch, the shards SHAPES reads) follows from the spec's
    tokenizer kind, ``make_transform`` and the run config (docs/performance.md).

    narrow: RunConfig -> ``--set`` overrides of the config's narrow twin: every width shrunk (head_dim 8, FFN
        widths about 128), every count kept that the step's operators follow (blocks, heads, KV heads, experts, the
        MoE and memory layers, the vocabulary), so OPS and SYNC count the same operators as at the real widths, and
        the FLOP check meets every term of the count, at a fraction of the time. [] : the config's own widths.
    shapes: RunConfig -> ``--set`` overrides of the small model SHAPES runs its loader steps through: the narrow
        twin with one block per stack, since the distinct input shapes follow the batches and the depth plan, not
        the widths or the number of blocks. [] : the config's model.
    core: the module classes whose input shapes SHAPES.core counts (rows, length, grad mode): the unit a depth
        step repeats (Eco-RNA's Core: the wavefront changes its rows at every step), or () for Family.blocks (a
        stack of blocks, each run on the whole microbatch).
    meta: the family's loss runs on the meta device (shapes without data or compute: nothing reads a tensor's
        values into a shape), so SHAPES runs there, at a GPU microbatch in seconds.
    """

    narrow: Callable = _no_overrides
    shapes: Callable = _no_overrides
    core: tuple = ()
    meta: bool = False  # the loss runs on the meta device (no data-dependent shape): SHAPES runs there, no compute


# ---- Hugging Face export --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HFExport:
    """A family's Hugging Face classes and how its exports are written (pipeline/hf.py, tools/convert_checkpoint.py).

    config_cls: the PreTrainedConfig subclass of config.json (its ``model_type`` is registered with AutoConfig).
    models: ((transformers Auto class name, model class), ...) registered with those Auto classes.
    architectures: config.json's "architectures", or RunConfig -> them (an adapted model's class follows its task).
    config_kwargs: (RunConfig, depth) -> extra config fields (Eco-RNA: num_loops, the evaluation table, the
        tokenizer); ``depth`` is Depth.default unless the caller chose one.
    foreign: (RunConfig) -> (format name, a transformers config) when the model is written in another library's
        format instead (a dense ProtLingo as transformers' EsmForMaskedLM), else None; ``to_foreign(state, model
        config)`` then renames the state dict (the spec's ``read_export`` maps it back on load), and
        ``foreign_usage`` is the README's loading snippet.
    modeling: the dotted name of the module holding these classes (pipeline/families/modeling_*.py): the export
        ships it, with the pipeline modules it imports, and names it in config.json's auto_map (pipeline/hf_code.py),
        so that ``from_pretrained(EXPORT, trust_remote_code=True)`` works where this repository is not installed.
    write_tokenizer: (export directory, RunConfig, sentencepiece model or None) -> None: the tokenizer files
        AutoTokenizer reads, beside the weights; or None.
    card: (HF config) -> (provenance lines, extra usage lines) for the export's README.md.
    """

    config_cls: type
    models: tuple
    architectures: tuple | Callable
    config_kwargs: Callable = lambda cfg, depth: {}  # noqa: E731
    foreign: Callable = lambda cfg: None  # noqa: E731
    to_foreign: Callable | None = None
    foreign_usage: tuple = ()
    modeling: str | None = None
    write_tokenizer: Callable | None = None
    example: str = ""  # an input for the README's pipeline("fill-mask" / "text-generation") line
    card: Callable = lambda hf_cfg: ([], [])  # noqa: E731

    def config(self, cfg, depth: int | None = None):
        """The transformers config of a RunConfig's model."""
        arch = self.architectures(cfg) if callable(self.architectures) else self.architectures
        return self.config_cls.from_model_config(cfg.model, architectures=list(arch),
                                                 **self.config_kwargs(cfg, depth))

    @property
    def causal(self) -> bool:
        return any(auto == "AutoModelForCausalLM" for auto, _ in self.models)


# ---- tokenizers -----------------------------------------------------------------------------------------------------
def nucleotide_tokenizer(cfg, export_dir: Path):
    """The nucleotide tokenizer of the run's molecule (data.molecule)."""
    from pipeline.data.tokenizer import NucleotideTokenizer

    return NucleotideTokenizer(cfg.data.molecule)


def esm_tokenizer(cfg, export_dir: Path):
    """The ESM-2 alphabet."""
    from pipeline.data.protein_tokenizer import ProteinTokenizer

    return ProteinTokenizer()


def sentencepiece_tokenizer(cfg, export_dir: Path):
    """The export's sentencepiece model (tools/convert_checkpoint.py copies it)."""
    import sentencepiece

    from pipeline.data.tokenizer import SPM_NAME

    spm = Path(export_dir) / SPM_NAME
    if not spm.is_file():
        raise ConfigError(f"{export_dir}: no {SPM_NAME}; a text model's export holds its sentencepiece model "
                          "(tools/convert_checkpoint.py copies it unless --no-tokenizer)")
    return sentencepiece.SentencePieceProcessor(model_file=str(spm))


# ---- the spec -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family (module docstring). Required: what training needs; the rest defaults to "not supported"."""

    name: str
    config_cls: type  # the model config dataclass (config.yaml's ``model``)
    build_model: Callable  # model config -> nn.Module
    objective_cls: type  # the objective config dataclass (config.yaml's ``objective``)
    make_transform: Callable  # RunConfig -> (uint8 tokens, np rng) -> {"input_ids", "labels"}
    plan: Callable  # (Batch, RunConfig, *, step, stream, index) -> plan with .sync_max {name: int}
    loss: Callable  # (model, Batch, RunConfig, plan) -> LossOutput
    # The kind of tokenizer the model reads: a shard manifest's tokenizer "name" (pipeline/data/compat.py KINDS:
    # nucleotide, esm, sentencepiece), checked against every source before training.
    tokenizer: str
    # (RunConfig, export directory) -> the tokenizer an export is used with (pipeline.load_pretrained).
    make_tokenizer: Callable
    depth: Depth  # what depth means (Depth)
    scaling: Scaling  # tools/scaling.py's model of a step
    pad_id: int = 0
    packable: bool = False  # data.pack allowed: the objective masks attention and loss per packed document
    derive_metrics: Callable | None = None  # reduced step record -> extra metrics (e.g. routing entropy)
    # The model's transformer block classes: what train.activation_checkpointing: blocks recomputes in backward
    blocks: tuple = ()
    # What train.compile: blocks compiles, module classes whose forward runs as one compiled region: () for
    # ``blocks``. Larger units give inductor more to fuse and the host fewer calls (Eco-RNA: the core step, the
    # prelude and the readout, each with its norms and the injection around its blocks).
    compiled: tuple = ()
    # Validation (pipeline/validation.py): (model, Batch, RunConfig) -> (stats, totals) of one held-out batch, stats
    # name -> (numerator, denominator) and totals name -> number, both summed over batches and ranks; a stat named
    # "loss" also gives val/perplexity, and derive_metrics applies to the totals. None: no validation (eval.every
    # is refused).
    validate: Callable | None = None
    # train.init_from a foreign checkpoint (pipeline.checkpoint.is_foreign_checkpoint: a Hugging Face directory or a
    # fair-esm .pt, read as (config.json dict, Hugging Face state dict)): (config, state, model config, a fresh
    # model's state dict) -> this family's state dict, ValueError naming what does not fit. None: refused.
    import_weights: Callable | None = None
    # A foreign checkpoint read as a model of this family, as it is (launchers/evaluate.py --checkpoint ESM2_DIR):
    # (config.json dict of the foreign checkpoint) -> the raw RunConfig dict ({"family", "model", "data"}) whose
    # model import_weights fills, ValueError when the checkpoint is not one this family reads. None: refused.
    from_foreign: Callable | None = None
    # An export written in a foreign format (export.json "format", HFExport.foreign): (format, state) -> the state
    # dict under the pipeline's names, ValueError when it does not fit. None: pipeline-format exports only.
    read_export: Callable | None = None
    # "module:NAME" of this family's HFExport (module docstring: imported on first use); None: no HF export (the
    # export holds the pipeline's files only).
    hf: str | None = None
    inference: MaskedLMInference | None = None  # pipeline/inference.py support; None: refused (not a masked LM)
    # Whether the model reads text (sentencepiece): its export carries the tokenizer model and the text benchmarks
    # (BLiMP, LAMBADA) apply.
    text: bool = False
    # RunConfig -> None, ConfigError naming the key of what this family cannot run (pipeline.config.build_config
    # calls it once the config is built).
    check_config: Callable = lambda cfg: None  # noqa: E731
    # (model, RunConfig, probe tensor on the training device in the compute dtype) -> {"layout": ..., "attention":
    # ...}: what the blocks run on and which attention kernel, as the training's first lines and MLflow params say.
    execution: Callable = padded_execution
    # The CPU proxies' hooks (Proxies: the narrow twin, the SHAPES model, the core module); the default counts the
    # config's own model at its own widths.
    proxies: Proxies = Proxies()
    # Supervised adaptation (Adaptation: the features a task head reads); None: the family cannot be adapted.
    adapt: Adaptation | None = None
    # (RunConfig, the init source's config.yaml as a dict, () -> its full state dict) -> the whole state dict a run
    # starts from when its model is more than the source's (a task model from a pretraining checkpoint: the head
    # fresh from the run's seed), or None to load the source's own weights (pipeline/train/plan.py). A task's spec
    # sets it (pipeline/tasks/base.py).
    init_state: Callable | None = None

    def hf_export(self) -> HFExport | None:
        """The family's HFExport (imported on first call), or None."""
        return load_hf(self.hf)


def load_hf(ref: str | None) -> HFExport | None:
    """The HFExport a spec names by ``"module:NAME"`` (imported on first use: module docstring), or None."""
    if ref is None:
        return None
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def objective_validation(loss: Callable, plan: Callable, loss_stat: str, training_state: tuple = ()) -> Callable:
    """A family's validation by its training objective, without gradient: its stats and totals on the held-out
    batch (stat ``loss_stat`` reported as "loss"; stats ending in one of ``training_state`` describe the training
    so far, not the batch, and are left out). The plan is drawn for step 0: these objectives draw nothing."""
    def validate(model, batch, cfg) -> tuple[dict, dict]:
        out = loss(model, batch, cfg, plan(batch, cfg, step=0, stream=0, index=0))
        stats = {("loss" if k == loss_stat else k): v for k, v in out.stats.items()
                 if not k.endswith(training_state)}
        return stats, out.totals

    return validate


# ---- the registry ---------------------------------------------------------------------------------------------------
FAMILIES: dict[str, Family] = {}


def register_family(spec: Family) -> Family:
    """Add ``spec`` under ``spec.name`` (a second spec of the same name replaces the first: re-importing a module
    that registers one is harmless). Returns the spec."""
    if not isinstance(spec, Family):
        raise TypeError(f"register_family: expected a Family, got {type(spec).__name__}")
    FAMILIES[spec.name] = spec
    return spec


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"family: unknown model family {name!r} (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]
