"""The run-directory format: file names, atomic JSON, the metrics log and its reader.

A run's workdir holds (WORKSPACE.md, section 1):

- ``config.json``: the run's config (``lra_sparse.config.run_config``), rewritten at every
  (re)start;
- ``metrics.jsonl``: one JSON object per line with ``step``, ``split``, ``time`` and the
  metrics (non-finite values written as strings such as ``"nan"``);
- ``events.out.tfevents.*``: TensorBoard event files, one per (re)start, holding the records
  of ``metrics.jsonl`` as scalars (``lra_sparse.metric_writers``);
- ``result.json``: written once, when the run finished (a run is finished iff it exists);
- ``checkpoints/``: orbax checkpoints;
- ``profile/``: only with ``config.profile_steps``, the ``jax.profiler`` trace of those steps;
- ``wandb_run.json`` and ``wandb/``: only with ``config.wandb.project``, the W&B run id (a
  resumed run logs on into that run) and wandb's local files;
- ``run.lock``: held (``flock``) by the process training in the workdir, with its pid, host,
  start time and command; the kernel releases it when that process dies, so a stale lock is
  simply taken over.

When the sweep runner launched the run it also holds ``sweep_run.log``,
``sweep_running.json`` and (after a failure) ``sweep_error.txt``; a sweep root holds
``sweep.json``. Train, sweep, tables and analysis read and write these files only through
this module.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import sys
import time
from typing import Any, Callable, Iterator, Optional

from lra_sparse import config as config_lib
from lra_sparse.errors import EXIT_INTERRUPTED, WorkdirBusy

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
CHECKPOINT_DIR = "checkpoints"
PROFILE_DIR = "profile"
WANDB_RUN_FILE = "wandb_run.json"
LOCK_FILE = "run.lock"
SWEEP_LOCK_FILE = "sweep.lock"    # in the sweep root, held by the sweep runner
# Written by the sweep runner (lra_sparse.sweep).
ERROR_FILE = "sweep_error.txt"
LOG_FILE = "sweep_run.log"
RUNNING_FILE = "sweep_running.json"
MANIFEST_FILE = "sweep.json"      # in the sweep root, not in a run's workdir


def write_json(path: str, payload: Any, *, sort_keys: bool = True,
               trailing_newline: bool = False) -> None:
  """Writes JSON atomically: a temporary file in the same directory, then ``os.replace``."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=2, sort_keys=sort_keys)
    if trailing_newline:
      f.write("\n")
  os.replace(tmp, path)


def _describe_holder(info: Optional[dict]) -> str:
  if not info:
    return "another process (no details recorded)"
  return (f"pid {info.get('pid')} on {info.get('host')} since {info.get('started')} "
          f"({info.get('command', '')})")


def _read_holder(fd: int) -> Optional[dict]:
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 65536).decode(errors="replace")
    info = json.loads(text) if text.strip() else None
    return info if isinstance(info, dict) else None
  except (OSError, ValueError):
    return None


@contextlib.contextmanager
def locked(workdir: str, lock_file: str = LOCK_FILE) -> Iterator[None]:
  """Holds ``<workdir>/<lock_file>`` exclusively for the body (creating the directory);
  raises ``WorkdirBusy`` naming the holder when another live process has it."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, lock_file)
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      what = "sweep root" if lock_file == SWEEP_LOCK_FILE else "workdir"
      raise WorkdirBusy(f"{what} {workdir} is in use by {_describe_holder(_read_holder(fd))}; "
                        "wait for it or use another directory") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    try:
      yield
    finally:
      os.ftruncate(fd, 0)
      fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


def lock_holder(workdir: str) -> Optional[dict]:
  """The holder's record while a live process holds the workdir's lock, else None."""
  path = os.path.join(workdir, LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      return _read_holder(fd) or {}
    fcntl.flock(fd, fcntl.LOCK_UN)
    return None
  finally:
    os.close(fd)


def is_finished(workdir: str) -> bool:
  return os.path.exists(os.path.join(workdir, RESULT_FILE))


def read_config(workdir: str) -> dict[str, Any]:
  """The run's config.json as a nested dict in the current layout (configs written before
  each attention kind had its own block are converted: ``config.upgrade_legacy_config``).
  Raises OSError / ValueError when the file is missing or not a JSON object."""
  with open(os.path.join(workdir, CONFIG_FILE)) as f:
    config = json.load(f)
  if not isinstance(config, dict):
    raise ValueError("not a JSON object")
  return config_lib.upgrade_legacy_config(config)


def read_result(workdir: str) -> Any:
  """The parsed result.json (OSError / ValueError when missing or invalid)."""
  with open(os.path.join(workdir, RESULT_FILE)) as f:
    return json.load(f)


class MetricsWriter:
  """Appends one JSON object per line to ``<workdir>/metrics.jsonl``.

  A last line left unterminated by a crash (a full disk, say) is ended first, so the next
  record starts on a line of its own and readers skip only the broken one.
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, METRICS_FILE)
    try:
      with open(self.path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
          f.seek(-1, os.SEEK_END)
          if f.read(1) != b"\n":
            f.write(b"\n")
    except FileNotFoundError:
      pass

  def write(self, step: int, split: str, metrics: dict[str, float]) -> dict[str, Any]:
    """Appends the record and returns it."""
    record = {"step": int(step), "split": split, "time": time.time()}
    for key, value in metrics.items():
      value = float(value)
      record[key] = value if math.isfinite(value) else str(value)
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    return record


def read_metrics(workdir: str, report: Optional[Callable[[str], None]] = None
                 ) -> list[tuple[int, dict[str, Any]]]:
  """(line number, record) of every valid line of metrics.jsonl (none if the file is absent).

  A line that is not a JSON object with ``step`` and ``split`` is skipped and, when ``report``
  is given, reported as ``FILE:LINE: ...``.
  """
  path = os.path.join(workdir, METRICS_FILE)
  records = []
  if not os.path.exists(path):
    return records
  with open(path, errors="replace") as f:
    for line_number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError as e:
        if report:
          report(f"{path}:{line_number}: invalid JSON ({e.__class__.__name__}: {e}); "
                 "line skipped")
        continue
      if not isinstance(record, dict) or "step" not in record or "split" not in record:
        if report:
          report(f"{path}:{line_number}: not an object with 'step' and 'split'; line skipped")
        continue
      records.append((line_number, record))
  return records


def last_logged_step(workdir: str) -> Optional[int]:
  """Largest ``step`` in metrics.jsonl (unusable lines ignored), None if nothing logged."""
  steps = []
  for _, record in read_metrics(workdir):
    try:
      steps.append(int(record["step"]))
    except (ValueError, TypeError):
      continue
  return max(steps, default=None)


def was_interrupted(workdir: str) -> bool:
  """Whether the run's ``sweep_error.txt`` records an interruption (exit code 130: stopped on
  request with its checkpoint saved; it resumes, it did not fail). False without the file."""
  try:
    with open(os.path.join(workdir, ERROR_FILE)) as f:
      return f.readline().strip() == f"return code {EXIT_INTERRUPTED}"
  except OSError:
    return False
