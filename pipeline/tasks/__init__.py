"""Supervised adaptation tasks (docs/adaptation.md): each task's spec (pipeline/tasks/base.py: Task) and the registry
that names them. Importing the package registers the shipped tasks, one module each: nrc.py (family classification),
ssp.py (secondary structure), reactivity.py (DMS and 2A3 chemical reactivity)."""
from pipeline.tasks.base import (TASKS, Record, Task, TaskConfig, TaskTransform, adapted_family, get_task,
                                 register_task, task_section, training_spec)
from pipeline.tasks import nrc, reactivity, ssp  # noqa: F401,E402 - each registers its task

__all__ = ["TASKS", "Record", "Task", "TaskConfig", "TaskTransform", "adapted_family", "get_task", "register_task",
           "task_section", "training_spec"]
