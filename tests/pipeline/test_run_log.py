"""pipeline/run_log.py: RUN_DIR/train.log holds every line once, prefixed with its rank exactly once."""
from pipeline.run_log import TRAIN_LOG, RunLog


def test_train_log_prefixes_each_line_with_its_rank_once(tmp_path):
    log = RunLog(rank=1)
    log._sink("before the run directory is known")
    log.attach(tmp_path, fresh_errors=False)
    log._sink("step 1/4 | loss 3.2\r")
    log._sink("[rank 1] error: PeerLost: lost contact with another rank")  # report_fatal's line, prefixed already
    log.file.close()
    lines = (tmp_path / TRAIN_LOG).read_text().splitlines()
    assert lines[0].startswith("[rank 1] ==== ") and lines[0].endswith(" start ====")
    assert lines[1:] == ["[rank 1] before the run directory is known", "[rank 1] step 1/4 | loss 3.2",
                         "[rank 1] error: PeerLost: lost contact with another rank"]
