"""tools/inspect_shards.py on a real prepared directory: summary, decoded samples, verification, and a corrupt
member named in one error line."""
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
RNA = SHARED / "rna" / "nrc_rfam_13class_train_6320.fasta"


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")
def test_inspect_and_corrupt_member(tmp_path):
    from data_prep.__main__ import main
    out = tmp_path / "rfam"
    assert main(["rnacentral", "--input", str(RNA), "--output", str(out), "--shard-size", "2000"]) == 0
    tool = [sys.executable, str(REPO / "tools" / "inspect_shards.py"), str(out)]
    p = subprocess.run(tool + ["--samples", "2", "--verify"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "source rnacentral" in p.stdout and "6320 samples" in p.stdout and "verified 4 shards" in p.stdout
    assert "verify: 100%" in p.stderr and " 4/4 " in p.stderr  # the bar on stderr, stdout unchanged
    first = RNA.read_text().replace("\r\n", "\n").split("\n>")[0].split("\n")
    assert repr("".join(first[1:]).upper().replace("T", "U")[:117])[1:-1] in p.stdout

    # Corrupt the tokens.npy of shard 1 (its npy magic; one block of 2000 samples), keeping the tar structure intact.
    shard = out / "rnacentral-000001.tar"
    with tarfile.open(shard) as t:
        member = [m for m in t.getmembers() if m.name.endswith(".tokens.npy")][0]
    raw = bytearray(shard.read_bytes())
    raw[member.offset_data:member.offset_data + 6] = b"GARBAG"
    shard.write_bytes(bytes(raw))
    p = subprocess.run(tool + ["--samples", "0", "--verify"], capture_output=True, text=True, timeout=120)
    # stderr: the verify bar's frames (shard 0 passed, shard 1 did not), then the one error line, last
    assert p.returncode == 1 and "verify:  25%|" in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("verify: ")]
    assert len(lines) == 1 and p.stderr.splitlines()[-1] == lines[0], p.stderr
    assert lines[0].startswith(f"inspect_shards: error: {shard}: corrupt member {member.name} ")
