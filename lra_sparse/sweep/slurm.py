"""The SLURM executor: submits a sweep's runs as one job array through submitit.

SLURM schedules; this runner only decides what to submit and records the job ids in the
manifest. A job runs the same command as the local executor (so a resubmitted run resumes from
its checkpoints), appends its output to the run's log and writes ``sweep_error.txt`` itself
when the run fails, so ``--status`` reads the workdirs as for local runs and adds the queue
state of each run's latest job. A run whose dependency is not finished yet is submitted by a
later call, or by the same one with ``wait`` (which blocks until the jobs end, submitting
dependents as their dependencies finish). submitit's files live in ``<root>/_submitit``.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from lra_sparse import cli
from lra_sparse import workdir as workdir_lib
from lra_sparse.sweep.spec import DEFAULT_MAIN, RunPlan, Sweep, expand_sweep, load_sweep
from lra_sparse.sweep.state import (BLOCKED, FINISHED, QUEUED, RUNNING, all_states,
                                    error_summary, failure_reason, now, read_manifest_outcomes,
                                    record_failure, remove_file, write_error_file,
                                    write_manifest)
from lra_sparse.workdir import ERROR_FILE, LOG_FILE, is_finished

SUBMITIT_DIR = "_submitit"          # in the sweep root: submitit's job scripts, pickles and logs
JOB_POLL_SECONDS = 30.0             # --wait: how often submitit is asked whether jobs ended


class _JobCommand:
  """The body of one run's submitit job (pickled, run on the cluster node): the trainer command,
  in the directory the sweep was submitted from, with its output appended to the run's log.
  A failure leaves sweep_error.txt as under the local executor, so --status needs no runner."""

  def __init__(self, command: Sequence[str], workdir: str):
    self.command = list(command)
    self.workdir = workdir
    self.cwd = os.getcwd()          # config paths in the command are relative to it

  def __call__(self) -> int:
    import submitit  # pylint: disable=import-outside-toplevel
    job_id = submitit.JobEnvironment().job_id
    os.makedirs(self.workdir, exist_ok=True)
    with open(os.path.join(self.workdir, LOG_FILE), "a") as log:
      log.write(f"==== {now()} sweep job {job_id} on {socket.gethostname()}: "
                f"{' '.join(self.command)}\n")
      log.flush()
      returncode = subprocess.run(self.command, stdout=log, stderr=subprocess.STDOUT,
                                  cwd=self.cwd, check=False).returncode
    if returncode != 0 or not is_finished(self.workdir):
      write_error_file(self.workdir, failure_reason(returncode), self.command)
    return returncode


def slurm_job_states(root: str, job_ids: Mapping[str, str]) -> dict[str, str]:
  """Run name -> the SLURM state (PENDING, RUNNING, COMPLETED, TIMEOUT, ...) of its job in
  ``job_ids``, through submitit (one sacct call); {} where SLURM's sacct is not installed."""
  if not job_ids or shutil.which("sacct") is None:
    return {}
  import submitit  # pylint: disable=import-outside-toplevel
  folder = os.path.join(root, SUBMITIT_DIR)
  jobs = {name: submitit.SlurmJob(folder, job_id) for name, job_id in job_ids.items()}
  return {name: (job.state.split() or ["UNKNOWN"])[0] for name, job in jobs.items()}


def recorded_jobs(runs: Sequence[RunPlan], outcomes: Mapping[str, Mapping[str, Any]],
                  job_states: Callable[[Mapping[str, str]], Mapping[str, str]]
                  ) -> dict[str, tuple[str, str]]:
  """Run name -> (job id, state from ``job_states``) of the latest job that the manifest's
  ``outcomes`` record for each unfinished run."""
  job_ids = {run.name: str(outcomes[run.name]["job_id"]) for run in runs
             if "job_id" in outcomes.get(run.name, {}) and not is_finished(run.workdir)}
  states = job_states(job_ids) if job_ids else {}
  return {name: (job_ids[name], state) for name, state in states.items() if name in job_ids}


def slurm_executor(root: str, *, partition: str = "", time_min: int = 240,
                   gpus_per_node: int = 1, cpus_per_task: int = 0, mem_gb: int = 0,
                   array_parallelism: int = 256, extra: str = ""):
  """submitit's SLURM executor for one job per run (one task, one node), its files under
  ``<root>/_submitit``; at most ``array_parallelism`` runs of one submission run at once.
  ``extra``: more sbatch options as ``key=value,key=value``."""
  if time_min <= 0:
    raise ValueError(f"--slurm_time_min must be > 0, got {time_min}")
  if gpus_per_node < 0 or cpus_per_task < 0 or mem_gb < 0:
    raise ValueError("--slurm_gpus_per_node, --slurm_cpus_per_task and --slurm_mem_gb must be "
                     ">= 0")
  if array_parallelism < 1:
    raise ValueError(f"--slurm_array_parallelism must be >= 1, got {array_parallelism}")
  additional = {}
  for item in filter(None, (part.strip() for part in extra.split(","))):
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
      raise ValueError(f"--slurm_extra: expected key=value items, got {item!r}")
    additional[key.strip()] = value.strip()
  missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
  if missing:
    raise ValueError(f"--executor=slurm needs SLURM (no {' or '.join(missing)} on PATH); run on "
                     "a login node")
  import submitit  # pylint: disable=import-outside-toplevel
  executor = submitit.AutoExecutor(folder=os.path.join(root, SUBMITIT_DIR), cluster="slurm")
  params: dict[str, Any] = dict(timeout_min=time_min, gpus_per_node=gpus_per_node, nodes=1,
                                tasks_per_node=1, name="lra_sparse",
                                slurm_array_parallelism=array_parallelism)
  if partition:
    params["slurm_partition"] = partition
  if cpus_per_task:
    params["cpus_per_task"] = cpus_per_task
  if mem_gb:
    params["mem_gb"] = mem_gb
  if additional:
    params["slurm_additional_parameters"] = additional
  executor.update_parameters(**params)
  return executor



def submit_sweep(spec_arg: str, root: str, executor, *, run_filter: str = "",
                 job_states: Callable[[Mapping[str, str]], Mapping[str, str]] | None = None,
                 wait: bool = False, poll_seconds: float = JOB_POLL_SECONDS,
                 main_command: Sequence[str] = DEFAULT_MAIN) -> dict[str, str]:
  """Submits every selected run that is neither finished, running nor queued as one job of the
  submitit ``executor`` (SLURM; submitit's LocalExecutor in tests), the runs that are ready
  together as one job array, records the job ids in the manifest and returns each run's state.

  ``job_states`` (run name -> job id, to run name -> SLURM state) tells which jobs recorded by
  earlier calls are still in the queue. A run whose dependency has not finished waits for a
  later call; ``wait`` blocks until this call's jobs end and submits such runs as their
  dependencies finish.
  """
  sweep = load_sweep(spec_arg)
  runs = expand_sweep(sweep, root)        # a bad spec fails before the root is created
  with workdir_lib.locked(root, workdir_lib.SWEEP_LOCK_FILE):
    return _submit_sweep_locked(sweep, spec_arg, root, runs, executor, run_filter=run_filter,
                                job_states=job_states, wait=wait, poll_seconds=poll_seconds,
                                main_command=main_command)


def _submit_sweep_locked(sweep: Sweep, spec_arg: str, root: str, runs: Sequence[RunPlan],
                         executor, *, run_filter: str,
                         job_states: Callable[[Mapping[str, str]], Mapping[str, str]] | None,
                         wait: bool, poll_seconds: float,
                         main_command: Sequence[str]) -> dict[str, str]:
  outcomes = dict(read_manifest_outcomes(root, sweep.name))
  queued = recorded_jobs(runs, outcomes, job_states) if job_states else {}
  states = all_states(runs, queued)
  selected = {run.name for run in runs if not run_filter or re.search(run_filter, run.name)}
  todo = [run for run in runs
          if run.name in selected and states[run.name] not in (FINISHED, RUNNING, QUEUED)]
  for run in runs:
    if run.name in selected and states[run.name] in (RUNNING, QUEUED):
      job = f" (job {queued[run.name][0]})" if run.name in queued else ""
      print(f"sweep: {run.name} is {states[run.name]}{job}; not submitting it", file=sys.stderr)
  print(f"sweep {sweep.name}: {len(runs)} runs, {sum(s == FINISHED for s in states.values())} "
        f"finished, {len(todo)} to submit", file=sys.stderr)
  by_name = {run.name: run for run in runs}
  active: dict[str, Any] = {}             # this call's jobs that have not ended
  blocked: dict[str, str] = {}

  def current_states() -> dict[str, str]:
    jobs = {**queued, **{name: (str(job.job_id), "PENDING") for name, job in active.items()}}
    return {**all_states(runs, jobs), **blocked}

  def dependency_status(dep: str) -> str:
    """ok: finished; wait: queued, running or still to submit; bad: will not finish."""
    if is_finished(by_name[dep].workdir):
      return "ok"
    if dep in active or states[dep] in (RUNNING, QUEUED) or any(r.name == dep for r in todo):
      return "wait"
    return "bad"

  try:
    while True:
      ready, newly_blocked = [], {}
      for run in todo:
        status = {dep: dependency_status(dep) for dep in run.depends_on}
        bad = [dep for dep, value in status.items() if value == "bad" or dep in newly_blocked]
        if bad:
          newly_blocked[run.name] = bad
        elif "wait" not in status.values():
          ready.append(run)
      for name, bad in newly_blocked.items():
        blocked[name] = BLOCKED
        outcomes[name] = {"blocked_by": bad}
        print(f"sweep: {name} blocked: dependency {', '.join(bad)} not finished",
              file=sys.stderr)
      todo = [run for run in todo if run.name not in newly_blocked and run not in ready]
      if ready:
        for run, job in zip(ready, _submit_jobs(executor, ready, main_command)):
          active[run.name] = job
          queued.pop(run.name, None)          # the ended job an earlier call recorded
          outcomes[run.name] = {"job_id": str(job.job_id), "submitted": now()}
        ids = [outcomes[run.name]["job_id"] for run in ready]
        print(f"sweep: submitted {len(ids)} jobs ({ids[0]}{' .. ' + ids[-1] if ids[1:] else ''})",
              file=sys.stderr)
        write_manifest(sweep, spec_arg, root, runs, main_command, outcomes, current_states())
      if not wait or not active:
        break
      time.sleep(poll_seconds)
      for name, job in list(active.items()):
        if job.done():
          del active[name]
          _job_ended(by_name[name], job, outcomes[name], main_command)
          write_manifest(sweep, spec_arg, root, runs, main_command, outcomes, current_states())
  finally:
    write_manifest(sweep, spec_arg, root, runs, main_command, outcomes, current_states())
  if todo:
    print(f"sweep: {len(todo)} runs wait on runs that have not finished (e.g. {todo[0].name} "
          f"on {', '.join(todo[0].depends_on)}); run the sweep again once those finish",
          file=sys.stderr)
  return current_states()


def _submit_jobs(executor, runs: Sequence[RunPlan], main_command: Sequence[str]) -> list[Any]:
  """One job per run, all in one job array; a failed submission is one ValueError."""
  for run in runs:
    os.makedirs(run.workdir, exist_ok=True)
    remove_file(os.path.join(run.workdir, ERROR_FILE))  # a retry: the log keeps the old output
  try:
    with executor.batch():
      jobs = [executor.submit(_JobCommand(run.command(main_command), run.workdir))
              for run in runs]
  except Exception as error:  # pylint: disable=broad-except  (sbatch refused, no SLURM, ...)
    raise ValueError(f"submitting {len(runs)} jobs failed: {cli.one_line(error)}") from error
  return jobs


def _job_ended(run: RunPlan, job, outcome: dict[str, Any], main_command: Sequence[str]) -> None:
  """Records the outcome of a run whose job ended. A job killed before the trainer exited (time
  limit, memory, node failure, cancelled) wrote no error file: it is written here."""
  outcome.update(ended=now(), job_state=str(job.state),
                 returncode=None if job.exception() else int(job.result()))
  if is_finished(run.workdir):
    return
  if outcome["returncode"] is None and not os.path.exists(os.path.join(run.workdir, ERROR_FILE)):
    record_failure(run, f"job {job.job_id} ended ({outcome['job_state']}) before the trainer "
                   "exited", main_command)
  else:
    print(f"sweep: {run.name} failed ({error_summary(run.workdir)})", file=sys.stderr)

