"""Where a training starts: the checkpoint a resume continues (and on which layout), the checks that keep a resumed
run on the data the uninterrupted run would have seen, and train.init_from's source. Pure resolution: nothing here
starts DeepSpeed or writes a file, so the dry run goes through the same checks."""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.checkpoint.layout import (COMPLETE, check_intact, checkpoint_tags, damaged_files, digest_note,
                                        is_complete, resume_tag)
from pipeline.checkpoint.read import (check_pickles, check_same_model, is_export, is_foreign_checkpoint,
                                      load_esm2, read_client_state, resolve_tag_dir)
from pipeline.config import ConfigError, RunConfig, load_yaml
from pipeline.parallel import EP_KEY

# What may differ between a resumed run's config and its checkpoint's: budgets and deadlines, cadences, logging,
# tracking, validation and execution choices that change neither the weights' layout nor what is read or computed.
# Everything else (the model, the objective, the optimizer, the seed, the batch arithmetic, the data) must be the
# checkpoint's: a change there is refused unless --allow-config-change. A model config lists its own execution
# choices (same parameters, same outputs) in its RESUME_FREE class attribute.
MAY_CHANGE_ON_RESUME = (
    "run_dir", "checkpoint", "tracking", "eval", "optim.schedule_steps",
    "data.verify", "data.num_workers", "data.val_shards", "data.cache_dir", "data.cache_bytes", "data.prefetch_shards",
    "data.fetch_retries", "data.fetch_backoff_s",
    "train.max_steps", "train.max_words", "train.max_epochs", "train.max_hours", "train.log_every", "train.log_samples",
    "train.peak_flops_per_device", "train.init_from", "train.init_from_optimizer", "train.expert_parallel_size",
    "train.max_nonfinite_steps", "train.heartbeat_seconds", "train.collective_timeout",
    "train.activation_checkpointing", "train.profile", "train.fused_norm", "train.compile", "train.cuda_graphs",
)


def find_resume_tag(resume: str, ckpt_dir: Path) -> tuple[str | None, str | None]:
    """(the tag --resume RESUME continues in ``ckpt_dir``, a note when it is not what ``latest`` names)."""
    if resume == "never":
        if checkpoint_tags(ckpt_dir):
            raise ConfigError(f"--resume never: {ckpt_dir} already holds checkpoints; "
                              "use --resume auto or another run_dir")
        return None, None
    if resume == "auto":
        tag, note = resume_tag(ckpt_dir, check_files=True)
        return tag, _joined(note, digest_note(ckpt_dir / tag) if tag else None)
    tag_dir = Path(resume)
    if not (tag_dir / "client_state.json").is_file():
        raise ConfigError(f"--resume {resume}: not a checkpoint directory (no client_state.json)")
    if not is_complete(tag_dir):
        raise ConfigError(f"--resume {resume}: incomplete checkpoint (no {COMPLETE} marker or an unreadable "
                          "client_state.json); it cannot be resumed")
    if bad := damaged_files(tag_dir):
        f, why = bad[0]
        raise ConfigError(f"--resume {resume}: {f.relative_to(tag_dir)} {why}; resume from an earlier checkpoint")
    if tag_dir.resolve().parent != ckpt_dir.resolve():
        # Continuing another run's checkpoint here would write into its folder, rotate its checkpoints away and
        # look its MLflow run up in this run's store: starting from another run is --init-from.
        raise ConfigError(f"--resume {resume}: not a checkpoint of this run ({ckpt_dir}); --resume "
                          "continues the same run, --init-from starts a new run from another run's checkpoint")
    return tag_dir.name, digest_note(tag_dir)


def _joined(*notes: str | None) -> str | None:
    """Several notes about the checkpoint a run resumes from, as the one line the run prints."""
    return "; ".join(n for n in notes if n) or None


def expert_parallel_size(saved_config: dict) -> int:
    """train.expert_parallel_size of a saved run config (migrated: 1 for checkpoints from before the key)."""
    return int(saved_config["train"]["expert_parallel_size"])


def check_reshard(saved: dict, source: Path, world_size: int, zero_stage: int, ep: int) -> str | None:
    """How checkpoint ``source`` (client state ``saved``) continues on ``world_size`` ranks under ``zero_stage`` with
    EP size ``ep``: None (its own layout), "universal" (DeepSpeed's universal checkpoint: another world size or
    stage), "consolidated" (expert parallelism on either side with another world size, stage or EP size: the full
    tensors, pipeline/checkpoint/io.py)."""
    saved_stage, saved_ep = saved["zero_stage"], expert_parallel_size(saved["config"])
    if saved.get("world_size") == world_size and saved_stage == zero_stage and saved_ep == ep:
        return None
    where = (f"{saved.get('world_size')} ranks under ZeRO stage {saved_stage} with EP {saved_ep}, this run has "
             f"{world_size} under stage {zero_stage} with EP {ep}")
    if saved_stage == 0 or zero_stage == 0:
        raise ConfigError(f"checkpoint {source} was written by {where}; a checkpoint moves to another layout with "
                          "its ZeRO optimizer shards, which need ZeRO stage 1-3 on both sides "
                          "(tools/convert_checkpoint.py exports the weights for any layout)")
    if not saved["loader"]:
        raise ConfigError(f"checkpoint {source} was written by {where} and holds no per-stream loader position "
                          "(an older checkpoint); it continues only on its own layout")
    if saved_ep == 1 and ep == 1:
        return "universal"
    if saved_stage == 3:  # EP runs on stage 1-2; a ZeRO-3 source has no expert-parallel form to read
        raise ConfigError(f"checkpoint {source} was written by {where}; a ZeRO-3 checkpoint continues with "
                          "expert parallelism only through --init-from (its weights, fresh optimizer moments)")
    return "consolidated"


def check_resume_config(saved: dict, cfg: RunConfig, source: Path, saved_world: int | None, world_size: int,
                        allow_config_change: bool) -> list[str]:
    """A resumed run continues its checkpoint's config (``saved``, migrated): every key outside MAY_CHANGE_ON_RESUME
    must hold the checkpoint's value, or the run is refused with one line listing each change. With
    ``allow_config_change`` the changes go through; returns them as "key: old -> new" for the log. On another world
    size the global batch (micro x accumulation x ranks) must stay, so grad_accum_steps scales inversely with the
    ranks (and is no change)."""
    ours = cfg.to_dict()
    free = MAY_CHANGE_ON_RESUME + tuple(f"{part}.{k}" for part in ("model", "objective")
                                        for k in getattr(type(getattr(cfg, part)), "RESUME_FREE", ()))
    changes = [(k, a, b) for k, a, b in config_diff(saved, ours) if not k.startswith(tuple(p + "." for p in free))
               and k not in free]
    if saved_world and saved_world != world_size:
        changes = [c for c in changes if c[0] != "train.grad_accum_steps"]
        a = get_path(saved, "train.grad_accum_steps") * saved_world  # microbatches per optimizer step, all ranks
        b = get_path(ours, "train.grad_accum_steps") * world_size
        if a != b and not allow_config_change:
            fit = f"set train.grad_accum_steps={a // world_size}" if a % world_size == 0 else (
                f"{a} microbatches per step do not divide among {world_size} ranks")
            raise ConfigError(f"train.grad_accum_steps: {b // world_size} x {world_size} ranks x micro "
                              f"{get_path(ours, 'train.micro_batch_size')} is not the global batch of checkpoint "
                              f"{source} ({a} microbatches on {saved_world} ranks); {fit}")
        if a != b:
            changes.append(("train.grad_accum_steps", f"{a} microbatches a step", f"{b}"))
    listed = [f"{k}: {a!r} -> {b!r}" for k, a, b in changes]
    model = [k for k, _, _ in changes if k.startswith("model.")]
    if model and allow_config_change:  # DeepSpeed would fail on the weights' shapes, or load them into another model
        raise ConfigError(f"{model[0]}: checkpoint {source} holds the weights of its own model ({'; '.join(listed)}); "
                          "--allow-config-change continues other changes, never the model's: use another run_dir "
                          "to train this model")
    if changes and not allow_config_change:
        raise ConfigError(f"the config differs from the one checkpoint {source} trained with ({'; '.join(listed)}): "
                          "a resume continues its checkpoint's run. Use another run_dir for a new run (--init-from to "
                          "start it from these weights), or --allow-config-change to continue with the change (logged "
                          "in train.log)")
    return listed


def config_diff(saved, ours, key: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, saved value, our value) of every leaf that differs; a key the checkpoint's config lacks (added
    to the config since, migrated as its old behaviour where that matters) is no difference."""
    if isinstance(saved, dict) and isinstance(ours, dict):
        return [d for k in sorted(saved) if k in ours
                for d in config_diff(saved[k], ours[k], f"{key}.{k}" if key else k)]
    return [] if saved == ours else [(key, saved, ours)]


def resumed_horizon(client: dict, cfg: RunConfig, announce: bool) -> dict:
    """The checkpoint's schedule horizon; a changed optim.schedule_steps is the one way to re-schedule."""
    wanted = cfg.optim.schedule_steps
    if wanted and wanted != client["config"].get("optim", {}).get("schedule_steps"):
        if announce:
            print(f"note: optim.schedule_steps {wanted} replaces the checkpoint's schedule horizon "
                  f"{client['schedule']}", flush=True)
        return {"unit": "steps", "total": wanted}
    return client["schedule"]


def check_init_source(cfg: RunConfig, family, world_size: int, zero_stage: int,
                      trusted: bool = False) -> tuple[Path, dict | None]:
    """(train.init_from resolved, the foreign checkpoint's weights converted by the family or None), checked before
    anything starts. A foreign checkpoint (a Hugging Face directory, a fair-esm .pt) is read and converted here
    (Family.import_weights); the fresh parts of the model (routers, memory) come from the run's seed. A DeepSpeed
    checkpoint must pass check_pickles unless ``trusted`` (--trust-checkpoint)."""
    t = cfg.train
    if is_foreign_checkpoint(t.init_from):
        src = Path(t.init_from)
        if family.import_weights is None:
            raise ConfigError(f"train.init_from: {src} is not a run, checkpoint or export of this pipeline (a "
                              f"Hugging Face directory or a single file), and the {cfg.family} family "
                              "starts from none of another code base")
        if t.init_from_optimizer:
            raise ConfigError(f"train.init_from_optimizer: {src} is a foreign checkpoint (weights only); set it "
                              "to false")
        torch.manual_seed(cfg.seed)  # the fresh parts (routers, memory): the Trainer's initial weights
        fresh = family.build_model(cfg.model).state_dict()
        try:
            return src, family.import_weights(*load_esm2(src), cfg.model, fresh)
        except ValueError as e:  # ConfigError is one; a config that is not the checkpoint's backbone
            raise ConfigError(f"train.init_from: {src}: {e}") from None
    try:
        src = resolve_tag_dir(t.init_from)
    except ConfigError as e:
        raise ConfigError(f"train.init_from: {e}") from None
    check_same_model(load_yaml(src / "config.yaml"), cfg, src)
    if not is_export(src) and not trusted:
        check_pickles(src)
    if t.init_from_optimizer:
        if not is_export(src):  # DeepSpeed loads its files directly (load_state_dict checks the weights-only path)
            check_intact(src)
        if is_export(src):
            raise ConfigError(f"train.init_from_optimizer: {src} is an export (weights only, no optimizer "
                              "state); set it to false or start from a DeepSpeed checkpoint")
        client = read_client_state(src)
        if client.get("world_size") != world_size:
            raise ConfigError(f"train.init_from_optimizer: {src} was written by {client.get('world_size')} "
                              f"ranks, this run has {world_size}; the ZeRO optimizer shards load only on "
                              "the same world size (set it to false to start from the weights alone)")
        if client["zero_stage"] != zero_stage:
            raise ConfigError(f"train.init_from_optimizer: {src} was written under ZeRO stage "
                              f"{client['zero_stage']}, this run uses {zero_stage}")
        src_ep = expert_parallel_size(client["config"])
        if src_ep != t.expert_parallel_size:
            raise ConfigError(f"train.init_from_optimizer: {src} was written with {EP_KEY} {src_ep}, this run "
                              f"uses {t.expert_parallel_size}; the expert optimizer shards load only on the same "
                              "layout (set it to false to start from the weights alone)")
    return src, None


def get_path(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def diff_path(a, b, key: str) -> tuple:
    """(dotted key, a's value, b's value) of the first differing leaf under ``key``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return diff_path(a.get(k), b.get(k), f"{key}.{k}")
    return key, a, b
