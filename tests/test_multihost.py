"""Multi-process runs (``lra_sparse.distributed``): two local processes with one CPU device each
train exactly as one process with two devices, and write the workdir's files once."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from lra_sparse import distributed
from lra_sparse import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _command(workdir, listops_dir, *extra):
  return [sys.executable, "-m", "lra_sparse.main", "--config=configs/listops.py:tiny",
          f"--workdir={workdir}", f"--config.data.data_dir={listops_dir}",
          "--config.data.max_length=128", "--config.model.num_layers=1",
          "--config.batch_size=8", "--config.num_train_steps=6", "--config.log_every_steps=1",
          "--config.eval_every_steps=3", "--config.checkpoint_every_steps=3",
          "--config.num_eval_batches=2", *extra]


def _env(devices: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  for name in [name for name in env if name.startswith("SLURM_")]:
    del env[name]
  return env


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_two_processes_train_as_one_process_with_two_devices(tmp_path, listops_dir):
  one = tmp_path / "one"
  single = subprocess.Popen(_command(one, listops_dir), cwd=REPO, env=_env(2),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  two = tmp_path / "two"
  port = _free_port()
  procs = [subprocess.Popen(
      _command(two, listops_dir, f"--coordinator_address=localhost:{port}",
               "--num_processes=2", f"--process_id={i}"),
      cwd=REPO, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=240) for p in [single, *procs]]
  for p, (_, err) in zip([single, *procs], outs):
    assert p.returncode == 0, err[-3000:]
  # Process 0 alone reports the result.
  assert "test accuracy" in outs[1][0] and "test accuracy" not in outs[2][0]

  reference, records = _records(one), _records(two)
  assert [(r["step"], r["split"]) for r in records] == \
      [(r["step"], r["split"]) for r in reference]           # every record once, none twice
  train = lambda recs: [r for r in recs if r["split"] == "train"]
  assert [r["step"] for r in train(records)] == [1, 2, 3, 4, 5, 6]
  for key in ("loss", "accuracy", "grad_norm"):
    np.testing.assert_allclose([r[key] for r in train(records)],
                               [r[key] for r in train(reference)], rtol=1e-5, atol=1e-6)
  for split in ("val", "test"):
    np.testing.assert_allclose([r["loss"] for r in records if r["split"] == split],
                               [r["loss"] for r in reference if r["split"] == split],
                               rtol=1e-5)
  result = json.loads((two / "result.json").read_text())
  assert result["step"] == 6
  assert result["test"]["loss"] == pytest.approx(
      json.loads((one / "result.json").read_text())["test"]["loss"], rel=1e-5)
  assert sorted(os.listdir(two / "checkpoints")) == ["3", "6"]
  assert len([name for name in os.listdir(two) if name.startswith("events.out")]) == 1
  assert json.loads((two / "config.json").read_text())["batch_size"] == 8


def test_two_processes_refuse_a_busy_workdir_together(tmp_path, listops_dir):
  """Process 0 takes the workdir's lock for the run; when another run holds it, process 0
  names the holder and process 1 refuses with it, before either writes anything."""
  workdir = tmp_path / "run"
  port = _free_port()
  with workdir_lib.locked(str(workdir)):
    procs = [subprocess.Popen(
        _command(workdir, listops_dir, f"--coordinator_address=localhost:{port}",
                 "--num_processes=2", f"--process_id={i}"),
        cwd=REPO, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
  assert [p.returncode for p in procs] == [1, 1]
  last = [err.strip().splitlines()[-1] for err in errors]
  assert last[0].startswith(f"error: workdir {workdir} is in use by pid {os.getpid()}")
  assert last[1] == (f"error: workdir {workdir} is in use by another run (process 0 could not "
                     "take its run.lock); wait for it or use another directory")
  assert sorted(os.listdir(workdir)) == ["run.lock"]


@pytest.mark.parametrize("args, message", [
    (["--num_processes=2", "--process_id=0"],
     "error: --coordinator_address missing: a multi-process run needs all of "
     "--coordinator_address, --num_processes, --process_id (or none, for one process or SLURM)"),
    (["--coordinator_address=localhost:1234", "--num_processes=2", "--process_id=2"],
     "error: --process_id=2 must be in 0..1 (--num_processes=2)"),
    (["--coordinator_address=localhost", "--num_processes=2", "--process_id=0"],
     "error: --coordinator_address='localhost' must be HOST:PORT (the address of process 0 "
     "and a free port, e.g. localhost:12345)"),
])
def test_bad_process_flags_get_one_clear_error(tmp_path, args, message):
  start = time.time()
  proc = subprocess.run(_command(tmp_path / "run", "data/absent", *args), cwd=REPO,
                        env=_env(1), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [message]
  assert not (tmp_path / "run").exists()
  assert time.time() - start < 60


@pytest.mark.parametrize("flags, environ, want", [
    ((None, None, None), {}, distributed.Setup("single")),
    (("h:1", 4, 3), {}, distributed.Setup("flags", "h:1", 4, 3)),
    # srun with 4 tasks: jax reads SLURM's variables itself.
    ((None, None, None), {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]",
                          "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"},
     distributed.Setup("slurm", None, 4, 2)),
    # One task, or a plain python in an N-task batch script (no srun step): one process.
    ((None, None, None), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"},
     distributed.Setup("single")),
    ((None, None, None), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"},
     distributed.Setup("single")),
    # Explicit flags win over SLURM.
    (("h:1", 2, 1), {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "4",
                     "SLURM_PROCID": "2", "SLURM_LOCALID": "0"},
     distributed.Setup("flags", "h:1", 2, 1)),
])
def test_decide(flags, environ, want):
  assert distributed.decide(*flags, environ=environ) == want
  assert (want.initialize_kwargs() is None) == (want.source == "single")


@pytest.mark.parametrize("flags, environ, message", [
    (("h:1", None, 0), {}, "--num_processes missing"),
    (("h:1", 0, 0), {}, "--num_processes=0 must be at least 1"),
    (("h:1", 2, -1), {}, r"--process_id=-1 must be in 0..1"),
    (("h:99999", 2, 0), {}, "must be HOST:PORT"),
    ((None, None, None), {"SLURM_NTASKS": "four"}, "SLURM_NTASKS='four' is not an integer"),
    ((None, None, None), {"SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2",
                          "SLURM_PROCID": "0"}, "SLURM_JOB_ID, SLURM_LOCALID unset"),
    ((None, None, None), {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1",
                          "SLURM_NTASKS": "2", "SLURM_PROCID": "5", "SLURM_LOCALID": "0"},
     r"SLURM_PROCID=5 is not in 0..1"),
])
def test_decide_refuses_bad_values(flags, environ, message):
  with pytest.raises(ValueError, match=message):
    distributed.decide(*flags, environ=environ)
