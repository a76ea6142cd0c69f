r"""Runs a sweep of training runs: one subprocess (or SLURM job) per run, skipping finished ones.

``python -m lra_sparse.sweep --sweep=experiments/specs/<spec>.py[:preset] --root=ROOT`` (see
``__main__``). A spec file builds its sweep from the names exported here
(``from lra_sparse.sweep import Group, Sweep``). The modules:

- ``spec``: the spec types (:class:`Sweep`, :class:`Group`, :class:`Variant`, :class:`Ref`)
  and their expansion into named runs (:class:`RunPlan`, :func:`expand_sweep`);
- ``state``: each run's state (finished, running, failed, ...), read from its workdir, the
  error file a failed run gets and the sweep root's manifest;
- ``local``: the local executor (subprocesses, one per GPU with ``--parallel=gpus``);
- ``slurm``: the SLURM executor (a job array through submitit);
- ``__main__``: the command line.

A run is finished iff ``<workdir>/result.json`` exists; re-running a sweep skips finished runs
and launches the others with the same workdir (the trainer resumes from its last checkpoint).
A run that exits non-zero (or exits without result.json) gets ``<workdir>/sweep_error.txt``
(return code, command, the tail of its log) and the sweep moves on: the run is ``failed``, or
``interrupted`` when the trainer was stopped by Ctrl-C (exit code 130, its checkpoint saved;
tables count it unfinished). Both are launched again by the next call. See WORKSPACE.md for
the layout of the sweep root.
"""
from lra_sparse.sweep.local import GPU_ENV_VAR, Launcher, detect_gpus, run_sweep
from lra_sparse.sweep.slurm import (JOB_POLL_SECONDS, SUBMITIT_DIR, recorded_jobs,
                                    slurm_executor, slurm_job_states, submit_sweep)
# Pickles of jobs queued before this module became a package name lra_sparse.sweep._JobCommand.
from lra_sparse.sweep.slurm import _JobCommand  # pylint: disable=unused-import
from lra_sparse.sweep.spec import (DEFAULT_MAIN, Group, Ref, RunPlan, Sweep, Variant,
                                   expand_sweep, format_flag_value, format_name_value,
                                   load_sweep, validate_run_overrides)
from lra_sparse.sweep.state import (BLOCKED, FAILED, FINISHED, INTERRUPTED, PENDING, QUEUED,
                                    RUNNING, STATES, all_states, describe_runs, error_summary,
                                    read_manifest_outcomes, run_state, with_job_state,
                                    write_manifest)

__all__ = ["GPU_ENV_VAR", "Launcher", "detect_gpus", "run_sweep", "JOB_POLL_SECONDS",
           "SUBMITIT_DIR", "recorded_jobs", "slurm_executor", "slurm_job_states",
           "submit_sweep", "DEFAULT_MAIN", "Group", "Ref", "RunPlan", "Sweep", "Variant",
           "expand_sweep", "format_flag_value", "format_name_value", "load_sweep",
           "validate_run_overrides", "BLOCKED", "FAILED", "FINISHED", "INTERRUPTED", "PENDING",
           "QUEUED", "RUNNING", "STATES", "all_states", "describe_runs", "error_summary",
           "read_manifest_outcomes", "run_state", "with_job_state", "write_manifest"]
