"""What state each run of a sweep is in, and the files that record it.

A run's state is read from its workdir alone: finished iff ``result.json`` exists; running
while the trainer holds the workdir's lock (or the sweep's ``sweep_running.json`` names a live
process); failed or interrupted (Ctrl-C, exit code 130) when the sweep wrote
``sweep_error.txt``; blocked when a run it depends on did not finish; else pending. Under
``--executor=slurm`` the SLURM state of a run's latest job corrects it (``queued``, ...).

The sweep root's manifest ``sweep.json`` lists every run with its state and the records of its
latest launch; ``describe_runs`` is the ``--dry_run`` / ``--status`` view. See WORKSPACE.md.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from typing import Any, Mapping, Sequence

from lra_sparse import workdir as workdir_lib
from lra_sparse.sweep.spec import RunPlan, Sweep, format_flag_value
from lra_sparse.workdir import (ERROR_FILE, LOG_FILE, MANIFEST_FILE, RESULT_FILE, RUNNING_FILE,
                                is_finished, last_logged_step, lock_holder, write_json)

FINISHED, RUNNING, FAILED, PENDING, BLOCKED = "finished", "running", "failed", "pending", "blocked"
INTERRUPTED = "interrupted"         # stopped by Ctrl-C, checkpointed: the next call resumes it
QUEUED = "queued"                   # a SLURM job for the run waits in the queue
STATES = (FINISHED, RUNNING, QUEUED, INTERRUPTED, FAILED, BLOCKED, PENDING)
ERROR_TAIL_LINES = 60
# SLURM job states (sacct, first word) of a job that is still queued or running.
LIVE_JOB_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED",
                             "RESIZING", "SUSPENDED"})


def _is_zombie(pid: int) -> bool:
  """True for a process that has exited but was not yet reaped (it still answers kill 0)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except (OSError, IndexError):
    return False


def _read_running(workdir: str) -> dict[str, Any] | None:
  """The record of a live process training in ``workdir``: the trainer's workdir lock, or the
  sweep's marker of a child that has not taken the lock yet; None when neither is alive."""
  holder = lock_holder(workdir)
  if holder is not None:
    return holder
  try:
    with open(os.path.join(workdir, RUNNING_FILE)) as f:
      info = json.load(f)
  except (OSError, ValueError):
    return None
  if info.get("host") != socket.gethostname():
    return info                        # another host: cannot check, assume it is alive
  try:
    pid = int(info["pid"])
    os.kill(pid, 0)
  except (OSError, KeyError, ValueError, TypeError):
    return None                        # stale marker of a dead process
  return None if _is_zombie(pid) else info


def run_state(run: RunPlan, states: Mapping[str, str] | None = None) -> str:
  """finished | running | interrupted | failed | blocked (a dependency did not finish) |
  pending."""
  if is_finished(run.workdir):
    return FINISHED
  if _read_running(run.workdir) is not None:
    return RUNNING
  if os.path.exists(os.path.join(run.workdir, ERROR_FILE)):
    return INTERRUPTED if workdir_lib.was_interrupted(run.workdir) else FAILED
  if states is not None and any(states.get(dep) in (INTERRUPTED, FAILED, BLOCKED)
                                for dep in run.depends_on):
    return BLOCKED
  return PENDING


def with_job_state(state: str, job_state: str | None) -> str:
  """A run's workdir state corrected by the SLURM state of its latest job: a job in the queue
  makes the run ``queued``, a started one whose trainer has not locked the workdir yet
  ``running``, and one that ended leaving neither result nor error file (time limit, memory,
  node failure, cancelled) ``failed``. An error file wins over a live state (sacct lags behind);
  UNKNOWN (no record yet, or sacct failed) changes nothing.
  """
  if job_state is None or job_state == "UNKNOWN" or state in (FINISHED, RUNNING, INTERRUPTED,
                                                               FAILED):
    return state
  if job_state in LIVE_JOB_STATES:
    return RUNNING if job_state in ("RUNNING", "COMPLETING") else QUEUED
  return FAILED if state == PENDING else state


def all_states(runs: Sequence[RunPlan],
               jobs: Mapping[str, tuple[str, str]] | None = None) -> dict[str, str]:
  """Each run's state; ``jobs`` (run name -> (job id, SLURM state)) corrects it by the queue."""
  states: dict[str, str] = {}
  for run in runs:                        # dependencies come first (earlier groups)
    job_state = jobs[run.name][1] if jobs and run.name in jobs else None
    states[run.name] = with_job_state(run_state(run, states), job_state)
  return states


# Lines a failed run's log may end with that say nothing about the error itself.
_LOG_NOISE = ("JAX has removed its internal frames", "JAX_TRACEBACK_FILTERING",
              "The preceding stack trace is the source", "-----")


def error_summary(workdir: str) -> str:
  """The failure's first line and the last informative line of the run's log tail."""
  try:
    with open(os.path.join(workdir, ERROR_FILE)) as f:
      lines = [line.strip() for line in f if line.strip()]
  except OSError:
    return ""
  header = lines[0] if lines else ""
  informative = [line for line in lines[1:] if not any(noise in line for noise in _LOG_NOISE)]
  last = informative[-1] if informative else ""
  return f"{header} | {last}" if last else header


# ----------------------------------------------------------------------------- failures


def failure_reason(returncode: int) -> str:
  """The first line of sweep_error.txt for a run that exited with ``returncode``."""
  return (f"return code {returncode}" if returncode != 0
          else f"return code 0 but no {RESULT_FILE} was written")


def write_error_file(workdir: str, reason: str, command: Sequence[str]) -> None:
  """sweep_error.txt: the reason, the time, the command and the tail of the run's log."""
  with open(os.path.join(workdir, ERROR_FILE), "w") as f:
    f.write(f"{reason}\n")
    f.write(f"time: {now()}\n")
    f.write(f"command: {' '.join(command)}\n")
    f.write(f"---- last {ERROR_TAIL_LINES} lines of {LOG_FILE} ----\n")
    f.write(_tail(os.path.join(workdir, LOG_FILE), ERROR_TAIL_LINES))


def record_failure(run: RunPlan, reason: str, main_command: Sequence[str]) -> str:
  """Writes sweep_error.txt and says so; the sweep goes on with other runs. The run's state:
  interrupted (exit code 130: it resumes next time) or failed."""
  remove_file(os.path.join(run.workdir, RUNNING_FILE))
  write_error_file(run.workdir, reason, run.command(main_command))
  state = INTERRUPTED if workdir_lib.was_interrupted(run.workdir) else FAILED
  print(f"sweep: {run.name} {'was ' if state == INTERRUPTED else ''}{state} ({reason}); see "
        f"{os.path.join(run.workdir, ERROR_FILE)}", file=sys.stderr)
  return state


def _tail(path: str, num_lines: int) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-num_lines:])
  except OSError:
    return "(no log)"


def now() -> str:
  """The current UTC time, as the sweep's records write it."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def remove_file(path: str) -> None:
  """Removes ``path`` if it is there."""
  try:
    os.remove(path)
  except OSError:
    pass


# ----------------------------------------------------------------------------- manifest


def write_manifest(sweep: Sweep, spec_arg: str, root: str, runs: Sequence[RunPlan],
                   main_command: Sequence[str], outcomes: Mapping[str, Mapping[str, Any]],
                   states: Mapping[str, str] | None = None) -> None:
  """Writes <root>/sweep.json; ``states`` (default: read from the workdirs) per run."""
  states = states or all_states(runs)
  payload = {
      "sweep": sweep.name,
      "spec": spec_arg,
      "updated": now(),
      "main_command": list(main_command),
      "counts": {state: sum(1 for s in states.values() if s == state) for state in STATES},
      "runs": [{
          "name": run.name,
          "group": run.group,
          "workdir": run.name,
          "config": run.config_arg,
          "overrides": run.overrides,
          "depends_on": run.depends_on,
          "state": states[run.name],
          **dict(outcomes.get(run.name, {})),
      } for run in runs],
  }
  write_json(os.path.join(root, MANIFEST_FILE), payload, sort_keys=False,
             trailing_newline=True)


OUTCOME_KEYS = ("started", "ended", "returncode", "seconds", "slot", "blocked_by", "job_id",
                "submitted", "job_state")


def read_manifest_outcomes(root: str, sweep_name: str) -> dict[str, dict[str, Any]]:
  """Per-run launch records of an earlier call (kept for runs this call does not launch).

  Raises if the root's manifest belongs to another sweep: one root holds one sweep.
  """
  path = os.path.join(root, MANIFEST_FILE)
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      manifest = json.load(f)
    owner = manifest.get("sweep")
    runs = manifest.get("runs", [])
  except (OSError, ValueError, AttributeError) as e:
    raise ValueError(f"{path} is unreadable ({e}); remove it or use another --root") from e
  if owner != sweep_name:
    raise ValueError(f"{root} holds sweep {owner!r} (see {path}); use another --root for "
                     f"sweep {sweep_name!r}")
  return {run["name"]: {key: run[key] for key in OUTCOME_KEYS if key in run}
          for run in runs if isinstance(run, dict) and "name" in run}


# ----------------------------------------------------------------------------- views


def describe_runs(runs: Sequence[RunPlan], show_overrides: bool,
                  jobs: Mapping[str, tuple[str, str]] | None = None) -> str:
  """One line per run: state, name, then overrides (dry run) or progress/error (status);
  ``jobs`` (run name -> (job id, SLURM state)) adds the queue's view of each run's job."""
  jobs = jobs or {}
  states = all_states(runs, jobs)
  name_width = max(len(run.name) for run in runs)
  lines = []
  for run in runs:
    state = states[run.name]
    if show_overrides:
      shown = []
      for key, value in sorted(run.overrides.items()):
        if run.depends_on and value in {os.path.join(os.path.dirname(run.workdir), dep)
                                        for dep in run.depends_on}:
          shown.append(f"{key}=<{os.path.basename(value)}>")
        else:
          shown.append(f"{key}={format_flag_value(value)}")
      detail = f"--config={run.config_arg} " + " ".join(shown)
    else:
      step = last_logged_step(run.workdir)
      detail = f"step {step}" if step is not None else ""
      if state in (FAILED, INTERRUPTED):
        detail = (detail + "  " if detail else "") + error_summary(run.workdir)
      if state == BLOCKED:
        detail = "waits on " + ", ".join(run.depends_on)
      if run.name in jobs:
        detail = " ".join(filter(None, (f"job {jobs[run.name][0]} {jobs[run.name][1]}", detail)))
    lines.append(f"{state:<9} {run.name:<{name_width}}  {detail}".rstrip())
  counts = {s: sum(1 for v in states.values() if v == s) for s in STATES}
  lines.append(f"{len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
  return "\n".join(lines)
