"""train.profile: torch.profiler over a few optimizer steps of rank 0.

The record covers steps ``start`` .. ``start + steps - 1`` whole (data loading, forward, backward, the optimizer
step and the step's collectives), CPU activity and, on a GPU, CUDA kernels, with memory allocations. It is written
as a Chrome trace, ``RUN_DIR/profile/trace_steps_S-E.json``, which Perfetto (ui.perfetto.dev) and chrome://tracing
open, and the operators that took the most self time are printed (so they land in train.log). Other ranks and the
other steps run unprofiled: the profiler's own overhead stays inside the recorded window.
"""
from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    TOP = 15  # operators printed

    def __init__(self, cfg, run_dir: Path, rank: int):
        self.cfg, self.run_dir, self.active = cfg, Path(run_dir), cfg is not None and rank == 0
        self.prof = None

    def before_step(self, step: int):
        """``step``: the 1-based step about to run."""
        if self.active and self.prof is None and step == self.cfg.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True)
            self.prof.__enter__()

    def after_step(self, step: int):
        """``step``: the 1-based step just finished."""
        if self.prof is not None and step >= self.cfg.start + self.cfg.steps - 1:
            self.close(step)

    def close(self, last: int | None = None):
        """Stop and write the record (also when the run ends inside the window)."""
        if self.prof is None:
            return
        prof, self.prof, self.active = self.prof, None, False
        prof.__exit__(None, None, None)
        out = self.run_dir / "profile"
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"trace_steps_{self.cfg.start}-{last if last is not None else 'end'}.json"
        prof.export_chrome_trace(str(trace))
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=self.TOP)
        print(f"profile of steps {self.cfg.start}-{last}: {trace} (open in ui.perfetto.dev); top operators by "
              f"{key.replace('_', ' ')}:\n{table}", flush=True)
