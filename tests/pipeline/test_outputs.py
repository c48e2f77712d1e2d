"""publish_dir (pipeline/outputs.py): a tool's marker lists what it wrote; a replacement keeps everything else, and
a replacement that fails leaves the old directory exactly as it was."""
import pytest

from pipeline import outputs


def export(d, weights: bytes):
    d.mkdir()
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_a_failed_swap_puts_the_kept_files_back(tmp_path, monkeypatch):
    out = tmp_path / "export"
    assert outputs.publish_dir(export(tmp_path / "a", b"old"), out, "tool") == []
    (out / "NOTES.md").write_text("mine\n")
    assert outputs.written_by("tool")(out) and not outputs.written_by("other")(out)

    def fail(new, out):
        raise OSError("disk full")

    monkeypatch.setattr(outputs, "replace_dir", fail)
    with pytest.raises(OSError):
        outputs.publish_dir(export(tmp_path / "b", b"new"), out, "tool")
    assert (out / "NOTES.md").read_text() == "mine\n" and (out / "model.safetensors").read_bytes() == b"old"
    monkeypatch.undo()
    assert outputs.publish_dir(export(tmp_path / "c", b"new"), out, "tool") == ["NOTES.md"]
    assert (out / "NOTES.md").read_text() == "mine\n" and (out / "model.safetensors").read_bytes() == b"new"
