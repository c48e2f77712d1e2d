"""One-line errors for inputs a user meets (the last tracebacks of the fault campaign): evaluate.py on an empty or
header-only FASTA and beside an export it cannot write into, a FASTA with CR-only line endings in data_prep and
evaluate, and train-spm's vocabulary errors in this CLI's flags. One line naming the file or flag, the documented
exit code, nothing half-written."""
import sys

import pytest

from conftest import HELDOUT_FASTA, REPO
from launchers.evaluate import main as evaluate_main

sys.path.insert(0, str(REPO / "tests" / "tools"))
from checkpoint_factory import tiny_config, write_export  # noqa: E402


@pytest.fixture
def export(tmp_path):
    return write_export(tmp_path / "export", tiny_config(tmp_path), seed=1)


@pytest.mark.parametrize("text", ["", ">r1 no sequence\n", ">r1\n>r2\n"])
def test_an_empty_or_header_only_fasta_is_one_line(export, tmp_path, capsys, text):
    fasta = tmp_path / "x.fasta"
    fasta.write_text(text)
    rc = evaluate_main(["--checkpoint", str(export), "--task", "reconstruction", "--data", str(fasta),
                        "--depths", "1-2", "--no-mlflow"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: {fasta}: no sequence to evaluate (an empty file, or headers without "
                               "sequence lines)"]


def test_an_unwritable_json_beside_the_export_names_output_and_exits_2(export, capsys):
    """A read-only export is the case users meet; a directory where the JSON belongs fails the same write for any
    user, root included (CI runs as root, which writes into read-only folders)."""
    (export / "eval-reconstruction.json").mkdir()
    rc = evaluate_main(["--checkpoint", str(export), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                        "--depths", "1", "--no-mlflow"])
    out, err = capsys.readouterr()
    assert rc == 2 and "loss" in out  # the table was printed before
    last = err.strip().splitlines()[-1]  # (the lines before it are the progress bar)
    assert last.startswith(f"error: cannot write {export / 'eval-reconstruction.json'}") and "pass --output PATH" in last
    assert sum(ln.startswith("error:") for ln in err.splitlines()) == 1 and "Traceback" not in err
    assert not [p.name for p in export.iterdir() if p.name.endswith(".tmp")]  # nothing half-written left behind


def test_cr_only_line_endings_are_named(export, tmp_path, capsys):
    """A FASTA saved with CR-only (classic Mac) line endings reads as one header line; both data_prep and evaluate
    say so in one line (they said 'record ... has no sequence')."""
    from data_prep.__main__ import main as data_prep_main

    fasta = tmp_path / "mac.fasta"
    fasta.write_bytes(b">r1 first\rACGUACGUAC\r>r2\rGGCCAAUUGG\r")
    want = (f"{fasta}:1: a carriage return (\\r) inside a line: the file has CR-only line endings; convert them to "
            "\\n (e.g. tr '\\r' '\\n' < IN > OUT)")
    assert data_prep_main(["rnacentral", "--input", str(fasta), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip() == f"data_prep: error: {want}"
    assert not (tmp_path / "out").exists()
    rc = evaluate_main(["--checkpoint", str(export), "--task", "reconstruction", "--data", str(fasta),
                        "--depths", "1", "--no-mlflow"])
    assert rc == 2 and capsys.readouterr().err.strip().splitlines()[-1] == f"error: {want}"


@pytest.mark.parametrize("vocab, want", [
    (10, "--vocab-size 10 is below the 267 pieces the text needs (its distinct characters, 256 byte-fallback pieces "
         "and the special tokens); use --vocab-size 267 or more"),
    (5000, "--vocab-size 5000 is more than the text can fill (273 at most); use a smaller --vocab-size or more text"),
])
def test_train_spm_vocabulary_errors_speak_this_clis_flags(tmp_path, capsys, vocab, want):
    """sentencepiece's own message suggests --character_coverage, which `data_prep train-spm` does not take."""
    from data_prep.__main__ import main as data_prep_main

    text = tmp_path / "tiny.train"
    text.write_text("a b c\nd e f\n")
    assert data_prep_main(["train-spm", "--input", str(text), "--output", str(tmp_path / "spm"), "--vocab-size",
                           str(vocab)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"data_prep: error: {want}"]
    assert not list(tmp_path.glob("spm*"))


def test_a_sequence_longer_than_the_window_is_counted_and_said(export, tmp_path, capsys):
    """Campaign case: a 1 M-nt sequence was evaluated on 128 positions without a word. Real Rfam sequences joined
    into one of 1,000,000 nt: evaluated on one window (the training's crop), said on stderr and counted in the JSON."""
    import gzip
    import json

    body = "".join(ln.strip() for ln in gzip.open(HELDOUT_FASTA, "rt") if not ln.startswith(">"))
    fasta = tmp_path / "long.fasta"
    fasta.write_text(">joined\n" + (body * (1_000_000 // len(body) + 1))[:1_000_000] + "\n>short\nACGUACGU\n")
    out = tmp_path / "r.json"
    rc = evaluate_main(["--checkpoint", str(export), "--task", "reconstruction", "--data", str(fasta), "--depths",
                        "1", "--no-mlflow", "--output", str(out)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert rc == 0 and err == [
        f"warning: {fasta}: 1 of 2 sequences are longer than the model's window of 126 residues (data.context_length "
        "128); each is evaluated on one seeded random window of 126, not whole (the longest has 1,000,000)"], err
    res = json.loads(out.read_text())
    assert res["sequences"] == 2 and res["cropped"] == 1 and res["window"] == 126
