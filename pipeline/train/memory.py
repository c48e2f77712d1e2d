"""The memory model of a training step, and ``train.max_tokens_per_microbatch: auto`` sized by it.

A rank's peak during a step is its model states plus the activations autograd keeps for one microbatch:

* states (:func:`state_bytes`): the weights in the compute dtype, the gradients (ZeRO-2/3: this rank's partition;
  ZeRO-0/1: all of them), ZeRO's fp32 master partition and AdamW's two moments (partitioned from stage 1), and
  ZeRO-2's gradient bucket; expert parameters under expert parallelism partitioned over their own groups;
* activations (the family's ``Scaling.activations``, an :class:`Activations`): bytes per token of the microbatch's
  token budget (rows x padded length) that the forward leaves saved for the backward: each differentiated
  transformer block's tensors (the family counts what its code saves: the fused RMSNorm keeps its input and a
  per-row rstd, SDPA its inputs, output and log-sum-exp, each Linear its input, ...) times the blocks a token passes
  with autograd on (Eco-RNA: prelude, coda and min(K, W) core iterations), plus what the embeddings, heads and losses
  keep. With ``train.activation_checkpointing: blocks`` a differentiated block keeps only its input, and one block's
  activations exist at a time (during its recomputation).
* the backward's transient on top of them (``TRANSIENT_BLOCKS``): the gradients one block's backward holds beside
  what is not yet freed (measured on the CPU, tests/pipeline/test_memory_model.py).

``resolve_microbatch`` turns ``auto`` into a token budget M per microbatch and accumulation steps A, with the global
batch in tokens (``train.global_batch_tokens``) kept: the fewest A such that global / (world x A) tokens fit in the
device's memory (``CAPACITY`` of it, the rest left to the allocator's fragmentation and the CUDA context), M =
global // (world x A). The loss is normalized by the step's exact supervised-token count (pipeline/train/step.py),
so the update does not depend on how a step's tokens are cut into microbatches: fewer, larger microbatches give the
same numerics. A run resolves once, at its first start; its checkpoints hold the resolved values, which a resume
keeps (the loader's batching, and so its data order, depends on them).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pipeline.errors import ConfigError
from pipeline.families.base import Activations

# Share of a device's memory a microbatch may plan for: the caching allocator's fragmentation, the CUDA context and
# cuBLAS/cuDNN workspaces take the rest (on the CPU: the interpreter, DeepSpeed and the loader's workers).
CAPACITY = 0.85
# Transient bytes at the peak, in blocks' worth of activations: the backward of a block holds the gradients of its
# saved tensors and of the residual stream beside everything not yet freed, about one more block (measured on the
# CPU, tests/pipeline/test_memory_model.py: 1.0 block for Eco-RNA, 1.1 for RecursiveGPT, 0.4 for ProtLingo).
TRANSIENT_BLOCKS = 1.0
MASTER_BYTES, ADAM_BYTES = 4, 8  # ZeRO's fp32 master partition; AdamW's exp_avg and exp_avg_sq in fp32
DS_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)


def state_bytes(shapes: list[tuple[str, int]], *, zero_stage: int, world: int, ep: int = 1, bf16: bool,
                grad_bytes: int | None = None, reduce_bucket: float = DS_DEFAULT_BUCKET,
                persistence: int = 100_000) -> dict[str, float]:
    """Bytes of one rank's model states under ZeRO ``zero_stage`` on ``world`` ranks (module docstring).
    ``shapes``: (name, numel) of every parameter; names holding ``.deepspeed_experts.`` are experts, held
    num_experts / ``ep`` at a time and partitioned over the world / ep ranks that hold the same experts."""
    w_bytes = 2 if bf16 else 4
    g_bytes = grad_bytes or w_bytes
    experts = sum(n for name, n in shapes if ".deepspeed_experts." in name)
    dense = sum(n for _, n in shapes) - experts
    local_experts = experts / ep
    n_rank = dense + local_experts
    opt_dense, opt_exp = (world, world // ep) if zero_stage >= 1 else (1, 1)
    optimizer = (MASTER_BYTES + ADAM_BYTES) * (dense / opt_dense + local_experts / opt_exp)
    if zero_stage == 3:
        persistent = sum(n for _, n in shapes if n <= persistence)
        weights = w_bytes * (n_rank / world + persistent)
        grads = g_bytes * n_rank / world
    else:
        weights = w_bytes * n_rank
        grads = g_bytes * (n_rank / world if zero_stage == 2 else n_rank)
    bucket = g_bytes * min(reduce_bucket, n_rank) if zero_stage >= 2 else 0.0
    return {"weights": weights, "gradients": grads, "optimizer (fp32 master + AdamW moments)": optimizer,
            "gradient bucket": bucket}


@dataclass(frozen=True)
class StepMemory:
    """One rank's memory model: ``states`` (name -> bytes) and ``activations`` per token."""

    states: dict
    activations: Activations
    checkpointed: bool = False

    @property
    def state_total(self) -> float:
        return sum(self.states.values())

    @property
    def per_token(self) -> float:
        """Activation bytes per token, with the backward's transient."""
        return self.activations.per_token(self.checkpointed) + TRANSIENT_BLOCKS * self.activations.block

    def peak(self, tokens: int) -> float:
        """Predicted peak bytes of a step whose microbatches hold ``tokens`` (rows x padded length)."""
        return self.state_total + self.per_token * tokens

    def max_tokens(self, capacity: float) -> int:
        """The largest token budget whose predicted peak fits in ``capacity`` bytes (0: the states alone do not)."""
        return max(0, int((capacity - self.state_total) // self.per_token))


def step_memory(cfg, family, *, zero_stage: int, world: int, bf16: bool, k_max: float | None = None,
                ds_config: dict | None = None) -> StepMemory:
    """The memory model of ``cfg``'s step (its parameters from a meta-device skeleton of the model, nothing
    allocated). ``k_max``: the deepest recurrence a microbatch runs (default: the bound the family's scaling hooks
    give, e.g. Eco-RNA's k_cap)."""
    import torch

    with torch.device("meta"):
        shapes = [(n, p.numel()) for n, p in family.build_model(cfg.model).named_parameters()]
    z = (ds_config or {}).get("zero_optimization", {})
    comm = (ds_config or {}).get("communication_data_type")
    states = state_bytes(shapes, zero_stage=zero_stage, world=world, ep=cfg.train.expert_parallel_size, bf16=bf16,
                         grad_bytes={"fp32": 4, "fp16": 2, "bf16": 2}.get(comm),
                         reduce_bucket=float(z.get("reduce_bucket_size", DS_DEFAULT_BUCKET)),
                         persistence=int(z.get("stage3_param_persistence_threshold", 100_000)))
    acts = family.scaling.activations(cfg, 2 if bf16 else 4, k_max)
    return StepMemory(states, acts, cfg.train.activation_checkpointing == "blocks")


def device_memory(device) -> tuple[float, str]:
    """(bytes a rank may plan for, what they are): the GPU's total memory, or on the CPU the host's memory shared by
    the ranks of this host (LOCAL_WORLD_SIZE), each times CAPACITY."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        return props.total_memory * CAPACITY, f"{props.name}, {props.total_memory / 2 ** 30:.1f} GiB"
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    total = psutil.virtual_memory().total
    return total / local * CAPACITY, f"host memory {total / 2 ** 30:.1f} GiB / {local} local rank(s)"


@dataclass(frozen=True)
class Microbatch:
    """A resolved ``train.max_tokens_per_microbatch: auto``."""

    tokens: int  # the token budget of a microbatch (rows x padded length)
    grad_accum_steps: int
    predicted_peak: float  # bytes, at ``tokens``
    capacity: float  # bytes a rank may plan for
    why: str  # one line for the log

    def as_dict(self) -> dict:
        return {"max_tokens_per_microbatch": self.tokens, "grad_accum_steps": self.grad_accum_steps}


def resolve_microbatch(memory: StepMemory, *, global_tokens: int, world: int, context_length: int,
                       capacity: float, where: str) -> Microbatch:
    """The fewest accumulation steps A whose microbatch of global_tokens // (world x A) tokens fits ``capacity``
    (module docstring). A ConfigError naming the keys when not even one sequence of data.context_length fits."""
    per_rank = global_tokens / world
    fits = memory.max_tokens(capacity)
    if fits < context_length or per_rank < context_length:
        need = memory.peak(context_length)
        why = (f"{per_rank:.0f} tokens per rank (train.global_batch_tokens {global_tokens} on {world} ranks) is less "
               f"than one sequence" if per_rank < context_length else
               f"one sequence of data.context_length {context_length} needs {need / 2 ** 30:.2f} GiB by the memory "
               f"model, {where} gives {capacity / 2 ** 30:.2f} GiB to plan for")
        raise ConfigError(f"train.max_tokens_per_microbatch: auto: {why}; set an explicit token budget")
    accum = max(1, math.ceil(per_rank / fits))
    tokens = int(per_rank // accum)
    while tokens < context_length:  # rounding down could leave less than one sequence: fewer, larger ones
        accum -= 1
        tokens = int(per_rank // accum)
    peak = memory.peak(tokens)
    why = (f"auto microbatch: {tokens:,} tokens x {accum} accumulation step(s) x {world} rank(s) = "
           f"{tokens * accum * world:,} of train.global_batch_tokens {global_tokens:,}; predicted peak "
           f"{peak / 2 ** 30:.2f} GiB of {capacity / 2 ** 30:.2f} GiB planned ({where}); states "
           f"{memory.state_total / 2 ** 30:.2f} GiB, activations {memory.per_token / 1024:.1f} KiB per token")
    return Microbatch(tokens, accum, peak, capacity, why)


H200_BYTES = 139 * 2 ** 30  # one H200 as torch reports it (the device the project's GPU configs are sized for)


def microbatch_on(cfg, family, device_bytes: float = H200_BYTES, *, world: int = 1, zero_stage: int = 2,
                  bf16: bool = True) -> Microbatch:
    """What ``auto`` resolves to for ``cfg`` on ranks of ``device_bytes`` (default one H200): benches and tools
    that reproduce a GPU run's batching on the CPU."""
    memory = step_memory(cfg, family, zero_stage=zero_stage, world=world, bf16=bf16)
    return resolve_microbatch(memory, global_tokens=cfg.train.global_batch_tokens, world=world,
                              context_length=cfg.data.context_length, capacity=device_bytes * CAPACITY,
                              where=f"{device_bytes / 2 ** 30:.0f} GiB")


def as_on_device(cfg, family, device_bytes: float = H200_BYTES, sized=None):
    """``cfg`` with train.max_tokens_per_microbatch: auto resolved as :func:`microbatch_on` does (unchanged without
    auto). ``sized``: the config whose model the memory model sizes for (a bench running a smaller model through
    a GPU run's batching), default ``cfg``."""
    import dataclasses

    if cfg.train.max_tokens_per_microbatch != "auto":
        return cfg
    mb = microbatch_on(sized or cfg, family, device_bytes)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_tokens_per_microbatch=mb.tokens,
                                                              grad_accum_steps=mb.grad_accum_steps))


def training_device():
    """The device this process trains on, as the Trainer picks it (LOCAL_RANK's GPU, else the CPU)."""
    import torch

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None


def claim_device(world: int):
    """Take this process's training device: LOCAL_RANK's GPU (made current), else the CPU with the host's cores
    shared among the node's ranks (unless OMP_NUM_THREADS says otherwise: oversubscribing halves the speed)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    if "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return torch.device("cpu")


def resolve_auto(cfg, family, *, world: int, ds_config: dict, saved: dict | None = None, device=None):
    """(``cfg`` with train.max_tokens_per_microbatch: auto resolved, the Microbatch), module docstring. ``saved``:
    the client state of the checkpoint a run resumes: its resolved budget is kept (the data order depends on it)
    when it was resolved from the same global batch, the accumulation scaled to this world size."""
    import dataclasses

    t = cfg.train
    g = t.global_batch_tokens
    old = (saved or {}).get("config", {}).get("train", {})
    if isinstance(old.get("max_tokens_per_microbatch"), int) and old.get("global_batch_tokens") == g:
        tokens, microbatches = old["max_tokens_per_microbatch"], old["grad_accum_steps"] * saved["world_size"]
        if microbatches % world:
            raise ConfigError(f"train.max_tokens_per_microbatch: auto: the checkpoint resumed cut a step into "
                              f"{microbatches} microbatches of {tokens:,} tokens, which {world} ranks cannot share; "
                              "resume on a world size that divides it")
        accum = microbatches // world
        resolved = Microbatch(tokens, accum, math.nan, math.nan, f"auto microbatch: {tokens:,} tokens x {accum} "
                              f"accumulation step(s), kept from the checkpoint resumed")
    else:
        zero = ds_config.get("zero_optimization", {}).get("stage", 0)
        bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
        memory = step_memory(cfg, family, zero_stage=zero, world=world, bf16=bf16, ds_config=ds_config)
        capacity, where = device_memory(device)
        resolved = resolve_microbatch(memory, global_tokens=g, world=world, context_length=cfg.data.context_length,
                                      capacity=capacity, where=where)
    train = dataclasses.replace(t, max_tokens_per_microbatch=resolved.tokens, grad_accum_steps=resolved.grad_accum_steps)
    try:
        return dataclasses.replace(cfg, train=train), resolved
    except ConfigError as e:  # the resolved budget against the data settings (data.length_window ...)
        raise ConfigError(f"{e} (train.max_tokens_per_microbatch: auto resolved to {resolved.tokens:,})") from None


def saved_activation_bytes(fn, exclude=()) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saves while ``fn()`` runs, what it returned). Storages of the
    tensors in ``exclude`` (the parameters) are not counted; a storage saved twice, or through several views,
    counts once. The measurement the families' ``Scaling.activations`` formulas are held to."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and ptr not in seen:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out
