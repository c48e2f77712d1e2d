"""Finding and loading trained weights: evaluation, export, and the engine's ``--init-from``.

A checkpoint argument may name a run directory, its ``checkpoints/`` directory (the ``latest`` tag is used), a tag
directory ``checkpoints/stepNNNNNNNN``, or an exported directory (``model.safetensors`` + ``config.yaml``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import ConfigError, RunConfig, build_config, load_yaml
from pipeline.families import FAMILIES, get_family
from pipeline.checkpoint.layout import check_intact, read_client, resume_tag

EXPORTED_WEIGHTS = "model.safetensors"


@dataclass
class TrainedModel:
    cfg: RunConfig
    model: torch.nn.Module
    tag_dir: Path  # the checkpoint it came from
    client_state: dict  # step, mlflow_run_id, ... ({} for an export)


def latest_tag(ckpt_dir: Path) -> str | None:
    """The checkpoint to continue from or evaluate: what ``latest`` names if complete, else the newest complete one
    (pipeline/checkpoint/layout.py), with a note on stderr when it is not what ``latest`` names."""
    tag, note = resume_tag(Path(ckpt_dir))
    if note:
        print(f"note: {note}", file=sys.stderr, flush=True)
    return tag


def resolve_tag_dir(path: str | Path) -> Path:
    p = Path(path)
    if (p / EXPORTED_WEIGHTS).is_file() or (p / "client_state.json").is_file():
        return p
    for ckpts in (p, p / "checkpoints"):
        tag = latest_tag(ckpts)
        if tag:
            return ckpts / tag
    raise ConfigError(f"{path}: not a checkpoint (no latest, client_state.json or {EXPORTED_WEIGHTS})")


def is_export(tag_dir: Path) -> bool:
    return (tag_dir / EXPORTED_WEIGHTS).is_file()


def export_state_names(state: dict, export_dir: Path) -> dict[str, torch.Tensor]:
    """An export's tensors under the pipeline's names: an export in a foreign format (export.json "format" other
    than "pipeline", e.g. a dense ProtLingo written as transformers' EsmForMaskedLM) is mapped back by its family's
    ``read_export``; pipeline-format exports are returned as they are."""
    meta = export_dir / "export.json"
    fmt = json.loads(meta.read_text()).get("format", "pipeline") if meta.is_file() else "pipeline"
    if fmt == "pipeline":
        return state
    family = get_family(load_yaml(export_dir / "config.yaml").get("family"))
    try:
        if family.read_export is None:
            raise ValueError(f"format {fmt!r}: the {family.name} family writes pipeline-format exports only")
        return family.read_export(fmt, state)
    except ValueError as e:
        raise ConfigError(f"{export_dir / EXPORTED_WEIGHTS}: {e}") from None


def read_client_state(tag_dir: Path) -> dict:
    """A DeepSpeed checkpoint's client state in the current form (step, world size, MLflow run, ...; layout.py's
    read_client); an export's export.json, which holds the same provenance; {} when there is neither."""
    if is_export(tag_dir):
        f = tag_dir / "export.json"
        return json.loads(f.read_text()) if f.is_file() else {}
    return read_client(tag_dir) or {}


def check_same_model(saved: dict, cfg: RunConfig, source: Path):
    """ConfigError unless ``saved`` (a checkpoint's config as a dict) has this run's family and model layout.

    Every model field but the execution choices (the model config's RESUME_FREE: kernels, padding) fixes the
    parameter layout; the first differing key is named.
    """
    free = getattr(type(cfg.model), "RESUME_FREE", ())
    ours = {k: v for k, v in cfg.to_dict()["model"].items() if k not in free}
    diff = [k for k, v in ours.items() if saved["model"].get(k) != v]
    if saved.get("family") != cfg.family:
        raise ConfigError(f"family: {cfg.family} differs from {saved.get('family')} of checkpoint {source}")
    if diff:
        raise ConfigError(f"model.{diff[0]}: {ours[diff[0]]!r} differs from {saved['model'].get(diff[0])!r} "
                          f"of checkpoint {source}")


def load_state_dict(tag_dir: Path, trusted: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of an export or of a ZeRO stage 1-3 checkpoint, whatever world size wrote it. A
    DeepSpeed checkpoint is checked by ``check_pickles`` and read by ``weights_only_loads`` unless ``trusted``
    (--trust-checkpoint).

    A checkpoint with DeepSpeed MoE layers (expert parallelism, ``layer_{L}_expert_{id}_*`` files) goes through
    ``_moe_state_dict``: ``zero_to_fp32`` cannot read those (it takes the expert files for model-state files and
    concatenates every expert partition as if it were data-parallel)."""
    tag_dir = Path(tag_dir)
    if is_export(tag_dir):
        from safetensors.torch import load_file

        try:
            state = load_file(str(tag_dir / EXPORTED_WEIGHTS))
        except Exception as e:  # a truncated or foreign file (SafetensorError, OSError): one error naming it
            raise ConfigError(f"{tag_dir / EXPORTED_WEIGHTS}: cannot be read as safetensors "
                              f"({_first_line(e)})") from None
        return export_state_names(state, tag_dir)
    if not torch.cuda.is_available():  # no device work here; spare the user DeepSpeed's "no GPU found" warning
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    check_intact(tag_dir)
    if not trusted:
        check_pickles(tag_dir)
    if any(tag_dir.glob(EXPERT_FILES)):
        return _moe_state_dict(tag_dir)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32 asks torch.load for weights_only=False; weights_only_loads overrides that unless trusted
    with contextlib.redirect_stdout(sys.stderr), weights_only_loads(trusted):  # progress on stdout: keep it clean
        try:
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        except ConfigError:
            raise
        except Exception as e:  # missing or truncated files raise anything from ValueError to UnpicklingError
            raise ConfigError(f"{tag_dir}: cannot be read as a DeepSpeed ZeRO checkpoint ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# ---- MoE checkpoints (DeepSpeed MoE layers, any expert-parallel size) ------------------------------------------------
EXPERT_FILES = "layer_*_expert_*_mp_rank_00_model_states.pt"  # engine._save_moe_checkpoint: one file per expert
EXPERT_KEY = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..+)$")
_SHARD_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


# deepspeed_globals() by name, for the scan (check_pickles), which runs before DeepSpeed is imported (the dry run, a
# tool refusing a file); tests/reliability/test_crafted_checkpoint.py holds the two equal.
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address")


def deepspeed_globals() -> list:
    """The classes DeepSpeed's checkpoint files pickle besides tensors and torch's own types: its loss scalers, the ZeRO
    stage enum and the fragment addresses (ZeRO-1/2 optimizer shards). Found with
    torch.serialization.get_unsafe_globals_in_checkpoint on checkpoints of every ZeRO stage, expert parallelism and
    DeepSpeed's universal form, each of which the tests resume or export through weights_only_loads
    (docs/inference.md, "Pickles")."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # DeepSpeed: imported when needed
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def check_pickles(tag_dir: Path):
    """Refuse a DeepSpeed checkpoint whose torch files need anything but tensors, torch's own types and
    ``deepspeed_globals`` to load: a ConfigError naming the file and the first such global, before anything starts
    (the run plan, the tools). Only the pickles' opcodes are read (torch's static scan), no tensor; the loads
    themselves then go through ``weights_only_loads``."""
    allowed = set(DEEPSPEED_GLOBALS)
    for f in sorted(Path(tag_dir).rglob("*.pt")):
        try:
            needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(f))
        except Exception as e:  # not a torch zip archive: truncated, or no checkpoint at all
            raise ConfigError(f"{f}: cannot be read as a torch checkpoint file ({_first_line(e)})") from None
        bad = sorted(set(needed) - allowed)
        if bad:
            raise _refusal(f, bad[0])


def _refusal(path, what: str) -> ConfigError:
    return ConfigError(f"{path}: loading it would call {what}, which is neither a tensor type nor one of the DeepSpeed "
                       "classes a checkpoint holds, so it was not unpickled (it could run any code); pass "
                       "--trust-checkpoint only if you trust whoever wrote it")


@contextlib.contextmanager
def weights_only_loads(trusted: bool = False):
    """While open, every ``torch.load`` in this process runs as ``torch.load(weights_only=True)`` with
    ``deepspeed_globals`` allowed by name: DeepSpeed's own readers (``engine.load_checkpoint``, ``zero_to_fp32``,
    ZeRO-3's universal load, ``ds_to_universal``) call ``torch.load(weights_only=False)`` themselves, and this is the
    one place that overrides it, so no reader of a checkpoint can run code its files hold. A file that needs any
    other global raises ConfigError naming the file. ``trusted`` (--trust-checkpoint): torch.load is left as it is.

    A context, not a patch at import: only the loads made inside it change (the main thread loads checkpoints; no
    other thread calls torch.load meanwhile)."""
    if trusted:
        yield
        return
    unsafe_load = torch.load

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(deepspeed_globals()):
                return unsafe_load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))  # torch names the global it refused
            raise _refusal(f, found.group(1) if found else f"more ({_first_line(e)})") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = unsafe_load


def load_ds_file(path: Path) -> dict:
    """One DeepSpeed checkpoint file, read by ``weights_only_loads``."""
    try:
        with weights_only_loads():
            return torch.load(path, map_location="cpu")
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{path}: cannot be read as a DeepSpeed checkpoint file with weights_only=True "
                          f"({type(e).__name__}: {str(e).splitlines()[0]})") from None


def _global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """``...deepspeed_experts.<local>.w`` of EP rank ``ep_rank`` -> ``...deepspeed_experts.<global>.w``."""
    m = EXPERT_KEY.match(name)
    if not m:
        raise ValueError(f"expert parameter {name!r} has no deepspeed_experts.<id> segment")
    return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}"


def _zero12_fp32_masters(tag_dir: Path, model_states: dict) -> dict[str, torch.Tensor]:
    """The fp32 master of every trainable parameter from the ZeRO-1/2 optimizer shards, expert ids global."""
    return _zero12_full_states(tag_dir, model_states, ("fp32",))[0]["fp32"]


def zero12_optimizer_state(tag_dir: Path) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """({"fp32" | "exp_avg" | "exp_avg_sq": {name: full tensor}}, Adam's step count) of a ZeRO-1/2 checkpoint of any
    world size and EP size, in the single-process model's names (experts under their global ids): what a run needs
    to continue on another layout when DeepSpeed's universal checkpoint cannot carry it (expert parallelism)."""
    tag_dir = Path(tag_dir)
    model_states = load_ds_file(tag_dir / "mp_rank_00_model_states.pt")
    full, steps = _zero12_full_states(tag_dir, model_states, ("fp32", "exp_avg", "exp_avg_sq"))
    if not full["fp32"]:
        raise ConfigError(f"{tag_dir}: no ZeRO-1/2 optimizer shards (a ZeRO-0 or ZeRO-3 checkpoint)")
    if len(steps) != 1:
        raise ConfigError(f"{tag_dir}: optimizer groups at different step counts {sorted(steps)}")
    return full, steps.pop()


_SHARDS = "*zero_pp_rank_*_mp_rank_00_optim_states.pt"


def _zero12_full_states(tag_dir: Path, model_states: dict, keys: tuple) -> tuple[dict[str, dict], set[float]]:
    """({key: {name: full tensor}} for ``keys`` among "fp32" (the masters) and the Adam moments of the ZeRO-1/2
    optimizer shards, every one a flat partition per optimizer group laid out alike; the groups' Adam step counts).

    Shard r holds, per optimizer group, rank r's slice of the group; ``param_slice_mappings`` names each slice's
    parameter (local expert ids) and place in the partition. A data-parallel group is partitioned over all W ranks;
    an MoE group (``moe: True``) over its expert-data-parallel group, P = partition_count ranks: with DeepSpeed's
    layout (``use_data_before_expert_parallel_`` false, the only one the pipeline creates) EP rank e is every rank
    r with r % ep == e, ep = W / P, in rank order, and holds global experts e * num_local .. (e + 1) * num_local - 1.
    """
    shards = sorted(tag_dir.glob(_SHARDS), key=lambda f: int(_SHARD_RANK.search(f.name).group(1)))
    world = int(model_states["dp_world_size"])
    if not shards:
        return {k: {} for k in keys}, set()
    if len(shards) != world:
        raise ConfigError(f"{tag_dir}: {len(shards)} ZeRO optimizer shards, but the checkpoint was written by {world} "
                          "ranks (an incomplete checkpoint)")
    optim = [load_ds_file(f)["optimizer_state_dict"] for f in shards]
    stage = int(optim[0]["zero_stage"])
    if stage not in (1, 2):
        raise ConfigError(f"{tag_dir}: MoE checkpoint of ZeRO stage {stage}; expert parallelism runs on stage 1-2")
    if model_states.get("ds_config", {}).get("use_data_before_expert_parallel_"):
        raise ConfigError(f"{tag_dir}: written with use_data_before_expert_parallel_; only DeepSpeed's default "
                          "expert-group layout is supported")
    counts = optim[0]["partition_count"]
    meta = optim[0]["base_optimizer_state"]["param_groups"]
    shapes = model_states["param_shapes"]  # rank 0's names and shapes, one OrderedDict per optimizer group
    experts_per_layer = set(model_states.get("num_experts") or [])

    def flat(r: int, i: int, key: str) -> torch.Tensor:  # rank r's partition of group i
        if key == "fp32":
            return optim[r]["single_partition_of_fp32_groups"][i]
        return optim[r]["base_optimizer_state"]["state"][i][key]

    out = {k: {} for k in keys}
    for i, group_shapes in enumerate(shapes):
        P = counts[i] if isinstance(counts, list) else counts
        moe = bool(meta[i].get("moe"))
        ep = world // P if moe else 1
        if moe and (len(experts_per_layer) != 1 or world % P):
            raise ConfigError(f"{tag_dir}: optimizer group {i}: cannot place experts (partition count {P}, world "
                              f"{world}, experts per layer {sorted(experts_per_layer)})")
        num_local = next(iter(experts_per_layer)) // ep if moe else 0
        for e in range(ep):
            for key in keys:
                pieces: dict[str, list] = {n: [] for n in group_shapes}
                for r in range(e, world, ep):  # the ranks holding EP rank e's experts, in partition order
                    partition = flat(r, i, key)
                    for name, addr in optim[r]["param_slice_mappings"][i].items():
                        pieces[name].append(partition.narrow(0, addr.start, addr.numel))
                for name, shape in group_shapes.items():
                    full = torch.cat(pieces[name]) if pieces[name] else torch.empty(0)
                    if full.numel() != math.prod(shape):
                        raise ConfigError(f"{tag_dir}: {name}: the optimizer shards hold {full.numel()} of its "
                                          f"{math.prod(shape)} values")
                    out[key][_global_expert_name(name, e, num_local) if moe else name] = full.view(shape).clone()
    steps = {float(st["step"]) for st in optim[0]["base_optimizer_state"]["state"].values() if "step" in st}
    return out, steps


def _moe_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a ZeRO-1/2 checkpoint with DeepSpeed MoE layers, any EP size, the names of the
    single-process model.

    ``mp_rank_00_model_states.pt['module']`` holds every non-expert parameter and buffer; the expert files hold each
    expert under its global id; both in the training dtype (bf16 under bf16). The fp32 masters from the optimizer
    shards replace them wherever they exist (every trainable parameter); each master must round to the saved weight
    exactly, which checks the expert placement too. Frozen parameters keep their saved values.
    """
    module_file = tag_dir / "mp_rank_00_model_states.pt"
    if not module_file.is_file():
        raise ConfigError(f"{tag_dir}: MoE checkpoint without mp_rank_00_model_states.pt")
    model_states = load_ds_file(module_file)
    saved = dict(model_states["module"])
    for f in sorted(tag_dir.glob(EXPERT_FILES)):
        saved.update(load_ds_file(f))  # keys already carry the global expert id
    masters = _zero12_fp32_masters(tag_dir, model_states)
    state = {}
    for k, v in saved.items():
        if k in masters:
            m = masters.pop(k)
            if m.shape != v.shape or not torch.equal(m.to(v.dtype), v):
                raise ConfigError(f"{tag_dir}: {k}: the fp32 master in the optimizer shards does not match the saved "
                                  f"{v.dtype} weight (a checkpoint whose experts are not where DeepSpeed's layout puts "
                                  "them)")
            state[k] = m
        else:
            state[k] = v.float() if v.is_floating_point() else v
    if masters:
        raise ConfigError(f"{tag_dir}: the optimizer shards hold parameters with no saved weight: "
                          f"{sorted(masters)[:3]}")
    for alias, source in model_states.get("shared_params", {}).items():  # tied parameters saved once
        state[alias] = state[source]
    return state


def load_weights_into(model: torch.nn.Module, state: dict, source: Path):
    """``model.load_state_dict(state)`` that names, in one ConfigError, the first missing, unexpected or
    differently shaped weight (the config beside the weights is not theirs) or the first non-finite one (NaN or inf
    weights are never evaluated, exported or trained from)."""
    ours = model.state_dict()
    shaped = [k for k, v in state.items() if k in ours and tuple(v.shape) != tuple(ours[k].shape)]
    if shaped:
        k = shaped[0]
        raise ConfigError(f"{source}: weights do not fit the config: {k} is {list(state[k].shape)} in the weights, "
                          f"{list(ours[k].shape)} in the model config ({len(shaped)} tensors differ)")
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise ConfigError(f"{source}: weight {bad[0]} holds non-finite values (NaN or inf; {len(bad)} tensors in "
                          "all): these weights cannot be used; take an earlier checkpoint")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{source}: weights do not fit the config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")


def load_trained_model(path: str | Path, trusted: bool = False) -> TrainedModel:
    """The model of a run, checkpoint or export, in eval mode (``trusted``: --trust-checkpoint, load_state_dict)."""
    tag_dir = resolve_tag_dir(path)
    cfg = build_config(load_yaml(tag_dir / "config.yaml"))
    from pipeline.tasks import training_spec  # an adapted model (a task: section) is its backbone and head

    model = training_spec(cfg).build_model(cfg.model)
    load_weights_into(model, load_state_dict(tag_dir, trusted), tag_dir)
    model.eval()
    return TrainedModel(cfg, model, tag_dir, {} if is_export(tag_dir) else read_client_state(tag_dir))


def is_foreign_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint of another code base: a single file (fair-esm's ``.pt``) or a Hugging Face
    directory (config.json without this pipeline's config.yaml); not a run, checkpoint or export of this one."""
    p = Path(path)
    return p.is_file() or ((p / "config.json").is_file() and not (p / "config.yaml").is_file()
                           and not (p / "client_state.json").is_file())


def load_esm2(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, state dict under Hugging Face ``EsmForMaskedLM`` names) of an ESM2 checkpoint on disk: a
    Hugging Face directory, or the fair-esm file most ESM2 users have (``esm2_t30_150M_UR50D.pt``). The foreign
    checkpoints ``train.init_from`` reads (``Family.import_weights`` converts them)."""
    p = Path(path)
    if p.is_file():
        return load_fair_esm(p)
    return load_hf_directory(p)


# fair-esm ESM2 name (prefixes "encoder.sentence_encoder." / "encoder." removed, as fair-esm's own loader does) ->
# Hugging Face EsmForMaskedLM name; the per-layer ones below, for layer i.
_FAIR_ESM_NAMES = {"embed_tokens.weight": "esm.embeddings.word_embeddings.weight",
                   "emb_layer_norm_after.": "esm.encoder.emb_layer_norm_after.", "lm_head.dense.": "lm_head.dense.",
                   "lm_head.layer_norm.": "lm_head.layer_norm.", "lm_head.weight": "lm_head.decoder.weight",
                   "lm_head.bias": "lm_head.bias", "contact_head.regression.": "esm.contact_head.regression."}
_FAIR_ESM_LAYER = {"self_attn.q_proj.": "attention.self.query.", "self_attn.k_proj.": "attention.self.key.",
                   "self_attn.v_proj.": "attention.self.value.", "self_attn.out_proj.": "attention.output.dense.",
                   "self_attn_layer_norm.": "attention.LayerNorm.", "fc1.": "intermediate.dense.",
                   "fc2.": "output.dense.", "final_layer_norm.": "LayerNorm."}


def load_fair_esm(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A fair-esm ESM2 checkpoint ({"cfg": {"model": ...}, "model": state dict}) as (config.json dict, Hugging Face
    state dict). Read with ``weights_only=True``: the files pickle one class besides tensors, ``argparse.Namespace``
    (the model's hyperparameters), allowed explicitly; anything else in the file is refused, nothing is executed."""
    import argparse
    import pickle

    import zipfile

    p = Path(path)
    if not zipfile.is_zipfile(p):  # torch.save's format since torch 1.6; anything else is no checkpoint of it
        raise ConfigError(f"{p}: not a readable torch checkpoint (not a torch.save zip archive)")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            data = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ConfigError(f"{p}: not loaded: it holds objects other than tensors and the model's hyperparameters "
                          f"({str(e).splitlines()[0][:200]})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ConfigError(f"{p}: not a readable torch checkpoint ({str(e).splitlines()[0][:200]})") from None
    if not (isinstance(data, dict) and isinstance(data.get("model"), dict) and isinstance(data.get("cfg"), dict)):
        raise ConfigError(f"{p}: not a fair-esm ESM2 checkpoint (expected the keys 'cfg' and 'model')")
    regression = p.with_name(p.stem + "-contact-regression.pt")  # fair-esm ships the contact head beside the model
    if regression.is_file():  # and merges its "model" dict in (esm.pretrained.load_model_and_alphabet_local)
        try:
            extra = torch.load(regression, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle.UnpicklingError (a global), RuntimeError (not a zip): never executed
            raise ConfigError(f"{regression}: not loaded with weights_only=True ({str(e).splitlines()[0][:200]})") \
                from None
        if not (isinstance(extra, dict) and isinstance(extra.get("model"), dict)):
            raise ConfigError(f"{regression}: not a fair-esm contact regression (expected the key 'model')")
        data["model"].update(extra["model"])
    cfg = data["cfg"].get("model")
    get = (lambda k: cfg[k]) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))
    try:
        layers, dim, heads = get("encoder_layers"), get("encoder_embed_dim"), get("encoder_attention_heads")
        token_dropout = bool(get("token_dropout"))
    except (KeyError, AttributeError, TypeError) as e:
        raise ConfigError(f"{p}: cfg.model lacks the ESM2 hyperparameter {e}") from None
    state = {re.sub(r"^(encoder\.sentence_encoder\.|encoder\.)", "", k): v for k, v in data["model"].items()}
    hf = {}
    for name, t in state.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", name)
        if m:
            if m[2].endswith("rot_emb.inv_freq"):
                continue  # recomputed from the head dimension
            key = next((k for k in _FAIR_ESM_LAYER if m[2].startswith(k)), None)
            if key is None:
                raise ConfigError(f"{p}: unexpected parameter {name}")
            hf[f"esm.encoder.layer.{m[1]}.{_FAIR_ESM_LAYER[key]}{m[2][len(key):]}"] = t
            continue
        key = next((k for k in _FAIR_ESM_NAMES if name == k or (k.endswith(".") and name.startswith(k))), None)
        if key is None:
            raise ConfigError(f"{p}: unexpected parameter {name}")
        hf[_FAIR_ESM_NAMES[key] + name[len(key):]] = t
    ffn = state["layers.0.fc1.weight"].shape[0]
    vocab = state["embed_tokens.weight"].shape[0]
    config = {"model_type": "esm", "architectures": ["EsmForMaskedLM"], "vocab_size": vocab, "hidden_size": dim,
              "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": ffn,
              "position_embedding_type": "rotary", "token_dropout": token_dropout, "emb_layer_norm_before": False,
              "mask_token_id": 32, "pad_token_id": 1, "layer_norm_eps": 1e-5, "max_position_embeddings": 1026,
              "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return config, hf


def load_hf_directory(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, state dict) of a local Hugging Face model directory, e.g. facebook/esm2_t30_150M_UR50D
    saved with ``save_pretrained`` or cloned from the hub: ``model.safetensors`` (or its sharded index), else
    ``pytorch_model.bin`` read with ``weights_only=True``."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{p}: not a Hugging Face model directory (no config.json)")
    hf_config = json.loads((p / "config.json").read_text())
    from safetensors.torch import load_file

    if (p / "model.safetensors").is_file():
        return hf_config, load_file(str(p / "model.safetensors"))
    index = p / "model.safetensors.index.json"
    if index.is_file():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(p / shard)))
        return hf_config, state
    if (p / "pytorch_model.bin").is_file():
        return hf_config, torch.load(p / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConfigError(f"{p}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def load_foreign_model(path: str | Path) -> TrainedModel:
    """The model of a foreign checkpoint (:func:`is_foreign_checkpoint`: a Hugging Face ESM2 directory or a fair-esm
    ``.pt``), as it is, in eval mode: the first family whose ``from_foreign`` reads its config.json builds the model
    and its ``import_weights`` fills it (ProtLingo: a dense ESM2, the backbone copied). ``client_state`` says where it
    came from (``foreign_checkpoint``, ``format``); ConfigError naming the path when no family reads it."""
    p = Path(path)
    hf_config, state = load_esm2(p)
    why = []
    for family in FAMILIES.values():
        if family.from_foreign is None or family.import_weights is None:
            continue
        try:
            raw = family.from_foreign(hf_config)
        except ValueError as e:
            why.append(f"{family.name}: {e}")
            continue
        cfg = build_config(raw)
        model = family.build_model(cfg.model)
        try:
            weights = family.import_weights(hf_config, state, cfg.model, model.state_dict())
        except ValueError as e:
            raise ConfigError(f"{p}: {e}") from None
        load_weights_into(model, weights, p)
        model.eval()
        return TrainedModel(cfg, model, p, {"foreign_checkpoint": str(p),
                                            "format": "fair-esm" if p.is_file() else "huggingface"})
    raise ConfigError(f"{p}: no model family reads this checkpoint ({'; '.join(why) or 'none reads foreign ones'})")
