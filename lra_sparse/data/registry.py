"""Registry of LRA tasks and the split arrays every loader returns.

A task loader turns its on-disk format into plain numpy arrays, one dict per split:

- classification tasks: ``{"inputs": [N, max_length], "targets": [N]}``
- retrieval (dual encoder): ``{"inputs1": ..., "inputs2": ..., "targets": ...}``

of an integer dtype: int32 or a compact unsigned dtype (the built-in loaders hold tokens in the
smallest one that holds the vocabulary, ``lra_sparse.data.common.token_dtype``, possibly as
read-only memory-mapped arrays); the input pipeline casts every batch to int32.

Token id 0 is padding; the model derives the key padding mask as ``tokens != 0``, so every real
token must have an id >= 1. Padding sits at the end of a row, except where a task's spec says
``padding_at_end=False`` (pixel tasks masking black pixels as LRA does, see
``lra_sparse.data.common``): attention paths that take key padding as sequence lengths (cuDNN)
cannot serve those.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Protocol

import numpy as np

PAD_ID = 0
SPLITS = ("train", "val", "test")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  name: str
  num_classes: int
  vocab_size: int                     # including PAD_ID
  input_names: tuple[str, ...] = ("inputs",)
  model_kind: str = "classifier"      # "classifier" | "dual_encoder"
  padding_at_end: bool = True         # False: PAD_ID may occur anywhere in a row


class Task(Protocol):
  def spec(self, config: Any) -> TaskSpec: ...
  def load_split(self, config: Any, split: str) -> dict[str, np.ndarray]: ...


_TASKS: dict[str, Callable[[], Task]] = {}
# Built-in tasks register themselves (``@register_task``) when their loader module is imported;
# get_task imports only the module of the task asked for, so a run imports only its own loader.
_BUILTIN_TASK_MODULES = {
    "listops": "lra_sparse.data.listops",
    "text": "lra_sparse.data.text",
    "retrieval": "lra_sparse.data.retrieval",
    "image": "lra_sparse.data.image",
    "pathfinder": "lra_sparse.data.pathfinder",
    "pathx": "lra_sparse.data.pathfinder",
}


def register_task(name: str):
  """Class decorator: registers a task class (instantiated without arguments) under ``name``."""
  def decorate(cls):
    if name in _TASKS:
      raise ValueError(f"task {name!r} is registered twice")
    _TASKS[name] = cls
    return cls
  return decorate


def task_names() -> list[str]:
  return sorted(set(_TASKS) | set(_BUILTIN_TASK_MODULES))


def get_task(name: str) -> Task:
  if name not in _TASKS and name in _BUILTIN_TASK_MODULES:
    importlib.import_module(_BUILTIN_TASK_MODULES[name])
  if name not in _TASKS:
    raise ValueError(f"unknown task {name!r} (config.task); known tasks: {', '.join(task_names())}")
  return _TASKS[name]()


def check_split_arrays(arrays: dict[str, np.ndarray], spec: TaskSpec, where: str) -> None:
  """One clear error if a loader returned arrays that break the contract above."""
  names = set(spec.input_names) | {"targets"}
  if set(arrays) != names:
    raise ValueError(f"{where}: expected arrays {sorted(names)}, got {sorted(arrays)}")
  n = len(arrays["targets"])
  if n == 0:
    raise ValueError(f"{where}: the split is empty")
  for key in spec.input_names:
    a = arrays[key]
    if a.ndim != 2 or len(a) != n or not np.issubdtype(a.dtype, np.integer):
      raise ValueError(f"{where}: {key} must be integer [N={n}, length], got {a.dtype}{a.shape}")
    if a.min() < 0 or a.max() >= spec.vocab_size:
      raise ValueError(f"{where}: {key} token ids outside [0, {spec.vocab_size})")
  t = arrays["targets"]
  if t.min() < 0 or t.max() >= spec.num_classes:
    raise ValueError(f"{where}: labels outside [0, {spec.num_classes})")
