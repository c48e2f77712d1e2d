"""Command-line pieces shared by launchers/evaluate.py, tools/convert_checkpoint.py, tools/flops.py and the other
commands: depth lists and their cap, opening a checkpoint (with the pickle rule), progress bars.

Every error raised here is a ValueError (ConfigError) or FileNotFoundError whose message starts with the flag, file
or directory it is about, so a command prints it as one ``error:`` line.
"""
from __future__ import annotations

import sys
from pathlib import Path

# ---- depths ----------------------------------------------------------------------------------------------------------
# --depths accepts at most this many values and no value above it before the model is known (a typo such as
# 1-100000000 must not build a list of 10^8 ints); the model's own cap (max_depth) is checked once its config is read.
PARSE_LIMIT = 4096
# The documented cap of a depth sweep: DEPTH_CAP_FACTOR x the deepest depth the model was trained at, and never below
# MIN_DEPTH_CAP (the default 1-8 sweep of every family). Why: a recurrent model's cost grows linearly in K (one sweep
# to K costs K core applications per sequence, and RNAGym keeps one [n, V] table per evaluated K), and beyond a few
# times the deepest trained depth a sweep only measures a trajectory the model never approached in training. The
# papers' sweeps stay well inside the cap: Eco-RNA reports K = 1-8 (trained with mean 4), RecursiveGPT its trained R.
DEPTH_CAP_FACTOR = 4
MIN_DEPTH_CAP = 8


def parse_depths(text: str, flag: str = "--depths", maximum: int = PARSE_LIMIT, minimum: int = 1) -> list[int]:
    """``"1-8"``, ``"1,2,4,8"``, ``"1-4,8"`` -> sorted unique ints >= ``minimum`` (seeds pass 0); ValueError naming
    ``flag`` otherwise."""
    out: set[int] = set()
    for part in str(text).split(","):
        a, sep, b = part.strip().partition("-")
        try:
            lo = int(a)
            hi = int(b) if sep else lo
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {part.strip()!r} is neither a depth nor a range such as 1-8 "
                             "(comma-separated positive integers and ranges)") from None
        if lo < minimum or hi < lo:
            raise ValueError(f"{flag} {text!r}: ranges must be {'positive' if minimum == 1 else f'>= {minimum}'} "
                             "and increasing")
        if hi > maximum:
            raise ValueError(f"{flag} {text!r}: depth {hi} is above the maximum {maximum}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def trained_depth(cfg) -> tuple[int, str]:
    """(the deepest depth the model was trained at, which config key says so): the family's ``Depth.trained``
    (Eco-RNA: the depth law's truncation ``objective.k_cap``, ``objective.train_depth`` for a fixed law, the
    fixed-depth control's 1; RecursiveGPT: ``objective.train_depth`` or its recurrence R; the one-depth families:
    their layer count)."""
    from pipeline.families import get_family

    return get_family(cfg.family).depth.trained(cfg)


def max_depth(cfg) -> tuple[int, str]:
    """(cap, explanation): max(MIN_DEPTH_CAP, DEPTH_CAP_FACTOR x :func:`trained_depth`)."""
    k, why = trained_depth(cfg)
    cap = max(MIN_DEPTH_CAP, DEPTH_CAP_FACTOR * k)
    return cap, f"{DEPTH_CAP_FACTOR} x the deepest training depth ({why}), at least {MIN_DEPTH_CAP}"


def check_depths(depths: list[int], cfg, source, flag: str = "--depths", text: str | None = None):
    """ValueError naming ``flag`` and the config file ``source`` when a depth is above :func:`max_depth`."""
    cap, why = max_depth(cfg)
    if depths and max(depths) > cap:
        shown = text if text is not None else ",".join(map(str, depths))
        raise ValueError(f"{flag} {shown!r}: depth {max(depths)} is above the maximum {cap} for {source} ({why}; "
                         "sweeps cost time linear in K and measure depths the model never trained near)")


# ---- checkpoints -----------------------------------------------------------------------------------------------------
TRUST_FLAG = "--trust-checkpoint"
TRUST_HELP = ("load a DeepSpeed checkpoint whose files need more than tensors and the DeepSpeed classes a checkpoint "
              "holds, with torch.load(weights_only=False), which runs any code such a file holds; give it only for "
              "checkpoints you or someone you trust wrote. Checkpoints of this pipeline and exports (model.safetensors) "
              "need nothing: they are read with weights_only=True")


def locate_checkpoint(path) -> tuple[Path, object, dict]:
    """(tag dir, RunConfig, client state or export metadata) of a run dir, checkpoints/ dir, tag dir or export,
    read without loading any weights; every error names the file or directory at fault."""
    from pipeline.checkpoint import EXPORTED_WEIGHTS, is_export, resolve_tag_dir
    from pipeline.checkpoint.layout import load_client, read_json_object
    from pipeline.config import ConfigError, build_config, load_yaml

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such checkpoint directory")
    if not p.is_dir():
        raise ConfigError(f"{p}: not a directory (a run dir, its checkpoints/ dir, a checkpoint tag dir or an "
                          "export)")
    if (p / "export.json").is_file() and not (p / EXPORTED_WEIGHTS).is_file():
        raise ConfigError(f"{p / EXPORTED_WEIGHTS}: missing (an incomplete export)")
    tag_dir = resolve_tag_dir(p)
    if not tag_dir.is_dir():
        raise ConfigError(f"{tag_dir}: named by {tag_dir.parent / 'latest'} but missing (an incomplete checkpoint)")
    config_file = tag_dir / "config.yaml"
    raw = load_yaml(config_file)
    try:
        cfg = build_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{config_file}: {e}") from None
    if not is_export(tag_dir):
        return tag_dir, cfg, load_client(tag_dir, raw=True)
    meta_file = tag_dir / "export.json"  # an export written by hand (model.safetensors + config.yaml) has none
    return tag_dir, cfg, read_json_object(meta_file) if meta_file.is_file() else {}


def require_trust(tag_dir: Path, trusted: bool):
    """The pickle rule, before anything is unpickled: a DeepSpeed checkpoint is read when its files need only
    tensors and DeepSpeed's own classes (pipeline.checkpoint.read.check_pickles; silently), or with
    --trust-checkpoint (then with a one-line warning); otherwise a one-line ConfigError names the file and what it
    would call. Exports pass silently."""
    from pipeline.checkpoint import is_export
    from pipeline.checkpoint.read import check_pickles

    if is_export(tag_dir):
        return
    if not trusted:
        check_pickles(tag_dir)
        return
    print(f"warning: {TRUST_FLAG}: unpickling {tag_dir} with torch.load(weights_only=False), which runs any code the "
          "files hold", file=sys.stderr)


# ---- progress --------------------------------------------------------------------------------------------------------
def progress(iterable=None, *, total=None, desc: str | None = None, unit: str = "it"):
    """A tqdm bar on stderr (elapsed, remaining and rate), so stdout keeps only results. Redrawn at most every
    0.5 s on a terminal and every 10 s into a log file; ``TQDM_DISABLE=1`` turns every bar off."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 10.0)
