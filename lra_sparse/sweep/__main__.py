"""The sweep runner's command line.

Usage (from the repository root)::

  python -m lra_sparse.sweep --sweep=experiments/specs/dfss_table4.py --root=runs/dfss_table4
  python -m lra_sparse.sweep --sweep=experiments/specs/dfss_table4.py:tiny --root=runs/t4 --dry_run
  python -m lra_sparse.sweep --sweep=experiments/specs/dfss_table4.py --root=runs/dfss_table4 \
      --status
  python -m lra_sparse.sweep ... --parallel=gpus     # one run per local GPU at a time
  python -m lra_sparse.sweep ... --executor=slurm --slurm_partition=gpu   # one SLURM job per run

The sweep spec is loaded by path (``lra_sparse.sweep.spec``); the ``Sweep`` and ``Group`` classes
it imports from ``lra_sparse.sweep`` are the ones checked here, as this file is not the module
that defines them. User errors are one line ``error: ...`` (``lra_sparse.cli``).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Sequence

from absl import app
from absl import flags

from lra_sparse import cli
from lra_sparse.sweep.local import run_sweep
from lra_sparse.sweep.slurm import (recorded_jobs, slurm_executor, slurm_job_states,
                                    submit_sweep)
from lra_sparse.sweep.spec import expand_sweep, load_sweep
from lra_sparse.sweep.state import (BLOCKED, FAILED, INTERRUPTED, STATES, describe_runs,
                                    read_manifest_outcomes)

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a program: importing this module adds no flags."""
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


def _terminated(signum, frame):
  del signum, frame
  raise KeyboardInterrupt("SIGTERM")


def take_interrupts() -> None:
  """Ctrl-C and SIGTERM stop the local sweep: its trainers save and stop, nothing new starts.

  A sweep started in the background by a script (``cmd &`` without job control) inherits
  SIGINT ignored, and Python keeps it ignored: a Ctrl-C then stopped only the trainers, and
  the sweep went on to launch the next run its --runs matched. SIGTERM (``timeout``, a batch
  system's end of job) takes the same path, so its trainers save their checkpoints too.
  """
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGTERM, _terminated)


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
    take_interrupts()
    states = run_sweep(FLAGS.sweep, FLAGS.root, parallel=FLAGS.parallel, run_filter=FLAGS.runs)
  counts = {s: sum(1 for v in states.values() if v == s) for s in STATES}
  done = "submitted" if slurm and not FLAGS.wait else "done"
  print(f"sweep {done}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
  if counts[FAILED] or counts[BLOCKED] or counts[INTERRUPTED]:
    sys.exit(1)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
