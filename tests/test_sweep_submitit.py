"""The sweep runner's SLURM executor (submitit): real jobs through submitit's LocalExecutor
(subprocesses, no SLURM), the queue states it reads, the dependency waves of --wait, the SLURM
parameters it passes, and its one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

submitit = pytest.importorskip("submitit")

from lra_sparse import sweep as sweep_lib  # noqa: E402
from lra_sparse.sweep import slurm as sweep_slurm  # noqa: E402
from lra_sparse import tables  # noqa: E402
from test_sweep_tables import (EXPECTED_NAMES, REPO, TABLE_SPEC,  # noqa: E402
                               sweep_spec)  # noqa: F401  (a fixture)

PRE = EXPECTED_NAMES[:2]          # the sweep's two pretrain runs, which depend on nothing


def _runs(spec, root):
  return sweep_lib.expand_sweep(sweep_lib.load_sweep(f"{spec}:tiny"), str(root))


def _status(spec, root, jobs=None):
  """--status's lines, run name -> the line's words."""
  lines = sweep_lib.describe_runs(_runs(spec, root), show_overrides=False, jobs=jobs)
  return {line.split()[1]: line.split() for line in lines.splitlines()[:-1]}


def test_local_jobs_resume_record_failures_and_skip_finished(sweep_spec, tmp_path,  # noqa: F811
                                                             monkeypatch):
  """Two runs become two jobs: the interrupted one resumes in its workdir, the failing one gets
  sweep_error.txt from its own job; the next submission resubmits only the failed run, the one
  after that nothing; --status and the table read the workdirs."""
  spec, launcher = sweep_spec
  root = tmp_path / "root"
  interrupted = root / PRE[0]
  (interrupted / "checkpoints").mkdir(parents=True)
  (interrupted / "sweep_error.txt").write_text("return code -9\n")
  executor = submitit.LocalExecutor(folder=str(root / sweep_lib.SUBMITIT_DIR))
  executor.update_parameters(timeout_min=5)
  submitted = []
  submit = executor.submit
  monkeypatch.setattr(executor, "submit", lambda fn: submitted.append(fn.workdir) or submit(fn))

  def submit_pre():
    submitted.clear()
    return sweep_lib.submit_sweep(f"{spec}:tiny", str(root), executor, run_filter="^pre__",
                                  wait=True, poll_seconds=0.05,
                                  main_command=launcher.main_command)

  monkeypatch.setenv("FAKE_FAIL", "1")
  states = submit_pre()
  assert [states[name] for name in PRE] == ["finished", "failed"]
  assert all(states[name] == ("blocked" if name.endswith("seed=1") else "pending")
             for name in EXPECTED_NAMES[2:])         # not selected; seed 1's pretrain failed
  assert submitted == [str(root / name) for name in PRE]
  assert json.loads((interrupted / "result.json").read_text())["resumed"] is True
  assert not (interrupted / "sweep_error.txt").exists()
  error = (root / PRE[1] / "sweep_error.txt").read_text()
  assert error.startswith("return code 1\n") and "boom for seed 1" in error
  assert "sweep job" in (root / PRE[1] / "sweep_run.log").read_text()
  manifest = {r["name"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
  assert [manifest[name]["returncode"] for name in PRE] == [0, 1]
  assert all(manifest[name]["job_id"] for name in PRE)
  assert [_status(spec, root)[name][0] for name in PRE] == ["finished", "failed"]

  monkeypatch.delenv("FAKE_FAIL")
  states = submit_pre()
  assert submitted == [str(root / PRE[1])]
  assert [states[name] for name in PRE] == ["finished", "finished"]
  assert [_status(spec, root)[name][0] for name in PRE] == ["finished", "finished"]
  table_spec = tmp_path / "table_spec.py"
  table_spec.write_text(TABLE_SPEC)
  table = tables.make_table(str(root), str(table_spec), "markdown",
                            report=tables.Reporter(echo=False))
  assert "| Dense | 50.00 ± 0.00 (n=2) |" in table

  states = submit_pre()
  assert submitted == [] and [states[name] for name in PRE] == ["finished", "finished"]


class FakeJob:
  """A submitit job that ends when first polled: its run finishes, or, when ``killed``, the job
  ends as SLURM's TIMEOUT before the trainer exits (no result, no error file)."""

  def __init__(self, job_id, workdir, killed):
    self.job_id, self.workdir, self.killed = job_id, workdir, killed

  def done(self):
    if not self.killed:
      with open(os.path.join(self.workdir, "result.json"), "w") as f:
        json.dump({"step": 5, "test": {"accuracy": 0.5}}, f)
    return True

  @property
  def state(self):
    return "TIMEOUT" if self.killed else "COMPLETED"

  def exception(self):
    return RuntimeError("timed out") if self.killed else None

  def result(self):
    return 0


class FakeExecutor:
  """Records the runs of each job array; job ids are ``<array>_<index>`` as on SLURM."""

  def __init__(self, kill=()):
    self.arrays, self.kill = [], set(kill)

  @contextlib.contextmanager
  def batch(self):
    self.arrays.append([])
    yield

  def submit(self, fn):
    name = os.path.basename(fn.workdir)
    assert f"--workdir={fn.workdir}" in fn.command
    self.arrays[-1].append(name)
    return FakeJob(f"{100 + len(self.arrays)}_{len(self.arrays[-1]) - 1}", fn.workdir,
                   name in self.kill)


def test_queued_jobs_are_not_submitted_again_and_status_shows_the_queue(sweep_spec,  # noqa: F811
                                                                        tmp_path):
  """Without --wait: the ready runs go out as one array and the call returns; a run whose job
  is still in the queue is not submitted again, one whose job died is, and the fine-tuning
  runs go out once their pretrain run has finished."""
  spec, _ = sweep_spec
  root = tmp_path / "root"
  executor = FakeExecutor()
  queue = {}                              # job id -> its state, as sacct would report it

  def queue_states(job_ids):
    return {name: queue[job_id] for name, job_id in job_ids.items()}

  def submit():
    return sweep_lib.submit_sweep(f"{spec}:tiny", str(root), executor, main_command=["main"],
                                  job_states=queue_states)

  def status():
    jobs = sweep_lib.recorded_jobs(_runs(spec, root), sweep_lib.read_manifest_outcomes(
        str(root), "synthetic"), queue_states)
    return _status(spec, root, jobs)

  states = submit()
  assert executor.arrays == [PRE]
  assert [states[name] for name in EXPECTED_NAMES] == ["queued"] * 2 + ["pending"] * 8
  manifest = {r["name"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
  assert [manifest[name]["job_id"] for name in PRE] == ["101_0", "101_1"]
  queue.update({"101_0": "RUNNING", "101_1": "PENDING"})
  states = submit()
  assert executor.arrays == [PRE]
  assert [states[name] for name in PRE] == ["running", "queued"]
  assert status()[PRE[1]] == ["queued", PRE[1], "job", "101_1", "PENDING"]
  # Seed 0 finishes; the job of seed 1 hits its time limit without writing anything.
  (root / PRE[0] / "result.json").write_text(json.dumps({"step": 5, "test": {"accuracy": 0.5}}))
  queue.update({"101_0": "COMPLETED", "101_1": "TIMEOUT"})
  assert status()[PRE[1]] == ["failed", PRE[1], "job", "101_1", "TIMEOUT"]
  states = submit()
  seed0_ft = [name for name in EXPECTED_NAMES[2:] if name.endswith("seed=0")]
  assert executor.arrays == [PRE, [PRE[1]] + seed0_ft]
  assert states[PRE[0]] == "finished"
  assert all(states[name] == "queued" for name in [PRE[1]] + seed0_ft)
  assert all(states[name] == "pending" for name in EXPECTED_NAMES[2:] if name.endswith("seed=1"))


def test_wait_submits_dependents_as_dependencies_finish(sweep_spec, tmp_path):  # noqa: F811
  """--wait: a second array follows once the pretrain runs end; a job killed by SLURM gets the
  run's sweep_error.txt written by the runner, and its dependents are blocked."""
  spec, _ = sweep_spec
  root = tmp_path / "root"
  executor = FakeExecutor(kill=[PRE[1]])
  states = sweep_lib.submit_sweep(f"{spec}:tiny", str(root), executor, wait=True,
                                  poll_seconds=0, main_command=["main"])
  seed0 = [name for name in EXPECTED_NAMES[2:] if name.endswith("seed=0")]
  assert executor.arrays == [PRE, seed0]
  assert {name: state for name, state in states.items() if state != "finished"} == {
      PRE[1]: "failed", **{name: "blocked" for name in EXPECTED_NAMES[2:] if name not in seed0}}
  error = (root / PRE[1] / "sweep_error.txt").read_text()
  assert error.startswith("job 101_1 ended (TIMEOUT) before the trainer exited\n")
  manifest = {r["name"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
  assert manifest[PRE[1]]["job_state"] == "TIMEOUT" and manifest[PRE[1]]["returncode"] is None
  assert manifest[seed0[0]]["job_id"] == "102_0" and manifest[seed0[0]]["returncode"] == 0


def test_slurm_executor_gets_the_parameters(tmp_path, monkeypatch):
  """The flags reach submitit's update_parameters; bad values are one clear error each; the
  queue is read only where SLURM's sacct exists."""
  calls = {}

  class FakeAutoExecutor:
    def __init__(self, folder, cluster):
      calls["init"] = (folder, cluster)

    def update_parameters(self, **params):
      calls["params"] = params

  monkeypatch.setattr(sweep_slurm.shutil, "which", lambda name: "/usr/bin/" + name)
  monkeypatch.setattr(submitit, "AutoExecutor", FakeAutoExecutor)
  sweep_lib.slurm_executor(str(tmp_path), partition="gpu", time_min=90, gpus_per_node=2,
                           cpus_per_task=8, mem_gb=64, array_parallelism=4,
                           extra="account=lab, qos=high")
  assert calls["init"] == (os.path.join(str(tmp_path), "_submitit"), "slurm")
  assert calls["params"] == dict(timeout_min=90, gpus_per_node=2, nodes=1, tasks_per_node=1,
                                 name="lra_sparse", slurm_array_parallelism=4,
                                 slurm_partition="gpu", cpus_per_task=8, mem_gb=64,
                                 slurm_additional_parameters={"account": "lab", "qos": "high"})
  for kwargs, message in ((dict(time_min=-5), "slurm_time_min must be > 0"),
                          (dict(mem_gb=-1), "must be >= 0"),
                          (dict(array_parallelism=0), "slurm_array_parallelism must be >= 1"),
                          (dict(extra="account"), "expected key=value items")):
    with pytest.raises(ValueError, match=message):
      sweep_lib.slurm_executor(str(tmp_path), **kwargs)

  class FakeSlurmJob:
    def __init__(self, folder, job_id):
      self.state = {"7_0": "PENDING", "7_1": "CANCELLED by 42"}[job_id]

  monkeypatch.setattr(submitit, "SlurmJob", FakeSlurmJob)
  assert sweep_lib.slurm_job_states(str(tmp_path), {"a": "7_0", "b": "7_1"}) == {
      "a": "PENDING", "b": "CANCELLED"}
  monkeypatch.setattr(sweep_slurm.shutil, "which", lambda name: None)
  assert sweep_lib.slurm_job_states(str(tmp_path), {"a": "7_0"}) == {}
  with pytest.raises(ValueError, match=r"no sbatch or srun on PATH"):
    sweep_lib.slurm_executor(str(tmp_path))


def test_slurm_cli_errors_are_one_line_and_status_needs_no_slurm(sweep_spec, tmp_path):  # noqa: F811
  """Without SLURM, or with bad flags, the CLI exits with one line and no traceback; --status
  with --executor=slurm still lists the workdir states."""
  spec, _ = sweep_spec
  env = dict(os.environ, PATH=os.path.dirname(sys.executable))  # no sbatch, srun or sacct

  def sweep(*flags):
    return subprocess.run([sys.executable, "-m", "lra_sparse.sweep", f"--sweep={spec}:tiny",
                           f"--root={tmp_path / 'root'}", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)

  for flags, message in ((["--executor=slurm"], "no sbatch or srun on PATH"),
                         (["--executor=slurm", "--parallel=gpus"], "SLURM places them"),
                         (["--executor=slurm", "--slurm_time_min=-5"], "must be > 0, got -5"),
                         (["--wait"], "--wait needs --executor=slurm")):
    proc = sweep(*flags)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"error: {proc.stderr[7:].strip()}"], proc.stderr
    assert message in proc.stderr
  proc = sweep("--executor=slurm", "--status")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[-1] == "10 runs: 10 pending"
