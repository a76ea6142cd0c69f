"""Where a run's metric records go: ``metrics.jsonl``, TensorBoard and, optionally, W&B.

The trainer writes every record through one :class:`RunWriter`: the line of ``metrics.jsonl``
(``lra_sparse.workdir.MetricsWriter``, the record the tables and the resume logic read), the
same values as TensorBoard scalars named ``<split>/<metric>`` (``train/loss``, ``val/accuracy``,
``test_at_best_val/accuracy``...) at the record's step and time, in event files in the workdir
itself, and, when ``config.wandb.project`` is set, the same values logged to Weights & Biases.

TensorBoard files are written with tensorboardX: it writes event files with its own protobuf
messages and needs no TensorFlow (``clu.metric_writers`` imports tensorflow for its summaries).

A resumed run adds a new event file next to the earlier ones; that file starts with a restart
marker at ``start_step + 1`` (tensorboardX's ``purge_step``), so TensorBoard hides the earlier
records of the steps the resumed run does again (``metrics.jsonl`` keeps both). The W&B run
id is kept in the workdir (``wandb_run.json``), so a resumed run logs on into the same W&B run
(W&B drops, with a warning, steps below the ones it already has).
"""
from __future__ import annotations

import importlib
import json
import os
import time
import uuid
from typing import Any, Mapping, Optional

import ml_collections
import tensorboardX

from lra_sparse import cli
from lra_sparse import workdir as workdir_lib

# Seconds between flushes of the event file to disk (jsonl lines are written at once).
TENSORBOARD_FLUSH_SECS = 10


def import_wandb(project: str):
  """The wandb module; a ValueError naming the fix when it is not installed."""
  try:
    return importlib.import_module("wandb")
  except ImportError:
    raise ValueError(f"config.wandb.project={project!r} logs to Weights & Biases, but the "
                     "wandb package is not installed: pip install wandb (or leave "
                     "config.wandb.project empty)") from None


def check_config(config: ml_collections.ConfigDict) -> None:
  """Checks of the ``wandb`` fields, before any data is read: types, and that wandb imports
  when a project is set."""
  for field in ("project", "entity"):
    value = config.wandb[field]
    if not isinstance(value, str):
      raise ValueError(f"config.wandb.{field}={value!r} must be a string ('' = not set)")
  if config.wandb.entity and not config.wandb.project:
    raise ValueError(f"config.wandb.entity={config.wandb.entity!r} is set but "
                     "config.wandb.project is empty: set the project too (W&B logging is on "
                     "only with a project)")
  if config.wandb.project:
    import_wandb(config.wandb.project)


class TensorBoardWriter:
  """Scalars ``<split>/<metric>`` in a new event file in ``logdir``."""

  def __init__(self, logdir: str, purge_step: Optional[int] = None):
    # Seconds in the file name (tensorboardX) and nanoseconds in the suffix: a resumed run's
    # file sorts after the earlier ones even within the same second, and never replaces one.
    self._writer = tensorboardX.SummaryWriter(
        logdir=logdir, purge_step=purge_step, flush_secs=TENSORBOARD_FLUSH_SECS,
        filename_suffix=f".{time.time_ns()}")

  def write(self, step: int, split: str, values: Mapping[str, float],
            walltime: Optional[float] = None) -> None:
    for name, value in values.items():
      self._writer.add_scalar(f"{split}/{name}", value, global_step=int(step),
                              walltime=walltime)

  def close(self) -> None:
    self._writer.close()


class WandbWriter:
  """One W&B run per workdir: named after the workdir, holding the run's config; its id is
  kept in ``<workdir>/wandb_run.json`` so that a resumed run logs on into it."""

  def __init__(self, workdir: str, config: ml_collections.ConfigDict):
    project = config.wandb.project
    wandb = import_wandb(project)
    id_path = os.path.join(workdir, workdir_lib.WANDB_RUN_FILE)
    stored_id = self._stored_run_id(id_path)
    run_id = stored_id or uuid.uuid4().hex[:16]
    try:
      self._run = wandb.init(
          project=project, entity=config.wandb.entity or None, name=os.path.basename(workdir),
          id=run_id, resume="allow", dir=workdir,
          allow_val_change=True, config=json.loads(config.to_json_best_effort()))
    except Exception as error:  # pylint: disable=broad-except  (wandb raises its own kinds)
      raise ValueError(f"config.wandb.project={project!r}: wandb.init failed "
                       f"({type(error).__name__}: {cli.one_line(error)}); log in with "
                       "`wandb login`, or set WANDB_MODE=offline, or leave "
                       "config.wandb.project empty") from error
    if stored_id is None:
      workdir_lib.write_json(id_path, {"id": run_id})

  @staticmethod
  def _stored_run_id(path: str) -> Optional[str]:
    """The W&B run id of an earlier start in this workdir; None if there is none (or it is
    unreadable: a new W&B run is started and its id recorded)."""
    try:
      with open(path) as f:
        run_id = json.load(f)["id"]
    except (OSError, ValueError, KeyError, TypeError):
      return None
    return run_id if isinstance(run_id, str) and run_id else None

  def write(self, step: int, split: str, values: Mapping[str, float]) -> None:
    self._run.log({f"{split}/{name}": value for name, value in values.items()}, step=int(step))

  def close(self, failed: bool = False) -> None:
    self._run.finish(exit_code=1 if failed else 0)


class RunWriter:
  """The trainer's one writer: each record goes to metrics.jsonl, TensorBoard and W&B.

  ``start_step`` is the step the run starts from (0, or the checkpoint it resumes): TensorBoard
  hides earlier files' records after it. Use as a context manager (or call ``close``); a run
  that ends with an exception is marked failed in W&B.
  """

  def __init__(self, workdir: str, config: ml_collections.ConfigDict, start_step: int = 0):
    # W&B first: it is the one that can refuse (not logged in), before an event file is added.
    self._wandb = WandbWriter(workdir, config) if config.wandb.project else None
    try:
      self._jsonl = workdir_lib.MetricsWriter(workdir)
      self._tensorboard = TensorBoardWriter(workdir, purge_step=int(start_step) + 1)
    except BaseException:
      if self._wandb is not None:
        self._wandb.close(failed=True)
      raise
    self._closed = False

  def write(self, step: int, split: str, metrics: Mapping[str, Any]) -> None:
    record = self._jsonl.write(step, split, metrics)
    values = {name: float(value) for name, value in metrics.items()}
    self._tensorboard.write(step, split, values, walltime=record["time"])
    if self._wandb is not None:
      self._wandb.write(step, split, values)

  def close(self, failed: bool = False) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      self._tensorboard.close()
    finally:
      if self._wandb is not None:
        self._wandb.close(failed)

  def __enter__(self) -> "RunWriter":
    return self

  def __exit__(self, exc_type, exc, traceback) -> None:
    self.close(failed=exc_type is not None)
