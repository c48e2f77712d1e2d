"""Bad inputs to launchers/evaluate.py, tools/convert_checkpoint.py, tools/flops.py, tools/params.py and
tools/inspect_shards.py through the real command line.

Each case must end with one ``error:`` line naming the flag, file or key at fault, a non-zero exit and no traceback
(tests/reliability/bad_input.py), and leave nothing half-written: no evaluation JSON, no export directory, no
temporary file anywhere under the test's directory, and no crafted pickle executed. The checkpoints are tiny models
built in-process (tests/tools/checkpoint_factory.py), so no case trains anything.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bad_input import REPO, assert_one_line_error, run_cli

sys.path.insert(0, str(REPO / "tests" / "tools"))
from checkpoint_factory import tiny_config, write_deepspeed_like, write_export  # noqa: E402

EVALUATE = REPO / "launchers" / "evaluate.py"
CONVERT = REPO / "tools" / "convert_checkpoint.py"
FLOPS = REPO / "tools" / "flops.py"
PARAMS = REPO / "tools" / "params.py"
INSPECT = REPO / "tools" / "inspect_shards.py"
FASTA = REPO / "data" / "samples" / "rfam_nrc_heldout_sample.fasta.gz"
MARKER = "PWNED"  # what a crafted checkpoint's unpickling would create


def evaluate(t: Path, checkpoint, *extra, task="reconstruction", data=FASTA):
    return [EVALUATE, "--checkpoint", checkpoint, "--task", task, "--data", data, "--no-mlflow", "--output",
            t / "out" / "eval.json", *extra]


def convert(t: Path, checkpoint, *extra):
    return [CONVERT, "--checkpoint", checkpoint, "--output", t / "out" / "export", *extra]


def export(t: Path, family="eco_rna") -> Path:
    return write_export(t / "export", tiny_config(t, family))


def crafted(t: Path, family="eco_rna") -> Path:
    """A run dir whose checkpoint would create t/PWNED if unpickled."""
    write_deepspeed_like(t / "run", tiny_config(t, family), t / MARKER)
    return t / "run"


def unreadable(t: Path) -> Path:
    """A DeepSpeed-looking run dir whose model-state file is no checkpoint."""
    return write_deepspeed_like(t / "run", tiny_config(t)).parent.parent


def _truncated_client_state(t):
    tag = write_deepspeed_like(t / "run", tiny_config(t), t / MARKER)
    (tag / "client_state.json").write_text('{"step": 3, "world_si')
    return evaluate(t, tag, "--trust-checkpoint"), [tag / "client_state.json", "not valid JSON"]


def _not_a_checkpoint(t):
    (t / "junk").mkdir()
    (t / "junk" / "notes.txt").write_text("hello")
    return evaluate(t, t / "junk"), [t / "junk", "not a checkpoint"]


def _export_without_config(t):
    e = export(t)
    (e / "config.yaml").unlink()
    return evaluate(t, e), [e / "config.yaml", "not found"]


def _export_without_weights(t):
    e = export(t)
    (e / "model.safetensors").unlink()
    (e / "export.json").write_text("{}")
    return evaluate(t, e), [e / "model.safetensors", "incomplete export"]


def _export_truncated_weights(t):
    e = export(t)
    w = e / "model.safetensors"
    w.write_bytes(w.read_bytes()[:200])
    return evaluate(t, e), [w, "cannot be read as safetensors"]


def _text_export_without_tokenizer(t):
    e = export(t, "recursive_gpt")
    (t / "blimp.jsonl").write_text(json.dumps({"sentence_good": "a b", "sentence_bad": "b a", "UID": "x"}) + "\n")
    return evaluate(t, e, task="blimp", data=t / "blimp.jsonl"), [t / "no_shards" / "tokenizer.model", "--spm"]


def _output_not_empty(t):
    (t / "out" / "export").mkdir(parents=True)
    (t / "out" / "export" / "keep.txt").write_text("mine")
    return convert(t, export(t)), [t / "out" / "export", "was not written by convert_checkpoint.py (it holds keep.txt)"]


def _text_checkpoint_without_tokenizer(t):
    run = crafted(t, "recursive_gpt")  # the tokenizer is checked before anything is unpickled
    return convert(t, run, "--trust-checkpoint"), [t / "no_shards" / "tokenizer.model", "--spm MODEL"]


def _invalid_yaml(t):
    (t / "bad.yaml").write_text("model:\n  d_model: [64\n")
    return [PARAMS, "--config", t / "bad.yaml"], [t / "bad.yaml", "invalid YAML"]


def _no_manifest(t):
    (t / "shards").mkdir()
    return [INSPECT, t / "shards"], [t / "shards" / "manifest.json"]


def _manifest_not_json(t):
    (t / "shards").mkdir()
    (t / "shards" / "manifest.json").write_text('{"format": "bioseq-wds/1", "shards": [')
    return [INSPECT, t / "shards"], [t / "shards" / "manifest.json", "not valid JSON"]


# (id, t -> (argv, [strings the error line must name])); paths in the strings are compared as text
CASES = [
    # launchers/evaluate.py
    ("evaluate-depths-reversed", lambda t: (evaluate(t, export(t), "--depths", "3-1"), ["--depths '3-1'"])),
    ("evaluate-depths-not-a-number", lambda t: (evaluate(t, export(t), "--depths", "1,two"),
                                                ["--depths '1,two'", "'two'"])),
    ("evaluate-depths-above-the-cap", lambda t: (evaluate(t, export(t), "--depths", "1-40"),
                                                 ["--depths '1-40'", "maximum 32", t / "export" / "config.yaml",
                                                  "objective.k_cap 8"])),
    ("evaluate-depths-huge-range", lambda t: (evaluate(t, export(t), "--depths", "1-999999999"),
                                              ["--depths", "maximum 4096"])),
    ("evaluate-missing-checkpoint", lambda t: (evaluate(t, t / "nope"), [t / "nope", "no such checkpoint"])),
    ("evaluate-not-a-checkpoint", _not_a_checkpoint),
    ("evaluate-truncated-client-state", _truncated_client_state),
    ("evaluate-untrusted-deepspeed", lambda t: (evaluate(t, crafted(t)),
                                                [t / "run" / "checkpoints" / "step00000003", "--trust-checkpoint"])),
    # the checkpoint's files are checked (archives, digests) before DeepSpeed reads any: the file is named
    ("evaluate-trusted-unreadable", lambda t: (evaluate(t, unreadable(t), "--trust-checkpoint"), [
        t / "run" / "checkpoints" / "step00000003" / "mp_rank_00_model_states.pt", "not a readable torch archive"])),
    ("evaluate-export-without-config", _export_without_config),
    ("evaluate-export-without-weights", _export_without_weights),
    ("evaluate-export-truncated-weights", _export_truncated_weights),
    ("evaluate-missing-data", lambda t: (evaluate(t, export(t), data=t / "nope.fasta"), [t / "nope.fasta"])),
    ("evaluate-text-export-without-tokenizer", _text_export_without_tokenizer),
    # tools/convert_checkpoint.py
    ("convert-untrusted-deepspeed", lambda t: (convert(t, crafted(t)), ["step00000003", "--trust-checkpoint"])),
    ("convert-missing-checkpoint", lambda t: (convert(t, t / "nope", "--trust-checkpoint"), [t / "nope"])),
    ("convert-trusted-unreadable", lambda t: (convert(t, unreadable(t), "--trust-checkpoint"), [
        "step00000003/mp_rank_00_model_states.pt", "not a readable torch archive"])),
    ("convert-output-not-empty", _output_not_empty),
    ("convert-text-checkpoint-without-tokenizer", _text_checkpoint_without_tokenizer),
    ("convert-an-export", lambda t: (convert(t, export(t)), [t / "export", "already an export"])),
    # tools/flops.py
    ("flops-unknown-config", lambda t: ([FLOPS, "--config", "standard_h38", "--length", "512"],
                                        ["--config standard_h38", "standard_h384"])),
    ("flops-bad-depths", lambda t: ([FLOPS, "--config", "standard_h384", "--length", "512", "--depths", "4-2"],
                                    ["--depths '4-2'"])),
    ("flops-length-zero", lambda t: ([FLOPS, "--config", "standard_h384", "--length", "0"], ["--length 0"])),
    ("flops-unknown-key", lambda t: ([FLOPS, "--config", "standard_h384", "--length", "8", "--set", "model.nope=1"],
                                     ["--set model.nope=1: model.nope"])),  # the flag the value came from
    # tools/params.py
    ("params-unknown-config", lambda t: ([PARAMS, "--config", t / "nope.yaml"], [t / "nope.yaml"])),
    ("params-invalid-yaml", _invalid_yaml),
    ("params-bad-value", lambda t: ([PARAMS, "--config", "eco_rna_80m", "--set", "model.d_model=-5"],
                                    ["--set model.d_model=-5: model.d_model"])),
    # tools/inspect_shards.py
    ("inspect-missing-dir", lambda t: ([INSPECT, t / "nope"], [t / "nope"])),
    ("inspect-no-manifest", _no_manifest),
    ("inspect-manifest-not-json", _manifest_not_json),
]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_and_nothing_half_written(case, tmp_path):
    _, make = case
    argv, must_name = make(tmp_path)
    (tmp_path / "out").mkdir(exist_ok=True)
    before = snapshot(tmp_path)
    proc = run_cli(argv)
    assert_one_line_error(proc, *map(str, must_name))
    assert snapshot(tmp_path) == before  # nothing written, removed or changed: no JSON, no (partial) export
    assert not (tmp_path / MARKER).exists(), "a crafted checkpoint was unpickled"
    assert not list(tmp_path.rglob("*.tmp")), "a temporary file or directory was left behind"
