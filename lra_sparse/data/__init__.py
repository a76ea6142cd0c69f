"""LRA data: generators, loaders for the official formats, and the input pipeline."""
from lra_sparse.data.registry import (PAD_ID, SPLITS, TaskSpec, get_task, register_task,
                                      task_names)
