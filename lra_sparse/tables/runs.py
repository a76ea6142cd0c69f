"""Reads run workdirs: each run's flattened config, its status and the metric it finished with.

Problems in the logs (invalid JSON lines in metrics.jsonl, unreadable config.json/result.json)
go to a :class:`Reporter` as ``FILE:LINE: message`` warnings, and the run or line is skipped.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

from lra_sparse import config as config_lib
from lra_sparse import workdir as workdir_lib


@dataclasses.dataclass
class RunRecord:
  workdir: str
  config: dict[str, Any]              # flattened: {"attention.kind": ..., "task": ...}
  status: str                         # "finished" | "unfinished" | "failed"
  value: float | None                 # the metric (unscaled) when finished
  last_step: int | None


class Reporter:
  """Collects warnings (``FILE:LINE: message``) and echoes them to stderr."""

  def __init__(self, echo: bool = True):
    self.messages: list[str] = []
    self.echo = echo

  def __call__(self, message: str) -> None:
    if message in self.messages:   # one file read twice (a table and its curves) warns once
      return
    self.messages.append(message)
    if self.echo:
      print(f"warning: {message}", file=sys.stderr)


def _metric_from_result(result: Any, split: str, metric: str) -> float | None:
  try:
    value = result[split][metric]
  except (KeyError, TypeError, IndexError):
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    return None
  return float(value)


def load_run(workdir: str, split: str, metric: str, report: Reporter) -> RunRecord | None:
  config_path = os.path.join(workdir, workdir_lib.CONFIG_FILE)
  try:
    config = workdir_lib.read_config(workdir)
  except (OSError, ValueError) as e:
    report(f"{config_path}:1: unreadable config ({e}); run skipped")
    return None
  metrics_path = os.path.join(workdir, workdir_lib.METRICS_FILE)
  records = workdir_lib.read_metrics(workdir, report)
  last_step = max((int(r["step"]) for _, r in records
                   if isinstance(r["step"], (int, float))), default=None)
  result_path = os.path.join(workdir, workdir_lib.RESULT_FILE)
  value, status = None, "unfinished"
  if os.path.exists(result_path):
    try:
      result = workdir_lib.read_result(workdir)
      value = _metric_from_result(result, split, metric)
      if value is None:
        report(f"{result_path}:1: no numeric [{split!r}][{metric!r}]")
    except (OSError, ValueError) as e:
      report(f"{result_path}:1: unreadable ({e.__class__.__name__}: {e})")
    if value is None:
      fallback = [(n, r) for n, r in records
                  if r.get("split") == split and _metric_from_result({split: r}, split, metric)
                  is not None]
      if fallback:
        line_number, record = fallback[-1]
        value = float(record[metric])
        report(f"{result_path}:1: using {metrics_path}:{line_number} "
               f"(step {record['step']}) instead")
      else:
        report(f"{result_path}:1: no usable {split} {metric} in result.json or metrics.jsonl; "
               "run counted as unfinished")
    if value is not None:
      status = "finished"
  elif os.path.exists(os.path.join(workdir, workdir_lib.ERROR_FILE)):
    status = "unfinished" if workdir_lib.was_interrupted(workdir) else "failed"
  return RunRecord(workdir=workdir, config=config_lib.flatten_config(config), status=status,
                   value=value, last_step=last_step)


def find_runs(root: str, split: str = "test", metric: str = "accuracy",
              report: Reporter | None = None) -> list[RunRecord]:
  """Every run workdir under root (a directory holding config.json), sorted by path."""
  report = report or Reporter()
  if not os.path.isdir(root):
    raise FileNotFoundError(f"run root {root!r} is not a directory")
  runs = []
  for directory, subdirs, files in os.walk(root):
    subdirs.sort()
    if workdir_lib.CONFIG_FILE in files:
      run = load_run(directory, split, metric, report)
      if run is not None:
        runs.append(run)
      subdirs[:] = []       # a workdir's subfolders (checkpoints/) hold no other runs
  return sorted(runs, key=lambda r: r.workdir)
