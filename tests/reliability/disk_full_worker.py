"""Worker for test_a_full_disk_names_itself_and_leaves_latest: launchers/pretrain.py in one process whose second
checkpoint hits a full disk: DeepSpeed writes half of a shard, then the write fails with ENOSPC, as on a real disk."""
import errno
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "launchers"))


def main() -> int:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    real_save, calls = TorchCheckpointEngine.save, []

    def save(self, state_dict, path):
        calls.append(path)
        if len(calls) > 2:  # the first checkpoint (model + optimizer file) goes through
            Path(path).write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(self, state_dict, path)

    TorchCheckpointEngine.save = save
    import pretrain

    return pretrain.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
