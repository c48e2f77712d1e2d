"""Every rank runs the same run on the same storage: checked at setup, before any rank writes into run_dir."""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time

from pipeline.checkpoint.layout import write_atomic
from pipeline.checkpoint.resume import diff_path
from pipeline.config import ConfigError
from pipeline.distributed import all_gather_object, broadcast_object
from pipeline.train.plan import RunPlan

SHARED_CHECK = ".shared-check-"  # RUN_DIR/.shared-check-<random>: rank 0's probe that every rank sees run_dir


def check_ranks_agree(plan: RunPlan, rank: int):
    """Every rank runs the same run on the same storage, or every rank raises the same ConfigError.

    Nodes are started one by one (by hand, or one scheduler task each), each with its own command line and
    files. A node started with another --set, config file or ds_config would train another model or batch
    until some collective mismatched, or silently; a node whose run_dir is on its local disk would write its
    checkpoint shards and samples where no other node, and no resume, finds them. Three checks, in this order:
    the resolved run config and ds_config (a digest each rank computes, gathered; the full dicts only on a
    mismatch, to name the first differing key); that every rank sees the file rank 0 has just written into
    run_dir; that every rank resumes from the same checkpoint. run_dir itself is compared by what it holds, not
    by its string: nodes may mount the shared storage at different paths.
    """
    host = socket.gethostname()
    ours = {k: v for k, v in plan.cfg.to_dict().items() if k != "run_dir"}
    ours["ds_config"] = plan.ds_config
    digest = hashlib.sha256(json.dumps(ours, sort_keys=True, default=str).encode()).hexdigest()
    gathered = all_gather_object((digest, host, os.path.abspath(plan.run_dir), plan.resume_tag))
    hosts = [g[1] for g in gathered]
    odd = [r for r, g in enumerate(gathered) if g[0] != gathered[0][0]]
    if odd:  # every rank sees the same digests, so every rank makes this second gather
        r, full = odd[0], all_gather_object(ours)
        key, a, b = diff_path(full[0], full[r], "")
        raise ConfigError(f"rank {r} (host {hosts[r]}) resolved another run than rank 0 (host {hosts[0]}): "
                          f"{key.lstrip('.')} is {b!r} there and {a!r} on rank 0"
                          f"{f' ({len(odd)} ranks differ)' if len(odd) > 1 else ''}; start every node with the "
                          "same --config, --set and --ds_config")
    # run_dir on shared storage: rank 0 writes a file of a fresh random name (never looked up before, so no
    # client can hold a stale negative cache entry for it) and every rank reads it back. Nothing is created on
    # the other ranks: a rank whose run_dir does not exist simply does not see the file.
    probe = None
    if rank == 0:
        for old in plan.run_dir.glob(f"{SHARED_CHECK}*"):  # left by an attempt killed during its check
            old.unlink(missing_ok=True)
        probe = f"{SHARED_CHECK}{secrets.token_hex(8)}"
        write_atomic(plan.run_dir / probe, probe)
    probe = broadcast_object(probe)
    deadline = time.monotonic() + 2.0  # file systems whose metadata reaches other clients with a delay
    while True:
        try:
            seen = (plan.run_dir / probe).read_text() == probe
        except OSError:
            seen = False
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    blind = [r for r, ok in enumerate(all_gather_object(seen)) if not ok]
    if rank == 0:
        (plan.run_dir / probe).unlink(missing_ok=True)
    if blind:
        r = blind[0]
        raise ConfigError(f"run_dir {gathered[r][2]} on rank {r} (host {hosts[r]}) does not show the file rank 0 "
                          f"(host {hosts[0]}) just wrote into its run_dir {gathered[0][2]}"
                          f"{f' ({len(blind)} ranks do not)' if len(blind) > 1 else ''}: the run directory "
                          "(checkpoints, logs) must be on storage every node shares")
    tags = [g[3] for g in gathered]
    r = next((r for r, t in enumerate(tags) if t != tags[0]), None)
    if r is not None:
        raise ConfigError(f"rank {r} (host {hosts[r]}) would resume from {tags[r] or 'no checkpoint'} and rank 0 "
                          f"(host {hosts[0]}) from {tags[0] or 'no checkpoint'}; start every node with the same "
                          "--resume")
