"""The local executor: runs a sweep's runs as subprocesses of this machine and waits for them.

One run at a time in the spec's order, or with ``parallel="gpus"`` one run per local GPU slot
(``CUDA_VISIBLE_DEVICES`` set per run), the ready run with the most work on its chain of
dependents first (``critical_path_work``; the spec's ``step_cost`` hints). Each run's output
is appended to its ``sweep_run.log``; a run that fails gets ``sweep_error.txt`` and the sweep
moves on. Ctrl-C forwards SIGINT to the running trainers,
which save their checkpoints before they exit.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Mapping, Sequence

from lra_sparse import workdir as workdir_lib
from lra_sparse.sweep.spec import DEFAULT_MAIN, RunPlan, Sweep, expand_sweep, load_sweep
from lra_sparse.sweep.state import (BLOCKED, FINISHED, RUNNING, all_states, failure_reason, now,
                                    record_failure, read_manifest_outcomes, remove_file,
                                    write_manifest)
from lra_sparse.workdir import ERROR_FILE, LOG_FILE, RUNNING_FILE, is_finished, write_json

# Overrides nvidia-smi: "4" (a count), "0,2,3" (ids; an id given twice runs two runs on that GPU
# at once) or "0,1;2,3" (slots of several GPUs: each run sees its slot's GPUs and trains data
# parallel over them). A ";" makes it a list of slots, so one slot is written with a trailing
# one: "0,1;" (every run on GPUs 0 and 1), "2;" (GPU 2 alone; a bare "2" is a count).
GPU_ENV_VAR = "LRA_SWEEP_GPUS"


class Launcher:
  """Starts a run as a subprocess; tests replace ``start`` to avoid real training."""

  def __init__(self, main_command: Sequence[str] = DEFAULT_MAIN):
    self.main_command = list(main_command)

  def start(self, run: RunPlan, env: Mapping[str, str], log_file) -> subprocess.Popen:
    return subprocess.Popen(run.command(self.main_command), stdout=log_file,
                            stderr=subprocess.STDOUT, env=dict(env))


def detect_gpus() -> list[str]:
  """The sweep's GPU slots, one run each at a time (a slot is ``CUDA_VISIBLE_DEVICES`` of its
  run): $LRA_SWEEP_GPUS (``GPU_ENV_VAR``), else $CUDA_VISIBLE_DEVICES, else nvidia-smi."""
  value = os.environ.get(GPU_ENV_VAR, "").strip()
  if value:
    if value.isdigit():
      return [str(i) for i in range(int(value))]
    separator = ";" if ";" in value else ","
    parts = value.split(separator)
    if separator == ";" and len(parts) > 1 and not parts[-1].strip():
      parts = parts[:-1]                     # "0,1;": one slot of several GPUs
    slots = [",".join(i.strip() for i in part.split(",")) for part in parts]
    if not all(slots) or not all(i.isdigit() for slot in slots for i in slot.split(",")):
      raise ValueError(f"${GPU_ENV_VAR}={value!r}: give a count ('4'), GPU ids ('0,2,3') or "
                       "slots of GPU ids ('0,1;2,3'; one slot: '0,1;' or '2;')")
    return slots
  visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
  if visible and visible != "-1":
    return [part.strip() for part in visible.split(",") if part.strip()]
  try:
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return []
  if listing.returncode != 0:
    return []
  return [str(i) for i, line in enumerate(
      line for line in listing.stdout.splitlines() if line.startswith("GPU "))]


def pick_slot(free_slots: Sequence[str | None], busy_slots: Sequence[str | None]) -> int:
  """Index in ``free_slots`` of the slot whose GPUs carry the fewest running runs
  (``busy_slots``: the slots of the runs running now); ties go to the earliest. With several
  runs per GPU ("0,1,0,1") a sweep whose runs wait on others would otherwise stack new runs on
  a GPU still busy while another sits idle."""
  load = collections.Counter(gpu for slot in busy_slots if slot for gpu in slot.split(","))
  def slot_load(i):
    return sum(load[gpu] for gpu in (free_slots[i] or "").split(",") if gpu)
  return min(range(len(free_slots)), key=lambda i: (slot_load(i), i))


def critical_path_work(runs: Sequence[RunPlan]) -> dict[str, float]:
  """Per run, its cost plus the most work on any chain of runs that depend on it (runs come in
  launch order: a run's dependencies before it). With several slots the ready run with the most
  such work launches first; ties keep the spec's order."""
  dependents = collections.defaultdict(list)
  for run in runs:
    for dep in run.depends_on:
      dependents[dep].append(run.name)
  work: dict[str, float] = {}
  for run in reversed(runs):
    work[run.name] = run.cost + max((work[name] for name in dependents[run.name]), default=0.0)
  return work


@dataclasses.dataclass
class _Active:
  run: RunPlan
  process: Any
  log_file: Any
  slot: str | None
  started: float


def run_sweep(spec_arg: str, root: str, *, parallel: str = "none",
              launcher: Launcher | None = None, run_filter: str = "",
              poll_seconds: float = 0.5, show_progress: bool = True) -> dict[str, str]:
  """Launches every unfinished run of the sweep; returns the final state of each run."""
  sweep = load_sweep(spec_arg)
  runs = expand_sweep(sweep, root)        # a bad spec fails before the root is created
  with workdir_lib.locked(root, workdir_lib.SWEEP_LOCK_FILE):
    return _run_sweep_locked(sweep, spec_arg, root, runs, parallel=parallel, launcher=launcher,
                             run_filter=run_filter, poll_seconds=poll_seconds,
                             show_progress=show_progress)


def _run_sweep_locked(sweep: Sweep, spec_arg: str, root: str, runs: Sequence[RunPlan], *,
                      parallel: str, launcher: Launcher | None, run_filter: str,
                      poll_seconds: float, show_progress: bool) -> dict[str, str]:
  previous_outcomes = read_manifest_outcomes(root, sweep.name)
  launcher = launcher or Launcher()
  if parallel == "gpus":
    slots: list[str | None] = list(detect_gpus()) or [None]
    if slots == [None]:
      print("sweep: no GPU found, running one run at a time", file=sys.stderr)
    else:
      print(f"sweep: GPU slots {'; '.join(slots)} (one run each at a time)", file=sys.stderr)
  elif parallel == "none":
    slots = [None]
  else:
    raise ValueError(f"--parallel must be 'none' or 'gpus', got {parallel!r}")

  selected = {run.name for run in runs if not run_filter or re.search(run_filter, run.name)}
  states = all_states(runs)
  outcomes: dict[str, dict[str, Any]] = {run.name: previous_outcomes[run.name] for run in runs
                                         if run.name in previous_outcomes}
  queue = [run for run in runs if run.name in selected and states[run.name] != FINISHED]
  skipped_running = [run.name for run in queue if states[run.name] == RUNNING]
  queue = [run for run in queue if states[run.name] != RUNNING]
  if len(slots) > 1:
    work = critical_path_work(runs)
    queue.sort(key=lambda run: -work[run.name])
  for name in skipped_running:
    print(f"sweep: {name} is running in another process; not launching it", file=sys.stderr)
  write_manifest(sweep, spec_arg, root, runs, launcher.main_command, outcomes)
  print(f"sweep {sweep.name}: {len(runs)} runs, {sum(s == FINISHED for s in states.values())} "
        f"finished, {len(queue)} to launch", file=sys.stderr)

  progress = None
  if show_progress and queue:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    progress = tqdm(total=len(queue), desc=sweep.name, unit="run")
  free_slots = list(slots)
  active: list[_Active] = []
  done_states: dict[str, str] = {}   # states decided during this call

  def dependency_status(dep: str) -> str:
    """ok: finished; wait: launched or queued by this call; bad: will not finish here."""
    if any(a.run.name == dep for a in active) or any(r.name == dep for r in queue):
      return "wait"
    plan = next(run for run in runs if run.name == dep)
    return "ok" if is_finished(plan.workdir) else "bad"

  try:
    while queue or active:
      launched = False
      for run in list(queue):
        if not free_slots:
          break
        dep_status = {dep: dependency_status(dep) for dep in run.depends_on}
        bad = [dep for dep, status in dep_status.items() if status == "bad"]
        if bad:
          queue.remove(run)
          done_states[run.name] = BLOCKED
          outcomes[run.name] = {"blocked_by": bad}
          print(f"sweep: {run.name} blocked: dependency {', '.join(bad)} not finished",
                file=sys.stderr)
          if progress:
            progress.update(1)
          continue
        if "wait" in dep_status.values():
          continue
        queue.remove(run)
        slot = free_slots.pop(pick_slot(free_slots, [entry.slot for entry in active]))
        outcomes[run.name] = {"started": now(), "slot": slot}
        try:
          active.append(_start(run, slot, launcher))
        except OSError as e:             # e.g. the interpreter cannot be executed
          free_slots.append(slot)
          done_states[run.name] = record_failure(run, f"could not start: {e}",
                                                 launcher.main_command)
          outcomes[run.name]["returncode"] = None
          if progress:
            progress.update(1)
          continue
        launched = True
      if progress and launched:
        progress.set_postfix_str(", ".join(a.run.name for a in active)[:80])
      finished_any = False
      for entry in list(active):
        returncode = entry.process.poll()
        if returncode is None:
          continue
        active.remove(entry)
        free_slots.append(entry.slot)
        done_states[entry.run.name] = _finish(entry, returncode, launcher, outcomes)
        write_manifest(sweep, spec_arg, root, runs, launcher.main_command, outcomes)
        if progress:
          progress.update(1)
        finished_any = True
      if not launched and not finished_any and (active or queue):
        if not active:                   # queued runs wait on nothing that can finish
          for run in queue:
            done_states[run.name] = BLOCKED
          queue.clear()
          break
        time.sleep(poll_seconds)
  except KeyboardInterrupt:
    for entry in active:      # SIGINT: each trainer finishes its in-flight save, then exits
      entry.process.send_signal(signal.SIGINT)
    for entry in active:      # each stopped trainer's end is recorded like any other:
      try:                    # exit code 130 -> "interrupted" (resumes), else "failed"
        returncode = entry.process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        entry.process.kill()
        returncode = entry.process.wait()
      _finish(entry, returncode, launcher, outcomes)
    write_manifest(sweep, spec_arg, root, runs, launcher.main_command, outcomes)
    raise
  finally:
    if progress:
      progress.close()
  write_manifest(sweep, spec_arg, root, runs, launcher.main_command, outcomes)
  final = all_states(runs)
  final.update({name: state for name, state in done_states.items() if state == BLOCKED})
  return final



def _start(run: RunPlan, slot: str | None, launcher: Launcher) -> _Active:
  os.makedirs(run.workdir, exist_ok=True)
  remove_file(os.path.join(run.workdir, ERROR_FILE))   # a retry: the log keeps the old output
  env = dict(os.environ)
  if slot is not None:
    env["CUDA_VISIBLE_DEVICES"] = slot
  log_file = open(os.path.join(run.workdir, LOG_FILE), "a")
  log_file.write(f"==== {now()} sweep launch (slot {slot}): "
                 f"{' '.join(run.command(launcher.main_command))}\n")
  log_file.flush()
  try:
    process = launcher.start(run, env, log_file)
  except OSError:
    log_file.close()
    raise
  write_json(os.path.join(run.workdir, RUNNING_FILE),
             {"pid": process.pid, "host": socket.gethostname(), "started": now(),
              "slot": slot}, sort_keys=False, trailing_newline=True)
  return _Active(run=run, process=process, log_file=log_file, slot=slot, started=time.time())


def _finish(entry: _Active, returncode: int, launcher: Launcher,
            outcomes: dict[str, dict[str, Any]]) -> str:
  """Records a trainer's end (its outcome: end time, exit code, seconds) and returns the run's
  state: finished, or interrupted / failed (``record_failure``)."""
  outcomes[entry.run.name].update({"ended": now(), "returncode": returncode,
                                   "seconds": round(time.time() - entry.started, 1)})
  entry.log_file.close()
  run = entry.run
  remove_file(os.path.join(run.workdir, RUNNING_FILE))
  if returncode == 0 and is_finished(run.workdir):
    return FINISHED
  return record_failure(run, failure_reason(returncode), launcher.main_command)
