"""The sweep runner's SLURM executor (submitit): real jobs through submitit's LocalExecutor
(subprocesses, no SLURM), the SLURM parameters it passes, and its one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

submitit = pytest.importorskip("submitit")

from lra_sparse import sweep as sweep_lib  # noqa: E402
from test_sweep_tables import EXPECTED_NAMES, sweep_spec  # noqa: E402,F401  (fixture)


def _local_launcher(tmp_path, launcher):
  executor = submitit.LocalExecutor(folder=str(tmp_path / "_submitit"))
  executor.update_parameters(timeout_min=5)
  return sweep_lib.SubmititLauncher(executor, launcher.main_command)


def test_jobs_run_the_sweep_skip_finished_and_record_failures(sweep_spec, tmp_path,  # noqa: F811
                                                             monkeypatch):
  """Every run becomes one job; its output lands in the run's log; a failing job is recorded
  and its dependents blocked; a second submission submits only what is not finished."""
  spec, launcher = sweep_spec
  root = tmp_path / "root"
  monkeypatch.setenv("FAKE_FAIL", "1")
  jobs = _local_launcher(tmp_path, launcher)
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), launcher=jobs, max_jobs=4,
                               poll_seconds=0.05, show_progress=False)
  failed = [name for name, state in states.items() if state == "failed"]
  blocked = [name for name, state in states.items() if state == "blocked"]
  assert len(failed) == 1 and failed[0].startswith("pre") and failed[0].endswith("seed=1")
  assert blocked and all("seed=1" in name for name in blocked)
  finished = [name for name, state in states.items() if state == "finished"]
  assert len(finished) == len(EXPECTED_NAMES) - 1 - len(blocked)
  error = (root / failed[0] / "sweep_error.txt").read_text()
  assert "return code 1" in error and "boom for seed 1" in error   # the job's output, in the log
  assert not any((root / name / "running.json").exists() for name in EXPECTED_NAMES)
  # Again, without the failure: only the failed and blocked runs are submitted.
  monkeypatch.delenv("FAKE_FAIL")
  submitted = []
  submit = jobs.executor.submit
  monkeypatch.setattr(jobs.executor, "submit",
                      lambda fn: submitted.append(fn.command) or submit(fn))
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), launcher=jobs, max_jobs=4,
                               poll_seconds=0.05, show_progress=False)
  assert set(states.values()) == {"finished"}
  names = sorted(os.path.basename(next(a for a in c if a.startswith("--workdir="))[10:])
                 for c in submitted)
  assert names == sorted(failed + blocked)
  manifest = json.loads((root / "sweep.json").read_text())
  assert manifest["counts"]["finished"] == len(EXPECTED_NAMES)


def test_slurm_executor_gets_the_parameters(tmp_path, monkeypatch):
  """The flags reach submitit's update_parameters; bad values are one clear error each."""
  calls = {}

  class FakeExecutor:
    def __init__(self, folder, cluster):
      calls["init"] = (folder, cluster)

    def update_parameters(self, **params):
      calls["params"] = params

  monkeypatch.setattr(sweep_lib.shutil, "which", lambda name: "/usr/bin/" + name)
  monkeypatch.setattr(submitit, "AutoExecutor", FakeExecutor)
  sweep_lib.slurm_executor(str(tmp_path), partition="gpu", time_min=90, gpus_per_node=2,
                           cpus_per_task=8, mem_gb=64, extra="account=lab, qos=high")
  assert calls["init"] == (os.path.join(str(tmp_path), "_submitit"), "slurm")
  assert calls["params"] == dict(timeout_min=90, gpus_per_node=2, nodes=1, tasks_per_node=1,
                                 name="lra_sparse", slurm_partition="gpu", cpus_per_task=8,
                                 mem_gb=64,
                                 slurm_additional_parameters={"account": "lab", "qos": "high"})
  for kwargs, message in ((dict(time_min=0), "slurm_time_min must be > 0"),
                          (dict(mem_gb=-1), "must be >= 0"),
                          (dict(extra="account"), "expected key=value items")):
    with pytest.raises(ValueError, match=message):
      sweep_lib.slurm_executor(str(tmp_path), **kwargs)
  monkeypatch.setattr(sweep_lib.shutil, "which", lambda name: None)
  with pytest.raises(ValueError, match="no sbatch on PATH"):
    sweep_lib.slurm_executor(str(tmp_path))


def test_slurm_cli_errors_are_one_line(sweep_spec, tmp_path):  # noqa: F811
  """Without SLURM, or with --parallel=gpus, the CLI exits with one line and no traceback."""
  spec, _ = sweep_spec
  env = dict(os.environ, PATH=os.path.dirname(sys.executable))  # no sbatch
  for extra, message in (([], "no sbatch on PATH"), (["--parallel=gpus"], "SLURM places them")):
    proc = subprocess.run([sys.executable, "-m", "lra_sparse.sweep", f"--sweep={spec}:tiny",
                           f"--root={tmp_path / 'root'}", "--executor=slurm", *extra],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
