r"""Runs a sweep of training runs: one subprocess per run, skipping finished ones.

Usage (from the repository root)::

  python -m lra_sparse.sweep --sweep=experiments/specs/dfss_table4.py --root=runs/dfss_table4
  python -m lra_sparse.sweep --sweep=experiments/specs/dfss_table4.py:tiny --root=runs/t4 --dry_run
  python -m lra_sparse.sweep --sweep=experiments/specs/dfss_table4.py --root=runs/dfss_table4 \
      --status
  python -m lra_sparse.sweep ... --parallel=gpus     # one run per local GPU at a time
  python -m lra_sparse.sweep ... --executor=slurm --slurm_partition=gpu   # one SLURM job per run

A sweep spec is a python file whose ``get_sweep(preset="")`` returns a :class:`Sweep`; the
optional ``:preset`` after the path (``experiments/specs/x.py:tiny``) is passed to it, like the
config files. A sweep is a list of :class:`Group`\ s, each one config file (+ preset), fixed
overrides, and axes: ``product`` (every combination), ``zip`` (lists walked together),
``variants`` (a list of override dicts, e.g. dense vs. DFSS 1:2) and ``seeds``; the runs of a
group are the product of the variants, the zipped lists, the product axes and the seeds.

An override value may be a :class:`Ref` to a run of an earlier group
(``init_from=Ref("pretrain")``): it becomes that run's workdir, the run waits for it, and is
marked ``blocked`` if it failed or was interrupted.

Every run gets a deterministic name (group, config, variant label, axis values, seed) and the
workdir ``<root>/<name>``. A run is finished iff ``<workdir>/result.json`` exists; re-running a
sweep skips finished runs and launches the others with the same workdir (the trainer resumes
from its last checkpoint). A run that exits non-zero (or exits without result.json) gets
``<workdir>/sweep_error.txt`` (return code, command, the tail of its log) and the sweep moves on:
the run is ``failed``, or ``interrupted`` when the trainer was stopped by Ctrl-C (exit code 130,
its checkpoint saved; tables count it unfinished). Both are launched again by the next call.
See WORKSPACE.md for the layout of the sweep root.

``--executor=slurm`` submits each run that is neither finished, running nor queued as one job
of a SLURM job array through submitit and returns: SLURM schedules, this runner only decides
what to submit and records the job ids in the manifest. A job runs the same command (so a
resubmitted run resumes from its checkpoints), appends its output to the run's log and writes
``sweep_error.txt`` itself when the run fails, so ``--status`` reads the workdirs as for local
runs and adds the queue state of each run's latest job. A run whose dependency is not finished
yet is submitted by a later call, or by this one with ``--wait`` (which blocks until the jobs
end, submitting dependents as their dependencies finish).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from absl import app
from absl import flags
import ml_collections

from lra_sparse import cli
from lra_sparse import config as config_lib
from lra_sparse import workdir as workdir_lib
from lra_sparse.workdir import (ERROR_FILE, LOG_FILE, MANIFEST_FILE, RESULT_FILE, RUNNING_FILE,
                                is_finished, last_logged_step, lock_holder, write_json)

GPU_ENV_VAR = "LRA_SWEEP_GPUS"      # "4" (count) or "0,2,3" (ids); overrides nvidia-smi
MAX_NAME_LENGTH = 150
ERROR_TAIL_LINES = 60
DEFAULT_MAIN = (sys.executable, "-m", "lra_sparse.main")

FINISHED, RUNNING, FAILED, PENDING, BLOCKED = "finished", "running", "failed", "pending", "blocked"
INTERRUPTED = "interrupted"         # stopped by Ctrl-C with its checkpoint: the next call resumes it
QUEUED = "queued"                   # a SLURM job for the run waits in the queue
STATES = (FINISHED, RUNNING, QUEUED, INTERRUPTED, FAILED, BLOCKED, PENDING)
_MISSING = object()

SUBMITIT_DIR = "_submitit"          # in the sweep root: submitit's job scripts, pickles and logs
JOB_POLL_SECONDS = 30.0             # --wait: how often submitit is asked whether jobs ended
# SLURM job states (sacct, first word) of a job that is still queued or running.
LIVE_JOB_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED",
                             "RESIZING", "SUSPENDED"})


# ----------------------------------------------------------------------------- spec structures


@dataclasses.dataclass(frozen=True)
class Ref:
  """The workdir of one run of an earlier group of the same sweep.

  The referenced run is the one in ``group`` that agrees with the referring run on every key in
  ``same`` ("config" = config file and preset; other names are override keys such as "seed")
  and whose overrides contain ``match``. Exactly one run must qualify.
  """
  group: str
  same: tuple[str, ...] = ("config", "seed")
  match: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Variant:
  """A labelled set of overrides; the label replaces its key=value parts in run names."""
  label: str
  overrides: Mapping[str, Any]


@dataclasses.dataclass
class Group:
  """Runs sharing one config file: fixed overrides x variants x zip x product x seeds."""
  config: str                                   # "configs/listops.py" or "configs/listops.py:tiny"
  name: str = ""                                # name prefix; needed when several groups exist
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  variants: Sequence[Mapping[str, Any] | Variant] = (dict(),)
  zip: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
  product: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
  seeds: Sequence[int] = (0,)


@dataclasses.dataclass
class Sweep:
  name: str
  groups: Sequence[Group]


@dataclasses.dataclass
class RunPlan:
  """One run of an expanded sweep."""
  name: str
  group: str
  config: str                                   # config file path, without preset
  preset: str
  overrides: dict[str, Any]                     # Ref values resolved to workdir paths
  workdir: str
  depends_on: list[str]

  @property
  def config_arg(self) -> str:
    return f"{self.config}:{self.preset}" if self.preset else self.config

  def command(self, main_command: Sequence[str] = DEFAULT_MAIN) -> list[str]:
    args = [*main_command, f"--config={self.config_arg}", f"--workdir={self.workdir}"]
    args += [f"--config.{key}={format_flag_value(value)}"
             for key, value in sorted(self.overrides.items())]
    return args


# ----------------------------------------------------------------------------- loading specs


def load_sweep(spec_arg: str) -> Sweep:
  sweep = config_lib.call_spec_function(spec_arg, "get_sweep")
  if not isinstance(sweep, Sweep):
    raise ValueError(f"{spec_arg}: get_sweep() must return lra_sparse.sweep.Sweep, "
                     f"got {type(sweep).__name__}")
  return sweep


# ----------------------------------------------------------------------------- expansion


def format_flag_value(value: Any) -> str:
  """The text after ``--config.key=`` that ml_collections parses back to ``value``."""
  if isinstance(value, Ref):
    raise ValueError(f"unresolved {value!r}")
  if value is None:
    raise ValueError("None cannot be passed as a --config override")
  if isinstance(value, float):
    return repr(value)
  return str(value)


def format_name_value(value: Any) -> str:
  """A short, filesystem-safe rendering of an axis value for run names."""
  if isinstance(value, bool):
    text = str(value).lower()
  elif isinstance(value, float):
    text = format(value, "g")
  elif value == "":
    text = "none"
  else:
    text = str(value)
  return re.sub(r"[^A-Za-z0-9.+-]", "_", text.replace(":", "-"))


def _short_keys(keys: Iterable[str]) -> dict[str, str]:
  """Last dotted component of each key, or the full key where two keys would collide."""
  keys = sorted(set(keys))
  last = {key: key.rsplit(".", 1)[-1] for key in keys}
  counts: dict[str, int] = {}
  for short in last.values():
    counts[short] = counts.get(short, 0) + 1
  return {key: (last[key] if counts[last[key]] == 1 else key) for key in keys}


def _canonical(value: Any) -> str:
  return json.dumps(value, sort_keys=True, default=repr)


def _group_axis_combinations(group: Group,
                             where: str) -> list[tuple[str, set[str], dict[str, Any]]]:
  """(variant label, keys the label names, axis overrides incl. seed) per run of the group.

  The order is deterministic: variants, zip, product (keys sorted), seeds.
  """
  variants = [(variant.label, dict(variant.overrides)) if isinstance(variant, Variant)
              else ("", dict(variant)) for variant in group.variants] or [("", {})]
  labels = [label for label, _ in variants if label]
  if len(set(labels)) != len(labels) or any(re.search(r"[^A-Za-z0-9.+=-]", l) for l in labels):
    raise ValueError(f"{where}: variant labels must be distinct and use only letters, digits "
                     f"and . + = -, got {labels}")
  zip_keys = sorted(group.zip)
  zip_lengths = {len(group.zip[key]) for key in zip_keys}
  if len(zip_lengths) > 1:
    raise ValueError(f"{where}: zip lists have different lengths "
                     f"{ {key: len(group.zip[key]) for key in zip_keys} }")
  zipped = ([dict(zip(zip_keys, values)) for values in zip(*(group.zip[key] for key in zip_keys))]
            if zip_keys else [{}])
  product_keys = sorted(group.product)
  for key in product_keys:
    if isinstance(group.product[key], (str, bytes)) or not len(group.product[key]):
      raise ValueError(f"{where}: product axis {key!r} must be a non-empty list")
  products = [dict(zip(product_keys, values))
              for values in itertools.product(*(group.product[key] for key in product_keys))]
  seeds = list(group.seeds)
  if not seeds:
    raise ValueError(f"{where}: seeds must not be empty")
  combos = []
  for (label, variant), zipped_values, product_values, seed in itertools.product(
      variants, zipped, products, seeds):
    parts = [variant, zipped_values, product_values, dict(group.overrides)]
    seen: set[str] = set()
    for part in parts:
      clash = seen & set(part)
      if clash:
        raise ValueError(f"{where}: {sorted(clash)} set by more than one of "
                         "variants/zip/product/overrides")
      seen |= set(part)
    if "seed" in seen:
      raise ValueError(f"{where}: set seeds with Group(seeds=...), not as an override")
    axis_values = {**variant, **zipped_values, **product_values, "seed": seed}
    # Keys named by the variant label stay out of the key=value part of the run name.
    combos.append((label, set(variant) if label else set(), axis_values))
  return combos


def expand_sweep(sweep: Sweep, root: str, validate: bool = True) -> list[RunPlan]:
  """All runs of a sweep, in launch order (groups in order; a Ref points to an earlier group)."""
  if not sweep.groups:
    raise ValueError(f"sweep {sweep.name!r} has no groups")
  group_names = [group.name for group in sweep.groups if group.name]
  if len(set(group_names)) != len(group_names):
    raise ValueError(f"sweep {sweep.name!r}: group names must be distinct, got {group_names}")
  root = os.path.abspath(root)
  runs: list[RunPlan] = []
  runs_by_group: dict[str, list[RunPlan]] = {}
  names: dict[str, dict[str, Any]] = {}
  for index, group in enumerate(sweep.groups):
    where = f"sweep {sweep.name!r} group {group.name or index!r}"
    config_path, preset = config_lib.split_spec_arg(group.config)
    base_config = _load_group_config(config_path, preset, where) if validate else None
    combos = _group_axis_combinations(group, where)
    # Axis keys (variants/zip/product) name the runs, seed always does; fixed overrides do not.
    axis_keys = sorted({key for _, _, combo in combos for key in combo} - {"seed"})
    short = _short_keys(axis_keys)
    config_label = os.path.splitext(os.path.basename(config_path))[0] + (
        f"-{preset}" if preset else "")
    group_runs = []
    for label, labelled_keys, combo in combos:
      parts = ([group.name] if group.name else []) + [config_label] + ([label] if label else [])
      parts += [f"{short[key]}={format_name_value(combo[key])}" for key in axis_keys
                if key in combo and key not in labelled_keys and not isinstance(combo[key], Ref)]
      parts.append(f"seed={combo['seed']}")
      name = "__".join(parts)
      overrides = {**dict(group.overrides), **combo}
      if base_config is not None:
        validate_run_overrides(base_config, overrides, f"{where} run {name!r}")
      identity = {"group": group.name, "config": group.config,
                  "overrides": {k: (repr(v) if isinstance(v, Ref) else v)
                                for k, v in overrides.items()}}
      if len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha1(_canonical(identity).encode()).hexdigest()[:8]
        name = f"{name[:MAX_NAME_LENGTH - 10]}__{digest}"
      if name in names:
        raise ValueError(f"{where}: two runs get the name {name!r}: {names[name]} and "
                         f"{identity}; make the axis values distinct")
      names[name] = identity
      resolved, depends_on = {}, []
      for key, value in overrides.items():
        if isinstance(value, Ref):
          target = _resolve_ref(value, overrides, group.config, runs_by_group, where, key)
          resolved[key] = target.workdir
          depends_on.append(target.name)
        else:
          resolved[key] = value
      run = RunPlan(name=name, group=group.name, config=config_path, preset=preset,
                    overrides=resolved, workdir=os.path.join(root, name),
                    depends_on=sorted(set(depends_on)))
      group_runs.append(run)
    if group.name:
      runs_by_group[group.name] = group_runs
    runs.extend(group_runs)
  return runs


def _load_group_config(config_path: str, preset: str, where: str):
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{where}: config file {config_path!r} does not exist "
                            "(paths are relative to the directory the sweep runs in)")
  return config_lib.load_config_file(config_path, preset)


def _resolve_ref(ref: Ref, overrides: Mapping[str, Any], config_arg: str,
                 runs_by_group: Mapping[str, list[RunPlan]], where: str, key: str) -> RunPlan:
  """The one run of ``ref.group`` that ``ref`` selects for a run with these overrides."""
  if ref.group not in runs_by_group:
    raise ValueError(f"{where}: {key}={ref!r} names no earlier group "
                     f"(earlier groups: {sorted(runs_by_group)})")
  candidates = []
  for run in runs_by_group[ref.group]:
    ok = True
    for same_key in ref.same:
      if same_key == "config":
        ok &= run.config_arg == config_arg
      else:
        if same_key not in overrides:
          raise ValueError(f"{where}: {ref!r} compares {same_key!r}, which this run does not set")
        ok &= run.overrides.get(same_key, _MISSING) == overrides[same_key]
    for match_key, match_value in ref.match.items():
      ok &= run.overrides.get(match_key, _MISSING) == match_value
    if ok:
      candidates.append(run)
  if len(candidates) != 1:
    raise ValueError(f"{where}: {key}={ref!r} must match exactly one run of group "
                     f"{ref.group!r}, matched {len(candidates)}: {[r.name for r in candidates]}")
  return candidates[0]



def validate_run_overrides(config, overrides: Mapping[str, Any], where: str) -> None:
  """One clear error for an override key the run's config would refuse or ignore: unknown
  (with a suggestion), of the old flat attention layout (names the new key), or a field of an
  attention kind other than the run's."""
  config = ml_collections.ConfigDict(config.to_dict())
  if "attention.kind" in overrides and not isinstance(overrides["attention.kind"], Ref):
    config.attention.kind = overrides["attention.kind"]
  config_lib.check_override_keys(config, sorted(overrides), where)


# ----------------------------------------------------------------------------- run state


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


# ----------------------------------------------------------------------------- launching


class Launcher:
  """Starts a run as a subprocess; tests replace ``start`` to avoid real training."""

  def __init__(self, main_command: Sequence[str] = DEFAULT_MAIN):
    self.main_command = list(main_command)

  def start(self, run: RunPlan, env: Mapping[str, str], log_file) -> subprocess.Popen:
    return subprocess.Popen(run.command(self.main_command), stdout=log_file,
                            stderr=subprocess.STDOUT, env=dict(env))


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
      log.write(f"==== {_now()} sweep job {job_id} on {socket.gethostname()}: "
                f"{' '.join(self.command)}\n")
      log.flush()
      returncode = subprocess.run(self.command, stdout=log, stderr=subprocess.STDOUT,
                                  cwd=self.cwd, check=False).returncode
    if returncode != 0 or not is_finished(self.workdir):
      _write_error_file(self.workdir, _failure_reason(returncode), self.command)
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


def detect_gpus() -> list[str]:
  """Local GPU ids: $LRA_SWEEP_GPUS (count or ids), else $CUDA_VISIBLE_DEVICES, else nvidia-smi."""
  value = os.environ.get(GPU_ENV_VAR, "").strip()
  if value:
    if value.isdigit() and "," not in value:
      return [str(i) for i in range(int(value))]
    return [part.strip() for part in value.split(",") if part.strip()]
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


def _tail(path: str, num_lines: int) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-num_lines:])
  except OSError:
    return "(no log)"


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_manifest(sweep: Sweep, spec_arg: str, root: str, runs: Sequence[RunPlan],
                   main_command: Sequence[str], outcomes: Mapping[str, Mapping[str, Any]],
                   states: Mapping[str, str] | None = None) -> None:
  """Writes <root>/sweep.json; ``states`` (default: read from the workdirs) per run."""
  states = states or all_states(runs)
  payload = {
      "sweep": sweep.name,
      "spec": spec_arg,
      "updated": _now(),
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
        slot = free_slots.pop(0)
        outcomes[run.name] = {"started": _now(), "slot": slot}
        try:
          active.append(_start(run, slot, launcher))
        except OSError as e:             # e.g. the interpreter cannot be executed
          free_slots.append(slot)
          done_states[run.name] = _record_failure(run, f"could not start: {e}",
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
        state = _finish(entry, returncode, launcher)
        done_states[entry.run.name] = state
        outcomes[entry.run.name].update(
            {"ended": _now(), "returncode": returncode,
             "seconds": round(time.time() - entry.started, 1)})
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
    for entry in active:
      try:
        entry.process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        entry.process.kill()
      entry.log_file.close()
      _remove(os.path.join(entry.run.workdir, RUNNING_FILE))
    write_manifest(sweep, spec_arg, root, runs, launcher.main_command, outcomes)
    raise
  finally:
    if progress:
      progress.close()
  write_manifest(sweep, spec_arg, root, runs, launcher.main_command, outcomes)
  final = all_states(runs)
  final.update({name: state for name, state in done_states.items() if state == BLOCKED})
  return final


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except OSError:
    pass


def _start(run: RunPlan, slot: str | None, launcher: Launcher) -> _Active:
  os.makedirs(run.workdir, exist_ok=True)
  _remove(os.path.join(run.workdir, ERROR_FILE))    # a retry: the log keeps the old output
  env = dict(os.environ)
  if slot is not None:
    env["CUDA_VISIBLE_DEVICES"] = slot
  log_file = open(os.path.join(run.workdir, LOG_FILE), "a")
  log_file.write(f"==== {_now()} sweep launch (slot {slot}): "
                 f"{' '.join(run.command(launcher.main_command))}\n")
  log_file.flush()
  try:
    process = launcher.start(run, env, log_file)
  except OSError:
    log_file.close()
    raise
  write_json(os.path.join(run.workdir, RUNNING_FILE),
             {"pid": process.pid, "host": socket.gethostname(), "started": _now(),
              "slot": slot}, sort_keys=False, trailing_newline=True)
  return _Active(run=run, process=process, log_file=log_file, slot=slot, started=time.time())


def _finish(entry: _Active, returncode: int, launcher: Launcher) -> str:
  entry.log_file.close()
  run = entry.run
  _remove(os.path.join(run.workdir, RUNNING_FILE))
  if returncode == 0 and is_finished(run.workdir):
    return FINISHED
  return _record_failure(run, _failure_reason(returncode), launcher.main_command)


def _failure_reason(returncode: int) -> str:
  return (f"return code {returncode}" if returncode != 0
          else f"return code 0 but no {RESULT_FILE} was written")


def _write_error_file(workdir: str, reason: str, command: Sequence[str]) -> None:
  """sweep_error.txt: the reason, the time, the command and the tail of the run's log."""
  with open(os.path.join(workdir, ERROR_FILE), "w") as f:
    f.write(f"{reason}\n")
    f.write(f"time: {_now()}\n")
    f.write(f"command: {' '.join(command)}\n")
    f.write(f"---- last {ERROR_TAIL_LINES} lines of {LOG_FILE} ----\n")
    f.write(_tail(os.path.join(workdir, LOG_FILE), ERROR_TAIL_LINES))


def _record_failure(run: RunPlan, reason: str, main_command: Sequence[str]) -> str:
  """Writes sweep_error.txt and says so; the sweep goes on with other runs. The run's state:
  interrupted (exit code 130: it resumes next time) or failed."""
  _remove(os.path.join(run.workdir, RUNNING_FILE))
  _write_error_file(run.workdir, reason, run.command(main_command))
  state = INTERRUPTED if workdir_lib.was_interrupted(run.workdir) else FAILED
  print(f"sweep: {run.name} {'was ' if state == INTERRUPTED else ''}{state} ({reason}); see "
        f"{os.path.join(run.workdir, ERROR_FILE)}", file=sys.stderr)
  return state


# ----------------------------------------------------------------------------- job executors


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
          outcomes[run.name] = {"job_id": str(job.job_id), "submitted": _now()}
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
    _remove(os.path.join(run.workdir, ERROR_FILE))    # a retry: the log keeps the old output
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
  outcome.update(ended=_now(), job_state=str(job.state),
                 returncode=None if job.exception() else int(job.result()))
  if is_finished(run.workdir):
    return
  if outcome["returncode"] is None and not os.path.exists(os.path.join(run.workdir, ERROR_FILE)):
    _record_failure(run, f"job {job.job_id} ended ({outcome['job_state']}) before the trainer "
                    "exited", main_command)
  else:
    print(f"sweep: {run.name} failed ({error_summary(run.workdir)})", file=sys.stderr)


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


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a program, so importing this module (specs do) adds no flags."""
  flags.DEFINE_string("sweep", None, "Sweep spec: experiments/specs/<name>.py[:preset].")
  flags.DEFINE_string("root", None, "Sweep root: one workdir per run under it.")
  flags.DEFINE_bool("dry_run", False, "List the runs (state, name, overrides); launch nothing.")
  flags.DEFINE_bool("status", False, "Show finished/running/failed/blocked/pending per run.")
  flags.DEFINE_enum("parallel", "none", ["none", "gpus"],
                    "none: one run at a time; gpus: one run per local GPU "
                    "(CUDA_VISIBLE_DEVICES).")
  flags.DEFINE_string("runs", "", "Only launch runs whose name matches this regular expression.")
  flags.DEFINE_enum("executor", "local", ["local", "slurm"],
                    "local: subprocesses on this machine, this process waits for them; slurm: "
                    "one SLURM job per run (submitit), submitted as a job array, then returns.")
  flags.DEFINE_bool("wait", False, "With --executor=slurm: block until the submitted jobs end "
                    "(submitting runs whose dependencies finish meanwhile), then print states.")
  flags.DEFINE_string("slurm_partition", "", "SLURM partition (default: the cluster's).")
  flags.DEFINE_integer("slurm_time_min", 240, "Time limit per job, minutes (a run that hits it "
                       "resumes from its checkpoint when the sweep is submitted again).")
  flags.DEFINE_integer("slurm_gpus_per_node", 1, "GPUs per job.")
  flags.DEFINE_integer("slurm_cpus_per_task", 0, "CPUs per job (0: the cluster's default).")
  flags.DEFINE_integer("slurm_mem_gb", 0, "Memory per job, GB (0: the cluster's default).")
  flags.DEFINE_integer("slurm_array_parallelism", 256,
                       "At most this many runs of one submission (one job array) run at once.")
  flags.DEFINE_string("slurm_extra", "", "More sbatch options, key=value,... "
                      "(e.g. account=lab,qos=normal).")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS.sweep or not FLAGS.root:
    raise app.UsageError("--sweep and --root are required")
  slurm = FLAGS.executor == "slurm"
  if slurm and FLAGS.parallel != "none":
    raise ValueError("--parallel=gpus places runs on local GPUs; with --executor=slurm SLURM "
                     "places them (see --slurm_array_parallelism)")
  if FLAGS.wait and not slurm:
    raise ValueError("--wait needs --executor=slurm (the local executor always waits)")
  if FLAGS.dry_run or FLAGS.status:
    sweep = load_sweep(FLAGS.sweep)
    runs = expand_sweep(sweep, FLAGS.root)
    jobs = None
    if FLAGS.status and slurm:
      jobs = recorded_jobs(runs, read_manifest_outcomes(FLAGS.root, sweep.name),
                           lambda job_ids: slurm_job_states(FLAGS.root, job_ids))
    print(f"sweep {sweep.name} ({FLAGS.sweep}) under {os.path.abspath(FLAGS.root)}")
    print(describe_runs(runs, show_overrides=FLAGS.dry_run, jobs=jobs))
    return
  if slurm:
    executor = slurm_executor(
        FLAGS.root, partition=FLAGS.slurm_partition, time_min=FLAGS.slurm_time_min,
        gpus_per_node=FLAGS.slurm_gpus_per_node, cpus_per_task=FLAGS.slurm_cpus_per_task,
        mem_gb=FLAGS.slurm_mem_gb, array_parallelism=FLAGS.slurm_array_parallelism,
        extra=FLAGS.slurm_extra)
    states = submit_sweep(FLAGS.sweep, FLAGS.root, executor, run_filter=FLAGS.runs,
                          job_states=lambda job_ids: slurm_job_states(FLAGS.root, job_ids),
                          wait=FLAGS.wait)
  else:
    states = run_sweep(FLAGS.sweep, FLAGS.root, parallel=FLAGS.parallel, run_filter=FLAGS.runs)
  counts = {s: sum(1 for v in states.values() if v == s) for s in STATES}
  done = "submitted" if slurm and not FLAGS.wait else "done"
  print(f"sweep {done}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
  if counts[FAILED] or counts[BLOCKED] or counts[INTERRUPTED]:
    sys.exit(1)


if __name__ == "__main__":
  # Run through the imported module so that the Sweep/Group classes the spec file imports are
  # the very classes this code checks against (``python -m`` loads this file as __main__).
  from lra_sparse import sweep as _sweep_module  # pylint: disable=g-import-not-at-top
  _sweep_module.define_flags()
  cli.run(_sweep_module.main)
