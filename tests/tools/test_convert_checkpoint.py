"""The pickle rule of tools/convert_checkpoint.py and launchers/evaluate.py (issue 11): a crafted DeepSpeed checkpoint
whose unpickling would create a marker file is NOT unpickled without --trust-checkpoint (one error line naming the file
and the global it would call, no marker, no export); with the flag the same file does run (the payload is live, so its absence above
is the rule's doing), with one warning line; an export needs no flag. Conversion of a real checkpoint is tested in
tests/launchers/test_evaluate.py and test_evaluate_export_tokenizer.py (trained there)."""
import subprocess
import sys

import pytest

from checkpoint_factory import tiny_config, write_deepspeed_like, write_export
from conftest import HELDOUT_FASTA, REPO, launch_env

CONVERT = REPO / "tools" / "convert_checkpoint.py"
EVALUATE = REPO / "launchers" / "evaluate.py"


def run(*args):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=launch_env(), capture_output=True,
                          text=True, timeout=300)


def commands(run_dir, tmp_path):
    return {"convert": [CONVERT, "--checkpoint", run_dir, "--output", tmp_path / "export"],
            "evaluate": [EVALUATE, "--checkpoint", run_dir, "--task", "reconstruction", "--data", HELDOUT_FASTA,
                         "--depths", "1", "--no-mlflow", "--output", tmp_path / "eval.json"]}


@pytest.mark.parametrize("tool", ["convert", "evaluate"])
def test_crafted_pickle_is_not_unpickled_without_the_flag(tool, tmp_path):
    marker = tmp_path / "PWNED"
    tag = write_deepspeed_like(tmp_path / "run", tiny_config(tmp_path), marker)
    cmd = commands(tmp_path / "run", tmp_path)[tool]
    proc = run(*cmd)
    assert proc.returncode == 2 and not marker.exists()
    assert proc.stderr.splitlines() == [
        f"error: {tag / 'mp_rank_00_model_states.pt'}: loading it would call builtins.exec, which is neither a tensor "
        "type nor one of the DeepSpeed classes a checkpoint holds, so it was not unpickled (it could run any code); "
        "pass --trust-checkpoint only if you trust whoever wrote it"]
    assert not (tmp_path / "export").exists() and not (tmp_path / "eval.json").exists()

    trusted = run(*cmd, "--trust-checkpoint")  # the control: the same file, trusted, runs its payload
    assert marker.exists()
    assert trusted.returncode == 2 and "Traceback" not in trusted.stderr
    assert trusted.stderr.splitlines()[0].startswith(f"warning: --trust-checkpoint: unpickling {tag} with torch.load(weights_only=False)")
    assert trusted.stderr.strip().splitlines()[-1].startswith(f"error: {tag}: cannot be read as a DeepSpeed ZeRO")
    assert not (tmp_path / "export").exists() and not list(tmp_path.glob(".export.*"))  # nothing half-written


def test_an_export_needs_no_flag_and_is_refused_as_input(tmp_path):
    export = write_export(tmp_path / "exp", tiny_config(tmp_path))
    proc = run(EVALUATE, "--checkpoint", export, "--task", "reconstruction", "--data", HELDOUT_FASTA, "--depths",
               "1,2", "--no-mlflow", "--output", tmp_path / "e.json")
    assert proc.returncode == 0, proc.stderr
    warned = [ln for ln in proc.stderr.splitlines() if "warning" in ln and "model's window" not in ln]  # the crop's
    assert not warned and (tmp_path / "e.json").is_file(), proc.stderr
    again = run(CONVERT, "--checkpoint", export, "--output", tmp_path / "copy")
    assert again.returncode == 2 and "already an export" in again.stderr and not (tmp_path / "copy").exists()


def test_existing_output_is_refused_without_force_and_tags_are_listed(tmp_path):
    """Both checked before anything is read: one line each, the existing export untouched."""
    run_dir = tmp_path / "run"
    write_deepspeed_like(run_dir, tiny_config(tmp_path), step=3)
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier export")
    (out / ".written-by.json").write_text('{"tool": "convert_checkpoint.py", "files": ["model.safetensors"]}')
    proc = run(CONVERT, "--checkpoint", run_dir, "--output", out, "--trust-checkpoint")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: {out} already holds an export; pass --force to replace it"]
    assert (out / "model.safetensors").read_bytes() == b"an earlier export"
    proc = run(CONVERT, "--checkpoint", run_dir, "--tag", "step00000009", "--output", tmp_path / "new")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: {run_dir / 'checkpoints'}: --tag step00000009: no such checkpoint (tags there: step00000003)"]
    assert not (tmp_path / "new").exists()
