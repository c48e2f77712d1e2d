"""DeepSpeed's ``ds_to_universal`` with its ``torch.load`` calls under ``weights_only_loads``, so converting a
checkpoint to DeepSpeed's universal form cannot run code its files hold. ``Checkpointer._universal_checkpoint`` runs
it as ``python -m pipeline.checkpoint.universal [--trusted] <ds_to_universal's arguments>``; ``--trusted``
(--trust-checkpoint) leaves torch.load as DeepSpeed calls it."""
import sys

from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

from pipeline.checkpoint.read import weights_only_loads

if __name__ == "__main__":
    trusted = "--trusted" in sys.argv
    if trusted:
        sys.argv.remove("--trusted")
    with weights_only_loads(trusted):
        main(parse_arguments())
