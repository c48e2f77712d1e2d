"""Bad inputs to the data_prep CLI: each is one ``error:`` line naming the file, line or flag at fault, a non-zero
exit, no traceback (``assert_one_line_error``), and nothing half-written: the directory the run worked in holds
exactly what it held before (no output, no ``.partial`` work directory, no parent the run created).

Inputs are cut from the real samples shipped in data/samples (Rfam RNA, UniRef90 members and their UniRef50 TSV),
damaged one way each; the CSV and text cases are a few hand-written lines. Every case runs the real CLI in a
subprocess (most fail before torch is imported, in well under a second).
"""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from bad_input import assert_one_line_error, run_cli

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "data" / "samples"
RFAM = SAMPLES / "rfam_nrc_train_sample.fasta.gz"
UR90 = SAMPLES / "uniref90_clusters_sample.fasta.gz"
UR_TSV = SAMPLES / "uniref50_to_uniref90_sample.tsv"


def rfam_text(n: int = 30) -> str:
    """The first ``n`` records of the real Rfam sample, LF line endings."""
    text = gzip.decompress(RFAM.read_bytes()).decode().replace("\r\n", "\n")
    blocks = text.split("\n>")
    return "\n>".join(blocks[:n]).rstrip("\n") + "\n"


def fasta(tmp: Path, name: str = "in.fasta", n: int = 30) -> Path:
    p = tmp / name
    p.write_text(rfam_text(n))
    return p


def genome(tmp: Path, *flags):
    """``genome --input in.fasta --output out FLAGS``: the flag is what is wrong."""
    src = fasta(tmp)
    return ["genome", "--input", src, "--output", tmp / "out", *flags]


# ------------------------------------------------------------------------------------------------------ the cases
def malformed_fasta_line(tmp):
    p = tmp / "no_header.fasta"
    p.write_text(rfam_text(5).split("\n", 1)[1])  # starts inside the first record
    return ["rnacentral", "--input", p, "--output", tmp / "new" / "out"], [f"{p}:1:", "before the first '>' header"]


def bad_character_strict(tmp):
    p = tmp / "star.fasta"
    lines = rfam_text(5).split("\n")
    k = next(i for i in range(2, len(lines)) if not lines[i].startswith(">"))  # a sequence line of record 2+
    lines[k] = lines[k][:9] + "*" + lines[k][10:]
    p.write_text("\n".join(lines))
    return ["rnacentral", "--input", p, "--output", tmp / "out", "--strict"], [f"{p}:{k + 1}:10:", "'*'"]


def ninety_percent_invalid(tmp):
    p = tmp / "gaps.fasta"
    out = []
    for k, block in enumerate(rfam_text(40).split("\n>")):
        head, seq = block.split("\n", 1)
        if k % 10:
            seq = seq[:5] + "." + seq[6:]
        out.append(head + "\n" + seq)
    p.write_text("\n>".join(out))
    return ["rnacentral", "--input", p, "--output", tmp / "out"], [
        "36 of 40 records (90.0%)", "--max-filtered-fraction 0.01", f"{p}:", "character '.'"]


def truncated_gz(tmp):
    p = tmp / "cut.fasta.gz"
    blob = gzip.compress(rfam_text(200).encode())
    p.write_bytes(blob[: len(blob) // 2])
    return ["rnacentral", "--input", p, "--output", tmp / "out"], [str(p), "corrupt or truncated gzip"]


def empty_input(tmp):
    p = tmp / "empty.fasta"
    p.write_bytes(b"")
    return ["genome", "--input", p, "--output", tmp / "out"], [str(p), "is empty"]


def binary_input(tmp):
    p = tmp / "blob.fasta"
    p.write_bytes(b">x\n" + bytes(range(256)) * 4)
    return ["genome", "--input", p, "--output", tmp / "out"], [str(p), "binary data"]


def missing_input(tmp):
    return ["genome", "--input", tmp / "nowhere.fa", "--output", tmp / "out"], [str(tmp / "nowhere.fa")]


def unknown_window_tail(tmp):
    return genome(tmp, "--window", 100, "--window-tail", "middle"), ["--window-tail", "middle"]


def unknown_progress_mode(tmp):
    return genome(tmp, "--progress", "sideways"), ["--progress", "sideways"]


def unknown_flag(tmp):
    return genome(tmp, "--windw", 100), ["--windw"]


def window_zero(tmp):
    return genome(tmp, "--window", 0), ["--window", "0"]


def window_not_a_number(tmp):
    return genome(tmp, "--window", "8k"), ["--window", "8k"]


def stride_above_window(tmp):
    return genome(tmp, "--window", 100, "--stride", 150), ["--stride 150", "--window 100"]


def stride_without_window(tmp):
    return genome(tmp, "--stride", 50), ["--stride 50", "--window"]


def window_tail_without_window(tmp):
    return genome(tmp, "--window-tail", "drop"), ["--window-tail drop", "--window"]


def val_fraction_above_one(tmp):
    return genome(tmp, "--val-fraction", 1.5), ["--val-fraction", "1.5"]


def val_fraction_zero(tmp):
    return genome(tmp, "--val-fraction", 0), ["--val-fraction", "(0, 1)"]


def val_fraction_nan(tmp):
    return genome(tmp, "--val-fraction", "nan"), ["--val-fraction", "nan"]


def val_fraction_leaves_val_empty(tmp):
    # 3 records: none of their ids hashes below 0.001 (checked by the error text itself)
    return ["rnacentral", "--input", fasta(tmp, n=3), "--output", tmp / "out", "--val-fraction", 0.001], [
        "--val-fraction 0.001", "the val split holds no samples"]


def max_filtered_fraction_above_one(tmp):
    return genome(tmp, "--max-filtered-fraction", 2), ["--max-filtered-fraction", "2"]


def replace_invalid_two_chars(tmp):
    return genome(tmp, "--replace-invalid", "NN"), ["--replace-invalid", "'NN'"]


def replace_invalid_outside_alphabet(tmp):
    return genome(tmp, "--replace-invalid", "."), ["--replace-invalid '.'", "nucleotide alphabet"]


def members_tsv_matching_nothing(tmp):
    # the cluster TSV's keys are UniRef50 ids; the member FASTA's records are UniRef90 entries: nothing matches
    return ["uniref", "--input", UR90, "--output", tmp / "out", "--uniref90-members", UR_TSV], [
        f"--uniref90-members {UR_TSV}", "none of its", "UniRef50 ids is a record id of the inputs"]


def clusters_tsv_matching_nothing(tmp):
    p = tmp / "clusters.tsv"
    p.write_text("UR50_cluster_name\tmapped_id\nUniRef50_A0A007\tUniRef90_A0A007\nUniRef50_B\tUniRef90_B,UniRef90_C\n")
    return ["uniref", "--input", UR90, "--clusters", p, "--output", tmp / "out"], [
        str(p), "none of the 3 member ids", "record id of the FASTA inputs"]


def members_tsv_header_repeated(tmp):
    p = tmp / "twice.tsv"
    head, *rows = UR_TSV.read_text().splitlines()[:6]
    p.write_text("\n".join([head, *rows[:2], head, *rows[2:]]) + "\n")
    return ["uniref", "--input", UR90, "--output", tmp / "out", "--uniref90-members", p], [
        f"{p}:4:", "header line", "repeated"]


def window_with_clusters(tmp):
    return ["uniref", "--input", UR90, "--clusters", UR_TSV, "--output", tmp / "out", "--window", 100], [
        "--window", "--clusters"]


def csv_without_text_column(tmp):
    p = tmp / "utterances.csv"
    p.write_text('id,speaker,gloss\n1,MOT,"look at the doggie"\n2,CHI,"doggie"\n')
    return ["train-spm", "--input", p, "--output", tmp / "spm" / "m", "--vocab-size", 50], [
        str(p), "--text-column NAME", "gloss"]


def csv_to_babylm_without_text_column(tmp):
    p = tmp / "utterances.csv"
    p.write_text('id,speaker,gloss\n1,MOT,"look at the doggie"\n2,CHI,"doggie"\n')
    return ["babylm", "--input", p, "--output", tmp / "out", "--spm", tmp / "none.model"], [
        str(p), "--text-column NAME"]


def text_column_not_in_header(tmp):
    p = tmp / "utterances.csv"
    p.write_text('id,speaker,gloss\n1,MOT,"look at the doggie"\n')
    return ["babylm", "--input", p, "--output", tmp / "out", "--spm", tmp / "none.model", "--text-column",
            "utterance"], [f"{p}:1:", "--text-column 'utterance'", "id, speaker, gloss"]


def text_column_without_csv(tmp):
    p = tmp / "lines.train"
    p.write_text("look at the doggie\n")
    return ["babylm", "--input", p, "--output", tmp / "out", "--spm", tmp / "none.model", "--text-column",
            "gloss"], ["--text-column gloss", "none of the inputs is a .csv"]


def output_is_a_file(tmp):
    out = tmp / "taken"
    out.write_text("not a directory\n")
    return ["genome", "--input", fasta(tmp), "--output", out], [f"output {out}", "not a directory"]


def output_parent_is_a_file(tmp):
    parent = tmp / "afile"
    parent.write_text("x\n")
    return ["genome", "--input", fasta(tmp), "--output", parent / "out"], [str(parent), "not a directory"]


def job_index_out_of_range(tmp):
    return genome(tmp, "--num-jobs", 2, "--job-index", 2), ["--job-index 2", "--num-jobs 2"]


def merge_split_without_val(tmp):
    (tmp / "out" / "train").mkdir(parents=True)
    (tmp / "out" / "train" / "manifest-job0000-of-0001.json").write_text("{}\n")
    return ["merge", "--output", tmp / "out"], [str(tmp / "out"), "train/", "val/"]


CASES = [malformed_fasta_line, bad_character_strict, ninety_percent_invalid, truncated_gz, empty_input,
         binary_input, missing_input, unknown_window_tail, unknown_progress_mode, unknown_flag, window_zero,
         window_not_a_number, stride_above_window, stride_without_window, window_tail_without_window,
         val_fraction_above_one, val_fraction_zero, val_fraction_nan, val_fraction_leaves_val_empty,
         max_filtered_fraction_above_one, replace_invalid_two_chars, replace_invalid_outside_alphabet,
         members_tsv_matching_nothing, clusters_tsv_matching_nothing, members_tsv_header_repeated,
         window_with_clusters, csv_without_text_column, csv_to_babylm_without_text_column,
         text_column_not_in_header, text_column_without_csv, output_is_a_file, output_parent_is_a_file,
         job_index_out_of_range, merge_split_without_val]


def snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): (p.stat().st_size if p.is_file() else None)
            for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_error_line_and_nothing_half_written(case, tmp_path):
    args, names = case(tmp_path)
    before = snapshot(tmp_path)
    proc = run_cli(["-m", "data_prep", *args], timeout=120)
    assert_one_line_error(proc, *names)
    assert proc.stdout == "", proc.stdout
    assert snapshot(tmp_path) == before, "the failed run left files behind"
