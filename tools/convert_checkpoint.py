#!/usr/bin/env python
"""Export a DeepSpeed ZeRO (stage 1-3) checkpoint to a consolidated fp32 safetensors directory.

    python tools/convert_checkpoint.py --checkpoint runs/eco_rna_demo --output exports/demo --trust-checkpoint

The output holds ``model.safetensors`` (the full fp32 state dict, independent of the world size and ZeRO stage that
wrote it), ``config.yaml``, ``export.json`` (source, step, world size, MLflow run, tokenizer) and, for the text
families (recursive_gpt, standard_gpt), ``tokenizer.model``: the sentencepiece model of the run's training shards
(found beside them, DATA/tokenizer.model, and checked against their manifest.json's sha256), so BLiMP and LAMBADA run
on the export after the shards are gone. launchers/evaluate.py and pipeline.checkpoint load it directly.
ProtLingo MoE checkpoints of any expert-parallel size (``train.expert_parallel_size``: one DeepSpeed file per expert,
which DeepSpeed's own zero_to_fp32.py cannot read) export to the single-process model's names, every routed expert
under its global id, from the fp32 masters (pipeline.checkpoint.load_state_dict).

DeepSpeed checkpoints are pickles: DeepSpeed's loader (zero_to_fp32) unpickles them with weights_only=False, which
runs any code they hold, so converting one needs --trust-checkpoint. Share exports, which load without executing code.
The export is written to a temporary directory beside --output and renamed into place at the end: a failed conversion
leaves nothing behind. Progress (with a time estimate) goes to stderr; stdout gets the one summary line.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.eval.cli import TRUST_FLAG, TRUST_HELP  # noqa: E402


def text_family(cfg) -> bool:
    """Whether the family reads sentencepiece text (its objective is the causal LM's)."""
    from pipeline.families import get_family
    from pipeline.objectives.causal_lm import CausalLMObjectiveConfig

    return issubclass(get_family(cfg.family).objective_cls, CausalLMObjectiveConfig)


def find_tokenizer(cfg, spm: Path | None, skip: bool) -> tuple[Path | None, dict | None]:
    """(sentencepiece model to copy or None, export.json's tokenizer entry).

    The run's tokenizer is the one its (first) training source's manifest.json names; a sentencepiece model lies
    beside the shards (pipeline.objectives.causal_lm.spm_model_path). ``spm`` overrides where it is read from, but
    must have the manifest's sha256 when the manifest is there. Nucleotide and ESM tokenizers are built into the code:
    only the manifest's entry is recorded."""
    from pipeline.config import ConfigError
    from pipeline.data.shards import MANIFEST, sha256_file
    from pipeline.data.tokenizer import SPM_NAME
    from pipeline.objectives.causal_lm import spm_model_path

    beside = spm_model_path(cfg)
    manifest = beside.parent / MANIFEST
    entry = None
    if manifest.is_file():
        try:
            entry = json.loads(manifest.read_text()).get("tokenizer")
        except (ValueError, AttributeError) as e:
            raise ConfigError(f"{manifest}: not a shard manifest ({e})") from None
    if not ((entry or {}).get("name") == "sentencepiece" or (entry is None and text_family(cfg))):
        return None, entry
    if skip:
        return None, None
    source = spm or beside
    if not source.is_file():
        raise FileNotFoundError(f"{source}: the sentencepiece model of the run's training shards is not there; pass "
                                "--spm MODEL (the model the shards were made with) or --no-tokenizer")
    digest = sha256_file(source)
    if entry and entry.get("sha256") and entry["sha256"] != digest:
        raise ConfigError(f"{source}: sha256 {digest[:12]}... is not the {entry['sha256'][:12]}... that {manifest} "
                          "records: not the tokenizer the shards were made with")
    return source, {**(entry or {"name": "sentencepiece"}), "model": SPM_NAME, "sha256": digest,
                    "source": str(source)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run dir, its checkpoints/ dir, or a tag dir")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument(TRUST_FLAG, action="store_true", help=TRUST_HELP)
    p.add_argument("--spm", type=Path, default=None, help="text families: the sentencepiece model to include "
                   "(default: tokenizer.model beside the run's training shards)")
    p.add_argument("--no-tokenizer", action="store_true", help="text families: export without tokenizer.model "
                   "(evaluation then needs --spm)")
    args = p.parse_args(argv)

    from pipeline.config import ConfigError
    from pipeline.eval.cli import locate_checkpoint, progress, require_trust

    out: Path = args.output
    tmp = None
    bar = None
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"{out}: exists and is not empty")
        if next((a for a in (out.parent, *out.parent.parents) if a.exists()), out.parent).is_file():
            raise ConfigError(f"{out.parent}: --output: a file is in the way of the export's directory")
        if args.spm is not None and not args.spm.is_file():
            raise FileNotFoundError(f"{args.spm}: --spm: no such file")
        from pipeline.checkpoint import EXPORTED_WEIGHTS, is_export, load_trained_model

        tag_dir, cfg, meta = locate_checkpoint(args.checkpoint)
        if is_export(tag_dir):
            raise ConfigError(f"{tag_dir}: already an export ({EXPORTED_WEIGHTS}); copy the directory instead")
        spm, tokenizer = find_tokenizer(cfg, args.spm, args.no_tokenizer)  # before any long work
        require_trust(tag_dir, args.trust_checkpoint)  # before anything is unpickled
        bar = progress(total=3, desc="convert", unit="step")
        bar.set_postfix_str("loading the checkpoint")
        trained = load_trained_model(tag_dir)
        bar.update()
        out.parent.mkdir(parents=True, exist_ok=True)  # e.g. exports/, as the training's summary suggests
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        bar.set_postfix_str(f"writing {EXPORTED_WEIGHTS}")
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in trained.model.state_dict().items()}
        save_file(state, str(tmp / EXPORTED_WEIGHTS))
        bar.update()
        bar.set_postfix_str("config, tokenizer, export.json")
        shutil.copy(tag_dir / "config.yaml", tmp / "config.yaml")
        if spm is not None:
            shutil.copy(spm, tmp / tokenizer["model"])
        keep = {k: meta.get(k) for k in ("step", "world_size", "mlflow_run_id", "mlflow_tracking_uri")}
        (tmp / "export.json").write_text(json.dumps({"source": str(tag_dir), **keep, "tokenizer": tokenizer},
                                                    indent=1))
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
        tmp = None
        bar.update()
    except (ValueError, OSError) as e:  # ConfigError, ShardError: ValueErrors; FileNotFoundError: an OSError
        if bar is not None:
            bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:  # a failed conversion leaves no partial export
            shutil.rmtree(tmp, ignore_errors=True)
    bar.close()
    n = sum(v.numel() for v in state.values())
    extra = f", {tokenizer['model']}" if spm is not None else ""
    print(f"exported {tag_dir} -> {out} ({n:,} parameters{extra})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
