#!/usr/bin/env python
r"""Export a DeepSpeed ZeRO (stage 1-3) checkpoint to one directory that pipeline.load_pretrained and the
transformers Auto classes load.

    python tools/convert_checkpoint.py --checkpoint runs/eco_rna_demo --output exports/demo
    python tools/convert_checkpoint.py --checkpoint runs/eco_rna_demo --tag step00001000 --output exports/demo \
        --dtype bf16 --force

--checkpoint is a run dir or its checkpoints/ dir (--tag picks the checkpoint: latest, the default, or a tag
stepNNNNNNNN; an unknown tag is an error listing the tags there), or a tag dir itself.

The output holds:
  model.safetensors  the full state dict (independent of the world size, ZeRO stage and expert-parallel size that
                     wrote it), fp32 or, with --dtype bf16, every floating tensor cast to bf16; the pipeline's names,
                     except a ProtLingo without MoE and memory (an ESM2), written as transformers' EsmForMaskedLM
  config.json        the Hugging Face config (pipeline/hf.py: EcoRNAConfig with num_loops = the trained mean depth,
                     RecursiveGPTConfig / StandardGPTConfig, ProtLingoConfig, or transformers' EsmConfig), so that
                     after ``import pipeline.hf`` AutoModelForMaskedLM / AutoModelForCausalLM load the directory
  config.yaml        the run's config (pipeline.load_pretrained, launchers/evaluate.py, --init-from read it)
  export.json        source, step, world size, MLflow run, tokenizer, format, dtype, task_depths
  README.md          a model card: source run, step, MLflow run, data manifest sha256, the evaluation results found
                     beside the checkpoint (eval-*.json), what was trusted, how to load it
  tokenizer          text families: tokenizer.model, the sentencepiece model of the run's training shards (found
                     beside them, DATA/tokenizer.model, and checked against their manifest.json's sha256), so BLiMP
                     and LAMBADA run on the export after the shards are gone; ProtLingo / ESM2: vocab.txt and
                     tokenizer_config.json (EsmTokenizer, AutoTokenizer); Eco-RNA: the nucleotide vocabulary in
                     config.json ("tokenizer") and data.molecule in config.yaml

ProtLingo MoE checkpoints of any expert-parallel size (``train.expert_parallel_size``: one DeepSpeed file per expert,
which DeepSpeed's own zero_to_fp32.py cannot read) export to the single-process model's names, every routed expert
under its global id, from the fp32 masters (pipeline.checkpoint.load_state_dict).

DeepSpeed checkpoints are pickles. They are read with torch.load(weights_only=True) and DeepSpeed's few classes
allowed by name (pipeline.checkpoint.read.weights_only_loads; every checkpoint this pipeline writes passes); one whose
files would call anything else is refused, naming the file and the global, unless --trust-checkpoint. Share exports,
which hold no pickle.
The export is written to a temporary directory beside --output and renamed into place at the end: a failed conversion
leaves nothing behind. An existing non-empty --output is refused unless it is an export (holds export.json) and
--force is given; then the old export is swapped out only after the new one is complete (never a half-written export
at --output). Anything else (a training run, a folder of exports) is never replaced, --force or not. Progress (per
stage and per tensor, with a time estimate) goes to stderr; stdout gets the one summary line.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.eval.cli import TRUST_FLAG, TRUST_HELP  # noqa: E402

TOOL = "convert_checkpoint.py"  # the name its outputs' marker gives (pipeline/outputs.py)


def text_family(cfg) -> bool:
    """Whether the family reads sentencepiece text (its spec's ``text``)."""
    from pipeline.families import get_family

    return get_family(cfg.family).text


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


def resolve_checkpoint(path: Path, tag: str) -> Path:
    """The checkpoint --checkpoint and --tag name: ``path`` itself (--tag latest) or the tag dir ``tag`` of the run's
    checkpoints/ dir. ConfigError listing the tags there for an unknown one."""
    from pipeline.config import ConfigError
    from pipeline.checkpoint.layout import checkpoint_tags

    if tag == "latest":
        return path
    ckpts = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    tags = checkpoint_tags(ckpts)
    if not tags and not (ckpts / "latest").is_file():
        raise ConfigError(f"{path}: --tag {tag}: not a run dir or a checkpoints/ dir (a tag dir or an export takes "
                          "no --tag)")
    if tag not in tags:
        raise ConfigError(f"{ckpts}: --tag {tag}: no such checkpoint (tags there: {', '.join(tags) or 'none'})")
    return ckpts / tag


def manifest_hashes(cfg) -> list[tuple[str, str, str | None]]:
    """(source name, manifest path, sha256 or None when absent) of every training source of the run."""
    from pipeline.data.shards import MANIFEST, sha256_file

    specs = [(s.name, s.shards) for s in cfg.data.sources] or [("train", cfg.data.train_shards)]
    out = []
    for name, spec in specs:
        manifest = Path(str(spec)) / MANIFEST
        out.append((name, str(manifest), sha256_file(manifest) if manifest.is_file() else None))
    return out


def evaluation_results(tag_dir: Path) -> list[tuple[Path, dict]]:
    """launchers/evaluate.py's JSON results beside the checkpoint: TAG_DIR/eval-TASK.json (its default --output),
    and eval-*.json in the run dir."""
    found = []
    for d in (tag_dir, tag_dir.parent.parent):
        for f in sorted(d.glob("eval-*.json")):
            try:
                result = json.loads(f.read_text())
            except (OSError, ValueError):
                continue  # a foreign or unreadable file: not a result
            if isinstance(result, dict) and "table" in result and "columns" in result:
                found.append((f, result))
    return found


def _cell(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def model_card(*, tag_dir: Path, cfg, meta: dict, fmt: str, hf_cfg, dtype: str, trusted: bool,
               tokenizer: dict | None) -> str:
    """README.md of the export (module docstring)."""
    step = meta.get("step", "unknown")
    run, uri = meta.get("mlflow_run_id"), meta.get("mlflow_tracking_uri")
    lines = [f"# {cfg.family} export of {tag_dir.parent.parent.name}, step {step}", "",
             "## Source", "", f"- run: `{tag_dir.parent.parent}`", f"- checkpoint: `{tag_dir}` (step {step}, "
             f"written by {meta.get('world_size', '?')} processes, ZeRO stage {meta.get('zero_stage', '?')})",
             f"- MLflow run: `{run}` (tracking URI `{uri}`)" if run else "- MLflow run: none recorded",
             f"- family: `{cfg.family}`; weights: `{fmt}` names, {dtype}"]
    for name, path, digest in manifest_hashes(cfg):
        lines.append(f"- data manifest ({name}): `{path}` sha256 `{digest}`" if digest else
                     f"- data manifest ({name}): `{path}` not found at export time (no hash)")
    if tokenizer and tokenizer.get("sha256"):
        lines.append(f"- tokenizer: `{tokenizer.get('model')}` sha256 `{tokenizer['sha256']}`")
    from pipeline.tasks import training_spec

    export = training_spec(cfg).hf_export()  # an adapted model's (a task: section), else the family's
    card, usage = export.card(hf_cfg) if export is not None and fmt == "pipeline" else ([], [])
    lines += card
    lines += ["", "## Evaluation results found beside the checkpoint", ""]
    results = evaluation_results(tag_dir)
    if not results:
        lines.append("none found (launchers/evaluate.py writes TAG_DIR/eval-TASK.json)")
    for f, r in results:
        cols = [str(c) for c in r["columns"]]
        lines += [f"`{f.name}`: task {r.get('task', '?')}, data `{r.get('data', '?')}`, seed {r.get('seed', '?')}",
                  "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in r["table"]]
        lines.append("")
    how = ("torch.load(weights_only=False): the converting user vouched for the files with --trust-checkpoint"
           if trusted else "torch.load(weights_only=True), DeepSpeed's few classes allowed by name: nothing in them "
           "could run code")
    lines += ["", "## What was trusted", "",
              f"The DeepSpeed checkpoint was read by {how}. This export holds no pickle: model.safetensors (tensors "
              "only), JSON/YAML/text files and the model's Python code (the `.py` files: this repository's "
              "pipeline/families/modeling_*.py and the pipeline/models/ modules it imports, imports made relative). "
              "`trust_remote_code=True` runs that code, which only builds the model.", "", "## How to load", "",
              "```python"]
    if fmt != "pipeline":  # another library's directory: its own loading code
        lines += list(export.foreign_usage)
    elif export is not None and export.causal:
        lines += ["from transformers import pipeline",
                  "generate = pipeline(\"text-generation\", model=\"EXPORT_DIR\", trust_remote_code=True)",
                  f"generate({export.example!r}, max_new_tokens=20, min_new_tokens=20, do_sample=False)", "",
                  "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "model = AutoModelForCausalLM.from_pretrained(\"EXPORT_DIR\", trust_remote_code=True)",
                  "tokenizer = AutoTokenizer.from_pretrained(\"EXPORT_DIR\", trust_remote_code=True)", *usage]
    elif export is not None and not export.example:  # no fill-mask example (an adapted model): its own lines
        lines += list(usage)
    elif export is not None:
        lines += ["from transformers import pipeline",
                  "fill = pipeline(\"fill-mask\", model=\"EXPORT_DIR\", trust_remote_code=True)",
                  f"fill({export.example!r})", "",
                  "from transformers import AutoModelForMaskedLM, AutoTokenizer",
                  "model = AutoModelForMaskedLM.from_pretrained(\"EXPORT_DIR\", trust_remote_code=True)",
                  "tokenizer = AutoTokenizer.from_pretrained(\"EXPORT_DIR\", trust_remote_code=True)", *usage]
    else:
        lines.append(f"# {cfg.family} has no Hugging Face classes: pipeline.load_pretrained only")
    lines += ["", "# with this repository installed: the pipeline module and the pipeline's tokenizer", "import pipeline",
              "model, tokenizer = pipeline.load_pretrained(\"EXPORT_DIR\")"]
    return "\n".join(lines + ["```", ""])


def write_export(tmp: Path, model, cfg, *, tag_dir: Path, meta: dict, spm: Path | None, tokenizer: dict | None,
                 dtype: str = "fp32", trusted: bool = False, bar=None, milestone: dict | None = None,
                 shown: Path | None = None) -> None:
    """Write the export of ``model`` (a pipeline module of ``cfg``) into the empty directory ``tmp``: the files the
    module docstring lists. ``tag_dir``/``meta``: the checkpoint it came from and its client state (the card, and
    export.json's step, world size and MLflow run); ``milestone``: {"target", "words", "step"} of a word-milestone
    export (export.json "milestone", what launchers/evaluate.py --milestones reads). ``bar``: advanced through the
    cast, the weights and the small files. ``shown``: the path errors name (the export being published; default
    ``tmp``): a user never sees the staging directory's name."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from pipeline import hf  # imports transformers (seconds): callers run their checks first
    from pipeline.checkpoint import EXPORTED_WEIGHTS
    from pipeline.config import dump_yaml
    from pipeline.hf_code import write_modeling_code
    from pipeline.tasks import training_spec

    step = bar.update if bar is not None else (lambda: None)
    note = bar.set_postfix_str if bar is not None else (lambda _: None)
    export = training_spec(cfg).hf_export()  # a task: section: the adapted model's; None: no HF classes
    hf_cfg = hf.hf_config(cfg) if export is not None else None
    fmt = hf.export_format(cfg)
    state = model.state_dict()
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    note(f"casting {len(state)} tensors to {dtype}")
    for name in list(state):  # cast (floating ones) and contiguous, ready for safetensors
        t = state[name]
        state[name] = (t.to(torch_dtype) if t.is_floating_point() else t).contiguous()
    step()
    if fmt != "pipeline":
        state = export.to_foreign(state, cfg.model)  # e.g. transformers' EsmForMaskedLM names
    note(f"writing {EXPORTED_WEIGHTS}")
    try:
        save_file(state, str(tmp / EXPORTED_WEIGHTS), metadata={"format": "pt"})  # "pt": what transformers expects
    except SafetensorError as e:  # a full disk: safetensors' own error, its reason in Rust's Debug text
        reason = re.search(r'message: "([^"]+)"', str(e))
        raise OSError(f"{shown or tmp}: cannot write {EXPORTED_WEIGHTS} ({reason[1] if reason else e}); nothing was "
                      "exported") from None
    step()
    note("config, tokenizer, export.json, README.md")
    if (tag_dir / "config.yaml").is_file():
        shutil.copy(tag_dir / "config.yaml", tmp / "config.yaml")
    else:
        (tmp / "config.yaml").write_text(dump_yaml(cfg))
    if hf_cfg is not None:
        hf_cfg.dtype = "bfloat16" if dtype == "bf16" else "float32"
        hf_cfg.save_pretrained(str(tmp))  # config.json
        if fmt == "pipeline" and export.modeling:  # their code and auto_map: loads without this repository
            write_modeling_code(tmp, export)
    if spm is not None:
        shutil.copy(spm, tmp / tokenizer["model"])
    if export is not None and export.write_tokenizer is not None:  # tokenizer.json & co. for AutoTokenizer
        export.write_tokenizer(tmp, cfg, spm)
    keep = {k: meta.get(k) for k in ("step", "world_size", "mlflow_run_id", "mlflow_tracking_uri")}
    words = (meta.get("cumulative") or {}).get("words")
    (tmp / "export.json").write_text(json.dumps(
        {"source": str(tag_dir), **keep, "words": words, "tokenizer": tokenizer, "format": fmt, "dtype": dtype,
         "hf_model_type": hf_cfg.model_type if hf_cfg is not None else None,
         "task_depths": dict(getattr(hf_cfg, "task_depths", None) or {}),
         **({"milestone": milestone} if milestone else {})}, indent=1))
    (tmp / "README.md").write_text(model_card(tag_dir=tag_dir, cfg=cfg, meta=meta, fmt=fmt, hf_cfg=hf_cfg,
                                              dtype=dtype, trusted=trusted, tokenizer=tokenizer))
    step()


def export_milestones(tmp: Path, checkpoint: Path, cfg, *, spm, tokenizer, dtype: str, trusted: bool,
                      out: Path) -> list:
    """Every word milestone of the run ``checkpoint`` exported as ``tmp/chck_NAME/`` (pipeline/eval/milestones.py:
    the checkpoint that reached each milestone; a missing one is named on stderr and left out), errors naming
    ``out/chck_NAME``. Returns the milestones exported."""
    from pipeline.checkpoint import load_trained_model
    from pipeline.checkpoint.layout import read_client
    from pipeline.eval.cli import locate_checkpoint, progress, require_trust
    from pipeline.eval.milestones import run_milestones

    found, missing = run_milestones(Path(checkpoint))
    for line in missing:
        print(f"warning: {line}", file=sys.stderr)
    for m in progress(found, desc="milestones", unit="export"):
        require_trust(m.path, trusted)
        tag_dir, m_cfg, meta = locate_checkpoint(m.path)
        model = load_trained_model(tag_dir, trusted=trusted).model
        sub = tmp / m.name
        sub.mkdir()
        write_export(sub, model, m_cfg, tag_dir=tag_dir, meta=meta or read_client(tag_dir) or {}, spm=spm,
                     tokenizer=tokenizer, dtype=dtype, trusted=trusted,
                     milestone={"target": m.target, "words": m.words, "step": m.step}, shown=out / m.name)
    return found


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="run dir, its checkpoints/ dir, or a tag dir")
    p.add_argument("--tag", default="latest", help="with a run dir or checkpoints/ dir: latest (default: what "
                   "'latest' names, else the newest complete checkpoint) or a tag such as step00001000")
    p.add_argument("--output", required=True, type=Path, help="the export directory (must not exist or be empty, "
                   "unless it is an export and --force is given)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the floating tensors written "
                   "(default fp32, the ZeRO fp32 masters as they are)")
    p.add_argument("--force", action="store_true", help="replace an existing export at --output (it holds "
                   "export.json): the new export is completed beside it first, then swapped in")
    p.add_argument(TRUST_FLAG, action="store_true", help=TRUST_HELP)
    p.add_argument("--spm", type=Path, default=None, help="text families: the sentencepiece model to include "
                   "(default: tokenizer.model beside the run's training shards)")
    p.add_argument("--no-tokenizer", action="store_true", help="text families: export without tokenizer.model "
                   "(evaluation then needs --spm)")
    p.add_argument("--milestones", action="store_true", help="also export every word milestone of the run "
                   "(checkpoint.at_words) as OUTPUT/chck_1M/, chck_2M/, ... (chck_NK below a million), each a "
                   "complete export; the --tag checkpoint stays at OUTPUT's top")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    from pipeline.config import ConfigError
    from pipeline.eval.cli import locate_checkpoint, progress, require_trust
    from pipeline.outputs import check_output_dir, kept_note, publish_dir, staging_dir, written_by

    out: Path = args.output
    tmp = None
    bar = None
    try:
        check_output_dir(out, force=args.force, owned=written_by(TOOL), what="an export", tool=TOOL)
        tmp = staging_dir(out)  # before the long work: a read-only destination is refused at once
        if args.spm is not None and not args.spm.is_file():
            raise FileNotFoundError(f"{args.spm}: --spm: no such file")
        from pipeline.checkpoint import EXPORTED_WEIGHTS, is_export, load_trained_model

        if not args.checkpoint.exists():
            raise FileNotFoundError(f"{args.checkpoint}: no such checkpoint directory")
        from pipeline.checkpoint.layout import check_intact, hold_off_rotation

        hold_off_rotation(args.checkpoint)  # a training rotating the run's checkpoints keeps this one until we exit
        tag_dir, cfg, meta = locate_checkpoint(resolve_checkpoint(args.checkpoint, args.tag))
        if is_export(tag_dir):
            raise ConfigError(f"{tag_dir}: already an export ({EXPORTED_WEIGHTS}); copy the directory instead")
        source = tag_dir.resolve()
        if out.exists() and (out.resolve() == source or out.resolve() in source.parents):
            raise ConfigError(f"{out}: --output holds the checkpoint being exported; --force would delete it")
        spm, tokenizer = find_tokenizer(cfg, args.spm, args.no_tokenizer)  # before any long work
        require_trust(tag_dir, args.trust_checkpoint)  # before anything is unpickled
        check_intact(tag_dir)  # a damaged checkpoint is refused (and an undigested one said) before the progress bar
        from pipeline import hf  # imports transformers (seconds): after the checks that refuse at once

        fmt = hf.export_format(cfg)
        # Five steps, one total from the start (a total that grew to the tensor count once the checkpoint was read
        # made the bar jump back from 25%): the read (one call into zero_to_fp32 or safetensors) and the write of
        # model.safetensors take the time; the cast, the small files and the final rename are quick.
        bar = progress(total=5, desc="convert", unit="step")
        bar.set_postfix_str("loading the checkpoint")
        trained = load_trained_model(tag_dir, trusted=args.trust_checkpoint)
        bar.update()
        write_export(tmp, trained.model, cfg, tag_dir=tag_dir, meta=meta, spm=spm, tokenizer=tokenizer,
                     dtype=args.dtype, trusted=args.trust_checkpoint, bar=bar, shown=out)
        exported = []
        if args.milestones:  # one export per word milestone, EXPORT/chck_NAME/ (pipeline/eval/milestones.py)
            exported = export_milestones(tmp, args.checkpoint, cfg, spm=spm, tokenizer=tokenizer, dtype=args.dtype,
                                         trusted=args.trust_checkpoint, out=out)
        kept = publish_dir(tmp, out, TOOL)  # an existing export (--force) goes only once the new one is in place
        tmp = None
        bar.update()
    except (ValueError, OSError) as e:  # ConfigError, ShardError: ValueErrors; FileNotFoundError: an OSError
        if bar is not None:
            bar.close()
        where = f"{e.filename}: " if isinstance(e, OSError) and e.filename and e.strerror else ""
        print(f"error: {where}{e.strerror if where else e}", file=sys.stderr)  # [Errno 28] ... -> path: reason
        return 2
    finally:
        if tmp is not None:  # a failed conversion leaves no partial export
            shutil.rmtree(tmp, ignore_errors=True)
    bar.close()
    n = sum(p.numel() for p in trained.model.parameters())  # as num_parameters() and tools/params.py count
    names = {name for name, _ in trained.model.named_parameters()}
    buffers = sum(v.numel() for k, v in trained.model.state_dict().items() if k not in names)
    state = f" + {buffers:,} buffer values" if buffers else ""  # saved state (ProtLingo's memory usage flags)
    extra = f", {tokenizer['model']}" if spm is not None else ""
    print(f"exported {tag_dir} -> {out} ({n:,} parameters{state}, {args.dtype}, {fmt} names{extra})")
    for m in exported:
        print(f"exported {m.path} -> {out / m.name} (milestone {m.target:,} words: {m.words:,} seen at step {m.step})")
    if kept:
        print(kept_note(kept, TOOL), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
