"""RunPlan: everything a training resolves before it starts, and every check that can fail fast.

A pure resolution of the config, the world size, the ds_config, the batch arithmetic, the resume point and the
data against the model: no process group, no DeepSpeed engine, nothing written. The Trainer starts from one; the
dry run (pipeline/train/dry_run.py) prints one, so what would fail at the start of a training fails there with the
same line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path

import torch

from pipeline.checkpoint.layout import check_no_links
from pipeline.checkpoint.read import check_pickles, read_client_state
from pipeline.checkpoint.resume import check_init_source, check_reshard, check_resume_config, find_resume_tag
from pipeline.checkpoint.read import load_state_dict
from pipeline.config import ConfigError, RunConfig, load_yaml
from pipeline.data.compat import check_shards_fit
from pipeline.data.loader import ShardStream
from pipeline.data.remote import CacheSettings, RetryPolicy, fingerprint, is_remote, manifest_of
from pipeline.data.shards import ShardError
from pipeline.data.streams import (Source, StreamLayout, is_url_pattern, reshard_states, resolve_shards,
                                   saved_layout)
from pipeline.ds_config import load_ds_config, resolve_ds_config
from pipeline.tasks import training_spec
from pipeline.parallel import check_parallelism
from pipeline.train.memory import resolve_auto, training_device
from pipeline import validation


def _shards(spec) -> list:
    """The shards a shard set's manifest lists, local or remote ([] when it has none to read: named by the checks
    that read the data)."""
    try:
        return manifest_of(spec).shards
    except (OSError, ShardError):
        return []


class RunPlan:
    def __init__(self, cfg: RunConfig, ds_config_path: str, resume: str = "auto", allow_config_change: bool = False,
                 world_size: int | None = None, *, trust_checkpoint: bool = False, allow_data_change: bool = False):
        """Resolve and check every input (config, ds_config, resume point, data) without starting anything.

        ``world_size``: the number of ranks to plan for; None reads WORLD_SIZE (set by the launcher), as a training
        does. The dry run passes another one to check a bigger run from a login node. ``trust_checkpoint``
        (--trust-checkpoint): DeepSpeed may unpickle the checkpoint to resume or start from even when its files need
        more than tensors and DeepSpeed's classes (pipeline.checkpoint.read.check_pickles). ``allow_data_change``
        (--allow-data-change): resume although the shard directories' manifests differ from the ones the checkpoint
        trained on; the loader then starts the new data from its beginning."""
        self.cfg = cfg
        self.family = training_spec(cfg)  # the family's spec, or an adapted model's (a task: section)
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.resume = resume
        self.allow_config_change = allow_config_change
        world_size = self.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        for p in (self.run_dir, *self.run_dir.parents):  # a file where the run directory (or a parent) belongs
            if p.exists() and not p.is_dir():
                raise ConfigError(f"run_dir: {p} exists and is not a directory; choose another run_dir")
        check_no_links(self.ckpt_dir)
        # resume_note: set when resume falls back from what 'latest' names
        self.resume_tag, self.resume_note = find_resume_tag(resume, self.ckpt_dir)
        self.trust_checkpoint = trust_checkpoint
        if self.resume_tag and not trust_checkpoint:  # refused here, in one line, before any process loads it
            check_pickles(self.ckpt_dir / self.resume_tag)
        self.saved = read_client_state(self.ckpt_dir / self.resume_tag) if self.resume_tag else None
        raw_ds = load_ds_config(ds_config_path)
        # train.max_tokens_per_microbatch: auto sized by the memory model (its ZeRO stage and precision read from
        # the ds_config first), or kept from the checkpoint resumed; the run uses the resolved config from here on
        self.microbatch = None
        if cfg.train.max_tokens_per_microbatch == "auto":
            probe = resolve_ds_config(raw_ds, dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, max_tokens_per_microbatch=None, global_batch_tokens=None)),
                world_size, ds_config_path, torch.cuda.is_available())
            cfg, self.microbatch = resolve_auto(cfg, self.family, world=world_size, ds_config=probe,
                                                saved=self.saved, device=training_device())
            self.cfg = cfg
        cfg.check_world_size(world_size)
        self.ds_config = resolve_ds_config(raw_ds, cfg, world_size, ds_config_path, torch.cuda.is_available())
        self.ds_config_path = ds_config_path
        self.zero_stage = self.ds_config.get("zero_optimization", {}).get("stage", 0)
        # Expert parallelism and the MoE backend: EP size against experts, world size and ZeRO stage (ZeRO-3: none).
        self.dtype = torch.bfloat16 if self.ds_config["bf16"]["enabled"] else torch.float32
        self.moe_backend = check_parallelism(cfg, world_size, self.zero_stage, self.dtype)
        # resuming on another world size, ZeRO stage or EP size: None, "universal" (DeepSpeed's universal
        # checkpoint) or "consolidated" (expert parallelism: the project's full-tensor path)
        self.reshard = None
        self.config_changes = []  # "key: old -> new" that --allow-config-change let through (printed, so logged)
        if self.saved:  # before DeepSpeed starts: a resume that would change the data order is refused here
            source = self.ckpt_dir / self.resume_tag
            self.config_changes = check_resume_config(self.saved["config"], cfg, source,
                                                      self.saved.get("world_size"), world_size, allow_config_change)
            self.reshard = check_reshard(self.saved, source, world_size, self.zero_stage,
                                         cfg.train.expert_parallel_size)
        # what each source's manifest is now (the checkpoint records it); data that changed under a resume is refused
        # (a remote set's manifest is read here: missing credentials or an unreachable store fail now, in one line)
        self.data_fingerprint = {key: fingerprint(spec) for key, spec in self.shard_specs()}
        self.data_changed = self._check_data(allow_data_change) if self.saved else None
        self.loader_layout, self.resumed_loader = self._loader_layout(None if self.data_changed else self.saved)
        self.dataset_samples = 0  # one epoch: every sample of every source once (for train.max_epochs)
        for key, spec in self.shard_specs():
            # The shards' tokenizer (manifest) must be the one this family reads, with ids inside model.vocab_size.
            check_shards_fit(spec, self.family, cfg.model.vocab_size, key)
            shards = resolve_shards(spec)  # reads the manifest (or, for brace URLs, every tar once)
            n = len(shards)
            self.dataset_samples += sum(sh.samples for sh in shards)
            if n < self.loader_layout.streams:
                raise ConfigError(f"{key}: {spec} has {n} shards, fewer than the {self.loader_layout.streams} loader "
                                  f"streams ({self.loader_layout.describe()})")
        self._check_step_fits(world_size)
        self.val_dirs = validation.check_validation(cfg, self.family)  # refused like the train shards
        self.cache = self._cache_settings()
        self.warnings = self._warnings()  # the run goes on; rank 0 and the dry run print them
        # A run that has checkpoints of its own continues from them; init_from only seeds its first start. A foreign
        # checkpoint's weights are read and converted here (foreign_state), so a mismatch fails before DeepSpeed.
        self.init_source, self.foreign_state = (
            check_init_source(cfg, self.family, world_size, self.zero_stage, trust_checkpoint)
            if cfg.train.init_from and not self.resume_tag else (None, None))
        if self.init_source is not None and self.foreign_state is None and self.family.init_state is not None:
            # a model that is more than its source (a task head on a pretrained backbone): the whole state to start
            # from, or None when the source already holds every tensor
            src = self.init_source
            self.foreign_state = self.family.init_state(cfg, load_yaml(src / "config.yaml"),
                                                        lambda: load_state_dict(src, trust_checkpoint))

    @property
    def finished(self) -> bool:
        """The checkpoint resumed is already at train.max_steps: nothing to do."""
        return bool(self.saved) and self.saved["step"] >= self.cfg.train.max_steps

    def _check_data(self, allow: bool) -> str | None:
        """None when every source's manifest is the one the checkpoint trained on (or the checkpoint predates the
        record); else, with ``allow``, the note to print (the loader starts over); without it, a ConfigError."""
        saved = self.saved.get("data_fingerprint") or {}
        changed = [(key, saved[key], now) for key, now in self.data_fingerprint.items()
                   if key in saved and saved[key] and now and saved[key]["sha256"] != now["sha256"]]
        if not changed:
            return None
        key, was, now = changed[0]
        spec = dict(self.shard_specs())[key]
        what = (f"{key}: {Path(spec) / 'manifest.json'} is not the data checkpoint {self.ckpt_dir / self.resume_tag} "
                f"trained on ({was['shards']} shards, {was['samples']:,} samples then; {now['shards']} shards, "
                f"{now['samples']:,} samples now)")
        if not allow:
            raise ConfigError(f"{what}: its loader position means nothing in other data. Restore that data, or use "
                              "another run_dir, or resume with --allow-data-change to read this data from its "
                              "beginning")
        return f"{what}; --allow-data-change: the loader starts this data from its beginning"

    def _cache_settings(self) -> CacheSettings | None:
        """Where the shards of remote sources are fetched to (pipeline/data/remote.py), None when every source is
        local; a data.cache_bytes that cannot hold the largest shard is refused here, not found as a hang later."""
        d = self.cfg.data
        specs = [(key, spec) for key, spec in self.shard_specs() if is_remote(spec)]
        specs += [("data.val_shards", v) for v in self.val_dirs if is_remote(v)]
        if not specs:
            return None
        largest = max(((ref.remote.size, ref.remote.url, key) for key, spec in specs for ref in resolve_shards(spec)),
                      key=lambda x: x[0])
        if d.cache_bytes < largest[0]:
            raise ConfigError(f"data.cache_bytes: {d.cache_bytes:,} bytes cannot hold the largest shard, "
                              f"{largest[1]} ({largest[0]:,} bytes, {largest[2]}); every shard is fetched whole into "
                              f"the cache before it is read: set data.cache_bytes to at least {largest[0]:,} (about "
                              f"{d.prefetch_shards + 1} shards per loader process for the loader not to wait)")
        directory = d.cache_dir or str(Path(tempfile.gettempdir()) / (
            "bioseq-shards-" + hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:12]))
        # the processes of one node that share the cache: its ranks, each with its DataLoader workers
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or self.world_size)
        return CacheSettings(str(Path(directory).resolve()), d.cache_bytes, d.prefetch_shards,
                             RetryPolicy(d.fetch_retries, d.fetch_backoff_s), local * max(1, d.num_workers))

    def _warnings(self) -> list[str]:
        """Settings that run but are almost certainly not what was meant."""
        cfg, out = self.cfg, []
        t, g = cfg.train, cfg.train.global_batch_tokens
        if g is not None and t.max_tokens_per_microbatch is None:
            out.append(f"train.global_batch_tokens ({g:,}) is not used: microbatches are train.micro_batch_size "
                       f"{t.micro_batch_size} rows (it sizes train.max_tokens_per_microbatch: auto)")
        elif g is not None and not self.microbatch and not (
                0 <= g - t.max_tokens_per_microbatch * t.grad_accum_steps * self.world_size
                < t.grad_accum_steps * self.world_size):  # an explicit budget, not one auto resolved
            out.append(f"train.global_batch_tokens ({g:,}) is not used: the explicit train.max_tokens_per_microbatch "
                       f"{t.max_tokens_per_microbatch:,} x grad_accum_steps {t.grad_accum_steps} x "
                       f"{self.world_size} ranks applies (auto sizes it to the global batch)")
        if cfg.optim.warmup_steps > cfg.train.max_steps:
            out.append(f"optim.warmup_steps ({cfg.optim.warmup_steps:,}) exceeds train.max_steps "
                       f"({cfg.train.max_steps:,}): the learning rate never reaches optim.lr")
        out += self._leaks()
        return out

    def _leaks(self) -> list[str]:
        """Validation shards that are training shards: the same shard set (directory or URL), or shards whose content
        is (the same sha256 in both manifests; a byte-identical copy of the training shards under another path gave
        no warning). Records repacked into other shards are not seen here: data_prep's --val-fraction split keeps a
        record on one side by its id."""
        where = lambda s: s.rstrip("/") if is_remote(s) else Path(s).resolve()  # noqa: E731
        train_dirs, digests, out = {}, {}, []
        for key, spec in self.shard_specs():
            if is_url_pattern(spec):
                continue
            train_dirs[where(spec)] = key
            for s in _shards(spec):
                digests.setdefault(s.sha256, (key, spec))
        for d in self.val_dirs:
            if where(d) in train_dirs:
                out.append(f"data.val_shards: {d} is also {train_dirs[where(d)]}: validation would "
                           "measure training data, not held-out data")
                continue
            shards = _shards(d)
            shared = [s for s in shards if s.sha256 in digests]
            if shared:
                key, spec = digests[shared[0].sha256]
                out.append(f"data.val_shards: {len(shared)} of the {len(shards)} shards of {d} are shards of {key} "
                           f"({spec}) byte for byte (the same sha256 in both manifests, e.g. {shared[0].path}): "
                           "validation would measure training data, not held-out data")
        return out

    def _check_step_fits(self, world_size: int):
        """Refuse, before anything starts, a step that reads more samples than the training set holds: each step
        holds every microbatch in memory (the token count of the whole step normalises its loss), so such a step
        only grows memory for minutes. A microbatch holds micro_batch_size samples, or at least one under a token
        budget (train.max_tokens_per_microbatch)."""
        t = self.cfg.train
        per_micro = 1 if t.max_tokens_per_microbatch else t.micro_batch_size
        need = t.grad_accum_steps * per_micro * world_size
        if need > self.dataset_samples:
            raise ConfigError(
                f"train.grad_accum_steps: one step reads at least {need:,} samples (grad_accum_steps "
                f"{t.grad_accum_steps:,} x {per_micro} a microbatch x {world_size} ranks) but the training set holds "
                f"{self.dataset_samples:,}; lower train.grad_accum_steps or train.micro_batch_size")

    def _loader_layout(self, saved: dict | None) -> tuple[StreamLayout, list | None]:
        """(the data's stream layout, the checkpoint's loader states dealt to this world size, or None).

        A resumed run keeps its checkpoint's streams, whatever world size reads them now (reshard_states); a new
        run deals the data into data.loader_streams streams (default ranks x max(1, workers))."""
        d = self.cfg.data
        states = (saved or {}).get("loader")
        try:
            if not states:  # a new run, or a checkpoint from before loader states (migrate.py: same world size only)
                layout = StreamLayout.fresh(self.world_size, 0, d.num_workers, d.loader_streams)
            else:
                states = reshard_states(states, self.world_size, d.num_workers)
                layout = StreamLayout(**saved_layout(states[0]), world_size=self.world_size, rank=0)
        except ValueError as e:
            where = f"checkpoint {self.ckpt_dir / self.resume_tag}: " if states else ""
            raise ConfigError(f"{where}{e}") from None
        if layout.local % max(1, d.num_workers):
            raise ConfigError(f"data.num_workers: {d.num_workers} workers cannot share each rank's {layout.local} "
                              f"loader streams ({layout.describe()}); use a number that divides {layout.local}")
        return layout, states

    def shard_specs(self) -> list[tuple[str, str]]:
        """(config key, shard spec) of every source the loader reads."""
        d = self.cfg.data
        if not d.sources:
            return [("data.train_shards", d.train_shards)]
        return [(f"data.sources[{s.name}].shards", s.shards) for s in d.sources]

    def build_dataset(self, rank: int) -> ShardStream:
        """Rank ``rank``'s loader dataset from data.* and train.* (a mixture when data.sources is set; the dry run
        reads every rank's streams from rank 0's)."""
        cfg, d = self.cfg, self.cfg.data
        kwargs = dict(rank=rank, world_size=self.loader_layout.world_size,
                      num_workers=d.num_workers, micro_batch_size=cfg.train.micro_batch_size, seed=cfg.seed,
                      transform=self.family.make_transform(cfg), pad_id=self.family.pad_id,
                      grad_accum_steps=cfg.train.grad_accum_steps, max_tokens=cfg.train.max_tokens_per_microbatch,
                      pack=d.pack, row_length=d.context_length, shuffle_buffer=d.shuffle_buffer,
                      mix_shards=d.mix_shards, vocab_size=cfg.model.vocab_size, verify=d.verify,
                      length_window=d.length_window, streams=self.loader_layout.streams,
                      seed_width=self.loader_layout.seed_width, cache=self.cache)
        if not d.sources:
            return ShardStream(d.train_shards, **kwargs)
        sources = []
        for s in d.sources:
            # A source's molecule picks its random-replacement pool (DNA sources draw T, RNA sources U).
            own = (self.family.make_transform(dataclasses.replace(cfg, data=dataclasses.replace(d, molecule=s.molecule)))
                   if s.molecule not in (None, d.molecule) else None)
            sources.append(Source(s.name, s.shards, own))
        return ShardStream(sources, mixture=d.mixture(), **kwargs)
