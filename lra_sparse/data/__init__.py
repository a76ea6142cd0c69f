"""LRA data: the task registry, loaders for the official formats, and the input pipeline.

Generators that write data sets in those formats live in ``lra_sparse.generators``.
"""
from lra_sparse.data.registry import (PAD_ID, SPLITS, TaskSpec, get_task, register_task,
                                      task_names)
