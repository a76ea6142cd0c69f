"""Run directories that cannot be corrupted, and errors a user can read.

Workdir lock, resume config check, no non-finite checkpoints, restore fallback, Ctrl-C and
kill -9 (real subprocesses), one-line CLI errors, the metrics log, the sweep's liveness check.
"""
from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lra_sparse import sweep as sweep_lib
from lra_sparse.sweep import state as sweep_state
from lra_sparse import train
from lra_sparse import workdir as workdir_lib
from lra_sparse.errors import TrainingDiverged, TrainingInterrupted, WorkdirBusy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tiny_config, workdir, **overrides):
  return train.train_and_evaluate(tiny_config(**overrides), str(workdir))


def _records(workdir, split=None):
  records = [record for _, record in workdir_lib.read_metrics(str(workdir))]
  return [r for r in records if split is None or r["split"] == split]


def _steps(workdir):
  return sorted(int(name) for name in os.listdir(os.path.join(workdir, "checkpoints"))
                if name.isdigit())


# ----------------------------------------------------------------------------- resume check
def test_resume_with_another_config_is_refused_before_the_workdir_changes(tmp_path,
                                                                          tiny_config):
  workdir = tmp_path / "run"
  _run(tiny_config, workdir, num_train_steps=10)
  config_json = (workdir / "config.json").read_bytes()
  result_json = (workdir / "result.json").read_bytes()
  metrics = (workdir / "metrics.jsonl").read_bytes()
  for overrides, field in [({"attention.kind": "dfss"}, "attention.kind: 'dense' -> 'dfss'"),
                           ({"model.mlp_dim": 128}, "model.mlp_dim: 64 -> 128"),
                           ({"optim.learning_rate": 0.1}, "optim.learning_rate: 0.05 -> 0.1")]:
    with pytest.raises(ValueError, match="holds a run with another config .*" + field):
      _run(tiny_config, workdir, num_train_steps=10, **overrides)
    assert (workdir / "config.json").read_bytes() == config_json
    assert (workdir / "result.json").read_bytes() == result_json
    assert (workdir / "metrics.jsonl").read_bytes() == metrics
  with pytest.raises(ValueError, match="checkpoint at step 10, beyond "
                                       "config.num_train_steps=5"):
    _run(tiny_config, workdir, num_train_steps=5)
  assert (workdir / "config.json").read_bytes() == config_json
  # Step counts and intervals may change: the run trains on, and says what changed.
  result = _run(tiny_config, workdir, num_train_steps=20, log_every_steps=2)
  assert result["step"] == 20
  assert json.loads((workdir / "config.json").read_text())["num_train_steps"] == 20
  assert [r["step"] for r in _records(workdir, "resume")] == [10]
  assert [r["step"] for r in _records(workdir, "train")][-5:] == [12, 14, 16, 18, 20]


# ----------------------------------------------------------------------------- lock
_HOLD_LOCK = """
import sys, time
from lra_sparse import workdir
with workdir.locked(*sys.argv[1:]):
  print("locked", flush=True)
  time.sleep(600)
"""


def test_workdir_lock_names_its_holder_and_a_dead_holder_is_taken_over(tmp_path, tiny_config):
  workdir = tmp_path / "run"
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(workdir)],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    assert workdir_lib.lock_holder(str(workdir))["pid"] == holder.pid
    with pytest.raises(WorkdirBusy, match=f"in use by pid {holder.pid} on "):
      _run(tiny_config, workdir, num_train_steps=5)
    assert not (workdir / "config.json").exists() and not (workdir / "checkpoints").exists()
  finally:
    holder.kill()                     # kill -9: the kernel drops the lock with the process
    holder.wait()
  assert workdir_lib.lock_holder(str(workdir)) is None
  assert _run(tiny_config, workdir, num_train_steps=5)["step"] == 5
  assert workdir_lib.lock_holder(str(workdir)) is None


def test_a_second_sweep_on_a_root_is_refused(tmp_path):
  root = tmp_path / "root"
  spec = tmp_path / "spec.py"
  config = os.path.join(REPO, "configs", "listops.py")
  spec.write_text("from lra_sparse.sweep import Group, Sweep\n"
                  "def get_sweep(preset=''):\n"
                  f"  return Sweep('s', [Group(config={config!r})])\n")
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(root), "sweep.lock"],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(WorkdirBusy, match=f"sweep root {root} is in use by pid {holder.pid}"):
      sweep_lib.run_sweep(str(spec), str(root), show_progress=False)
    assert os.listdir(root) == ["sweep.lock"]      # nothing launched, no manifest written
  finally:
    holder.kill()
    holder.wait()


# ----------------------------------------------------------------------------- finiteness
def _poison_after(step_number, monkeypatch):
  """Train steps whose parameters and loss turn NaN once the state passes ``step_number``."""
  real = train.make_train_step

  def poisoned(model, grad_accum_steps=1, *objective):
    step_fn = real(model, grad_accum_steps, *objective)

    def step(state, batch, rng):
      state, metrics = step_fn(state, batch, rng)
      bad = state.step > step_number
      params = jax.tree.map(lambda p: jnp.where(bad, jnp.nan, p), state.params)
      metrics = dict(metrics, loss=jnp.where(bad, jnp.nan, metrics["loss"]))
      return state.replace(params=params), metrics
    return step
  monkeypatch.setattr(train, "make_train_step", poisoned)


def test_non_finite_weights_are_never_checkpointed(tmp_path, tiny_config, monkeypatch):
  workdir = tmp_path / "run"
  _poison_after(12, monkeypatch)
  with pytest.raises(TrainingDiverged, match="between steps 11 and 15; nothing non-finite was "
                                             "checkpointed, the last finite checkpoint is step "
                                             "10"):
    _run(tiny_config, workdir, checkpoint_every_steps=5, log_every_steps=30)
  assert _steps(workdir) == [5, 10]
  assert not (workdir / "result.json").exists()
  monkeypatch.undo()                  # a sane run resumes from the last finite checkpoint
  result = _run(tiny_config, workdir, checkpoint_every_steps=5, log_every_steps=30)
  assert result["step"] == 30 and np.isfinite(result["test"]["loss"])
  reference = _run(tiny_config, tmp_path / "clean", checkpoint_every_steps=5,
                   log_every_steps=30)
  np.testing.assert_allclose(result["test"]["loss"], reference["test"]["loss"], rtol=1e-5)


def _ctrl_c_inside_train_step_call(monkeypatch, number: int):
  """A Ctrl-C inside the ``number``-th train step's call, before it returns."""
  real_in_mesh, calls = train.in_mesh, []

  def in_mesh(step, mesh):
    real = real_in_mesh(step, mesh)

    def call(*args):
      out = real(*args)
      if len(args) == 3:                   # the train step (state, batch, rng)
        calls.append(1)
        if len(calls) == number:
          os.kill(os.getpid(), signal.SIGINT)
      return out
    return call
  monkeypatch.setattr(train, "in_mesh", in_mesh)


def test_ctrl_c_inside_a_train_step_call_still_checkpoints_the_step_reached(
    tmp_path, tiny_config, monkeypatch, request):
  """The train step donates its input state: a Ctrl-C delivered inside the call (where the
  loop spends its time once the device queue is full) used to land after the input was
  consumed and before the output was bound, so nothing could be saved and every step since
  the last checkpoint was lost (a Pathfinder-32 fine-tune lost 1,074 steps that way)."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
  _ctrl_c_inside_train_step_call(monkeypatch, 7)
  workdir = tmp_path / "run"
  with pytest.raises(TrainingInterrupted, match="interrupted at step 7; saved a checkpoint at "
                                                "step 7;"):
    _run(tiny_config, workdir, checkpoint_every_steps=100, log_every_steps=5)
  assert _steps(workdir) == [7]
  monkeypatch.undo()
  result = _run(tiny_config, workdir, checkpoint_every_steps=100, log_every_steps=5)
  assert result["step"] == 30


def test_a_second_ctrl_c_as_the_first_is_handled_cuts_nothing(
    tmp_path, tiny_config, monkeypatch, request):
  """A sweep forwards its own Ctrl-C to its trainers, so at a device call's deadline a trainer
  gets two, milliseconds apart. The second used to raise a new KeyboardInterrupt where it
  landed; landing as the trainer entered its interrupt handler, before that handler ignored
  SIGINT, it escaped the save ("interrupted" and nothing saved: a Pathfinder-32 run lost 950
  steps). Here the first lands inside a train step's call, the second just as the handler
  starts; the step reached is still saved, and the run resumes from it."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
  real_deferred = train.sigint_deferred
  _ctrl_c_inside_train_step_call(monkeypatch, 7)      # the first Ctrl-C

  def deferred_after_a_second_ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)    # the forwarded copy, as the handler starts
    for _ in range(10_000):                # the handler runs at a bytecode boundary: in here
      pass
    return real_deferred()
  monkeypatch.setattr(train, "sigint_deferred", deferred_after_a_second_ctrl_c)
  workdir = tmp_path / "run"
  with pytest.raises((TrainingInterrupted, KeyboardInterrupt)) as stopped:
    _run(tiny_config, workdir, checkpoint_every_steps=100, log_every_steps=5)
  assert stopped.type is TrainingInterrupted, "the second Ctrl-C escaped the save"
  assert "interrupted at step 7; saved a checkpoint at step 7;" in str(stopped.value)
  assert _steps(workdir) == [7]
  monkeypatch.undo()
  result = _run(tiny_config, workdir, checkpoint_every_steps=100, log_every_steps=5)
  assert result["step"] == 30


def test_ctrl_c_inside_the_check_before_a_save_waits_for_the_save(
    tmp_path, tiny_config, monkeypatch, request):
  """The finiteness check before a save compiles on its first call; a Ctrl-C landing inside
  JAX's tracing there could leave it unusable for the interrupt's own save. The check and the
  save take a Ctrl-C only once both are done: the step is saved by the scheduled save."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
  real_all_finite = train.all_finite

  def interrupted_check(tree):
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10_000):     # the handler runs at a bytecode boundary: in here
      pass
    return real_all_finite(tree)
  monkeypatch.setattr(train, "all_finite", interrupted_check)
  workdir = tmp_path / "run"
  with pytest.raises(TrainingInterrupted, match="interrupted at step 10; its checkpoint at "
                                                "step 10 is kept;"):
    _run(tiny_config, workdir, checkpoint_every_steps=10, log_every_steps=5)
  assert _steps(workdir) == [10]


def test_an_error_in_the_save_on_interrupt_is_said_not_raised(tiny_config):
  """A save in flight that fails as Ctrl-C stops the run (or a JAX call that fails there) is
  named in the interrupt's message: the run stops as interrupted, keeping what it has, instead
  of ending as a crash that a sweep records as failed."""
  from lra_sparse.checkpointing import save_on_interrupt  # pylint: disable=import-outside-toplevel

  class FailedSave:
    def wait_until_finished(self):
      raise OSError("No space left on device")

  state = {"step": jnp.array(7), "params": {"w": jnp.ones(3)}}
  assert save_on_interrupt(FailedSave(), state, jnp.array(True), 5) == (
      None, "checkpoints up to step 5 are kept (the save on interrupt failed: OSError: No "
      "space left on device)")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed one
def test_ctrl_c_swallowed_by_a_gc_callback_still_stops_the_run_at_the_next_step(
    tmp_path, tiny_config, monkeypatch, request):
  """Python swallows an exception raised inside a gc callback or a ``__del__`` ("Exception
  ignored in ..."). A Ctrl-C that landed in jax's ``_xla_gc_callback`` at a device call's
  deadline left a Pathfinder-32 run training until its sweep killed it 30 s later, losing the
  2,900 steps since its last checkpoint. The trainer latches the signal and stops at the next
  step with that step checkpointed."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
  armed, swallowed = [], []

  def interrupted_collection(phase, info):
    del info
    if phase == "start" and armed and not swallowed:
      swallowed.append(1)
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(10_000):     # the handler runs at a bytecode boundary: in here
        pass

  gc.callbacks.append(interrupted_collection)
  request.addfinalizer(lambda: gc.callbacks.remove(interrupted_collection))
  real_put, calls = train.put_global_batch, []

  def put_global_batch(batch, sharding):
    calls.append(1)
    if len(calls) == 7:           # inside step 7's loop body, before its train step
      armed.append(1)
      gc.collect()
    return real_put(batch, sharding)
  monkeypatch.setattr(train, "put_global_batch", put_global_batch)
  workdir = tmp_path / "run"
  with pytest.raises(TrainingInterrupted, match="interrupted at step 7; saved a checkpoint at "
                                                "step 7;"):
    _run(tiny_config, workdir, checkpoint_every_steps=100, log_every_steps=5)
  assert swallowed == [1]
  assert _steps(workdir) == [7]


# ----------------------------------------------------------------------------- fallback
def _corrupt(step_dir):
  for directory, _, files in os.walk(step_dir):
    for name in files:
      if name != "commit_success.txt":
        with open(os.path.join(directory, name), "wb") as f:
          f.write(b"\x00garbage" * 7)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, tiny_config, capsys):
  workdir = tmp_path / "run"
  _run(tiny_config, workdir, num_train_steps=20)        # checkpoints at 10 and 20
  _corrupt(workdir / "checkpoints" / "20")
  os.remove(workdir / "result.json")
  capsys.readouterr()
  result = _run(tiny_config, workdir, num_train_steps=30)
  out = capsys.readouterr()
  warnings = [line for line in (out.out + out.err).splitlines() if "is unusable" in line]
  assert len(warnings) == 1 and "checkpoint step 20" in warnings[0], out
  assert "resumed from" in out.out + out.err and "at step 10" in out.out + out.err
  assert result["step"] == 30 and _steps(workdir) == [20, 30]
  assert [name.split(".")[0] for name in os.listdir(workdir / "corrupt_checkpoints")] == ["20"]
  reference = _run(tiny_config, tmp_path / "clean")
  np.testing.assert_allclose(result["test"]["loss"], reference["test"]["loss"], rtol=1e-5)


def _comparable(records):
  """Metrics records without the wall-clock fields."""
  return [{k: v for k, v in r.items() if k not in ("time", "steps_per_sec")} for r in records]


def test_a_carried_run_resumes_bit_identically(tmp_path, tiny_config):
  """A run stopped at step 20, packed into size-limited parts (records and newest checkpoint
  only), unpacked under another root and resumed to step 30 ends exactly as the run trained to
  30 in one go: every metric after step 20 and the test result, bit for bit (a lent GPU
  machine carries long runs from one lease to the next this way)."""
  from lra_sparse.sweep import carry
  run = tmp_path / "a" / "run"
  _run(tiny_config, run, num_train_steps=20)            # checkpoints 10 and 20
  os.remove(run / "result.json")                        # as if it had stopped at 20
  (run / "events.out.tfevents.0").write_bytes(b"x" * 100)
  parts = carry.pack(str(tmp_path / "a"), str(tmp_path / "parts"), part_mb=0.02, max_parts=99)
  assert len(parts) > 1                                 # cut into several parts
  with pytest.raises(FileExistsError, match="already holds parts"):
    carry.pack(str(tmp_path / "a"), str(tmp_path / "parts"), part_mb=0.02, max_parts=99)
  with pytest.raises(ValueError, match=r"more than 1 parts .* largest runs .*run \d"):
    carry.pack(str(tmp_path / "a"), str(tmp_path / "other"), part_mb=0.02, max_parts=1)
  assert carry.unpack(str(tmp_path / "b"), str(tmp_path / "parts")) == {
      "run": "unpacked (checkpoint 20)"}
  moved = tmp_path / "b" / "run"
  assert sorted(os.listdir(moved)) == ["checkpoints", "config.json", "metrics.jsonl"]
  assert _steps(moved) == [20]                          # the newest checkpoint only

  resumed = _run(tiny_config, moved, num_train_steps=30)
  reference = _run(tiny_config, tmp_path / "clean", num_train_steps=30)
  assert resumed["test"] == reference["test"] and resumed["step"] == 30
  after = lambda w: _comparable([r for r in _records(w) if r["step"] > 20])
  assert after(moved) and after(moved) == after(tmp_path / "clean")
  # Unpacking again never moves a run back past what it has reached here.
  assert carry.unpack(str(tmp_path / "b"), str(tmp_path / "parts")) == {
      "run": "kept the local copy (checkpoint 30 >= carried 20)"}
  os.remove(parts[-1])
  with pytest.raises(FileNotFoundError, match=rf"part\(s\) \[{len(parts)}\] of {len(parts)} "
                                              "missing"):
    carry.unpack(str(tmp_path / "c"), str(tmp_path / "parts"))


def test_carry_command_line(tmp_path):
  """`python -m lra_sparse.sweep.carry`: a round trip of records through parts, and its user
  errors on one line."""
  run = tmp_path / "root" / "r1"
  run.mkdir(parents=True)
  (run / "config.json").write_text("{}")
  (run / "metrics.jsonl").write_text('{"step": 1}\n')
  (run / "run.lock").write_text("")                       # never carried
  carry = [sys.executable, "-m", "lra_sparse.sweep.carry"]
  done = subprocess.run(carry + ["--pack", f"--root={tmp_path / 'root'}",
                                 f"--parts_dir={tmp_path / 'parts'}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and "into 1 part(s)" in done.stdout, done.stderr
  done = subprocess.run(carry + ["--unpack", f"--root={tmp_path / 'copy'}",
                                 f"--parts_dir={tmp_path / 'parts'}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and done.stdout.strip() == "r1: unpacked", done.stderr
  assert sorted(os.listdir(tmp_path / "copy" / "r1")) == ["config.json", "metrics.jsonl"]
  # --runs: only the runs it selects (device_sweep.sh places each carried run in the root of
  # the REGEX that selects it), never the packed root's sweep.json.
  (tmp_path / "two" / "grid__seed=0").mkdir(parents=True)
  (tmp_path / "two" / "grid__seed=1").mkdir()
  for name in ("grid__seed=0", "grid__seed=1"):
    (tmp_path / "two" / name / "config.json").write_text("{}")
  (tmp_path / "two" / "sweep.json").write_text("{}")
  done = subprocess.run(carry + ["--pack", f"--root={tmp_path / 'two'}",
                                 f"--parts_dir={tmp_path / 'two_parts'}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  done = subprocess.run(carry + ["--unpack", f"--root={tmp_path / 'sel'}",
                                 f"--parts_dir={tmp_path / 'two_parts'}", "--runs=seed=1$"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and done.stdout.splitlines() == [
      "grid__seed=0: left out (--runs='seed=1$' does not match it)",
      "grid__seed=1: unpacked"], done.stdout + done.stderr
  assert os.listdir(tmp_path / "sel") == ["grid__seed=1"]
  for args, message in (
      (["--unpack", "--root=x", f"--parts_dir={tmp_path / 'two_parts'}", "--runs=seed=[1"],
       "error: --runs='seed=[1' is not a regular expression (unterminated character set at "
       "position 5)"),
      (["--pack", f"--root={tmp_path / 'two'}", "--parts_dir=y", "--runs=seed"],
       "error: --runs selects what --unpack unpacks; --pack carries the whole root"),
      (["--pack", "--unpack", "--root=x", "--parts_dir=y"],
       "error: give exactly one of --pack and --unpack"),
      (["--pack", f"--root={tmp_path / 'absent'}", "--parts_dir=y"],
       f"error: --root={str(tmp_path / 'absent')!r}: no such directory"),
      (["--unpack", "--root=x", f"--parts_dir={tmp_path / 'root'}"],
       f"error: --parts_dir={str(tmp_path / 'root')!r}: no carry.tgz.part-<i>-of-<n> file")):
    proc = subprocess.run(carry + args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [message], proc.stderr


def test_init_from_refuses_an_unusable_newest_checkpoint(tmp_path, tiny_config):
  pre = tmp_path / "pre"
  _run(tiny_config, pre, num_train_steps=10)
  manager = ocp.CheckpointManager(str(pre / "checkpoints"))
  state = manager.restore(10, args=ocp.args.StandardRestore())
  state["params"] = jax.tree.map(lambda p: np.full_like(p, np.nan), state["params"])
  manager.save(11, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  manager.close()
  with pytest.raises(ValueError, match=r"newest checkpoint \(step 11\) .* is unusable .*not "
                                       "finite"):
    _run(tiny_config, tmp_path / "ft", num_train_steps=5, init_from=str(pre))


# ----------------------------------------------------------------------------- metrics log
def test_half_written_metrics_line_is_not_glued_to_the_next_record(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text(json.dumps({"step": 5, "split": "train", "loss": 1.0}) + "\n"
                  + '{"step": 10, "split": "tra')
  workdir_lib.MetricsWriter(str(tmp_path)).write(10, "train", {"loss": 0.5})
  messages = []
  records = [r for _, r in workdir_lib.read_metrics(str(tmp_path), messages.append)]
  assert [(r["step"], r["loss"]) for r in records] == [(5, 1.0), (10, 0.5)]
  assert len(messages) == 1 and ":2: invalid JSON" in messages[0]


# ----------------------------------------------------------------------------- sweep state
def test_sweep_counts_a_zombie_child_as_dead_and_shows_the_real_error(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  for _ in range(200):                # exited but not reaped: a zombie that answers kill 0
    with open(f"/proc/{child.pid}/stat") as f:
      if f.read().rsplit(")", 1)[1].split()[0] == "Z":
        break
    time.sleep(0.05)
  (workdir / "sweep_running.json").write_text(json.dumps(
      {"pid": child.pid, "host": os.uname().nodename, "slot": None}))
  os.kill(child.pid, 0)               # still "alive" to a plain kill 0
  assert sweep_state._read_running(str(workdir)) is None
  child.wait()
  (workdir / "sweep_error.txt").write_text(
      "return code 1\ntime: now\ncommand: x\n---- last 60 lines ----\n"
      "error: config.attention.dfss.nm='5:4': need 0 < n <= m\n"
      "--------------------\n"
      "For simplicity, JAX has removed its internal frames from the traceback of the "
      "following exception. Set JAX_TRACEBACK_FILTERING=off to include these.\n")
  assert sweep_lib.error_summary(str(workdir)) == (
      "return code 1 | error: config.attention.dfss.nm='5:4': need 0 < n <= m")


# ----------------------------------------------------------------------------- CLI
def _main(workdir, *overrides, config="configs/listops.py:tiny", **popen):
  return [sys.executable, "-m", "lra_sparse.main", f"--config={config}",
          f"--workdir={workdir}", *overrides]


def _tiny_listops(listops_dir, steps, every):
  return [f"--config.data.data_dir={listops_dir}", "--config.data.max_length=128",
          f"--config.num_train_steps={steps}", f"--config.checkpoint_every_steps={every}",
          f"--config.eval_every_steps={steps}", "--config.log_every_steps=5",
          "--config.num_eval_batches=1", "--config.batch_size=16"]


def test_cli_user_errors_are_one_line(tmp_path, listops_dir):
  bad_tsv = tmp_path / "bad"
  bad_tsv.mkdir()
  for split in ("train", "val", "test"):
    (bad_tsv / f"basic_{split}.tsv").write_text("Source\tTarget\n( [MAX 2 3 ] )\t3\n"
                                                "( [MAX 2 Q ] )\t3\n")
  cases = [
      (["--config.atention.kind=dsa"], "error: config.atention.kind is not a field of the "
                                       "config (did you mean config.attention.kind?)"),
      (["--config.attention.kind=nope"], "error: unknown attention kind 'nope'"),
      (["--config.eval_every_steps=0"], "error: config.eval_every_steps=0 must be a positive "
                                        "integer"),
      ([f"--config.data.data_dir={tmp_path / 'absent'}"], "error: ListOps data directory not "
                                                          "found"),
      ([f"--config.data.data_dir={bad_tsv}"], f"error: {bad_tsv}/basic_train.tsv:3: unknown "
                                              "token 'Q'"),
      # A real refused allocation, not a mock: a 2^45-wide MLP's bias alone is 128 TiB, more
      # than any process can map, whatever the host's overcommit policy.
      ([f"--config.data.data_dir={listops_dir}", "--config.data.max_length=128",
        "--config.model.mlp_dim=35184372088832"],
       "error: out of device memory: RESOURCE_EXHAUSTED: "),
  ]
  for overrides, start in cases:
    proc = subprocess.run(_main(tmp_path / "run", *overrides), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(start), proc.stderr
  proc = subprocess.run(_main(tmp_path / "run", config="configs/listops.py:huge"), cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.stderr.strip().splitlines() == [
      "error: --config=configs/listops.py:huge: unknown preset 'huge' for configs/listops.py; "
      "known: '', 'stable', 'tiny'"]
  # The traceback is one environment variable away.
  proc = subprocess.run(_main(tmp_path / "run", "--config.eval_every_steps=0"), cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, LRA_SPARSE_TRACEBACK="1"))
  assert proc.returncode != 0 and "Traceback (most recent call last)" in proc.stderr


def _wait_for(predicate, timeout, what, proc=None, log=None):
  """Polls ``predicate`` until it holds; fails at once if ``proc`` exits first, and either way
  with the tail of its output (``log``, a file it writes: a pipe nobody reads could fill and
  stall it)."""
  def tail():
    return log.read_text()[-3000:] if log is not None and log.exists() else ""

  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    if proc is not None and proc.poll() is not None:
      raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{tail()}")
    time.sleep(0.2)
  raise AssertionError(f"timed out waiting for {what}:\n{tail()}")


def test_sigint_saves_cleanly_exits_130_and_resumes(tmp_path, listops_dir):
  workdir = tmp_path / "run"
  args = _main(workdir, *_tiny_listops(listops_dir, 4000, 10))
  log = tmp_path / "stderr.log"
  with open(log, "w") as err:
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)
  _wait_for(lambda: os.path.isdir(workdir / "checkpoints")
            and any(n.isdigit() for n in os.listdir(workdir / "checkpoints")), 240,
            "a first checkpoint", proc, log)
  proc.send_signal(signal.SIGINT)
  proc.wait(timeout=120)
  stderr = log.read_text()
  assert proc.returncode == 130, stderr
  last = stderr.strip().splitlines()[-1]
  assert last.startswith("interrupted: interrupted at step "), stderr
  assert "Traceback" not in stderr
  # The state reached is checkpointed, wherever in the loop the interrupt came.
  reached = int(re.match(r"interrupted: interrupted at step (\d+);", last).group(1))
  saved = _steps(workdir)[-1]
  assert (f"saved a checkpoint at step {reached};" in last
          or f"its checkpoint at step {reached} is kept" in last), last
  assert saved == reached, (saved, last)
  finish = _main(workdir, *_tiny_listops(listops_dir, saved + 10, 10))
  done = subprocess.run(finish, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads((workdir / "result.json").read_text())["step"] == saved + 10


_SIGINT_DURING_SAVE = r"""
import os, signal, sys
from lra_sparse import checkpointing
signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal (a background
steps = []                                                 # job starts with Ctrl-C ignored)
try:
  with checkpointing.sigint_after():
    steps.append("save started")
    os.kill(os.getpid(), signal.SIGINT)      # Ctrl-C in the middle of the save
    steps.append("save finished")
except KeyboardInterrupt:
  steps.append("interrupted")
print(steps)
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
signal.signal(signal.SIGINT, signal.SIG_IGN)               # ignored: stays ignored
with checkpointing.sigint_after():
  os.kill(os.getpid(), signal.SIGINT)
print("ignored")
"""


def test_ctrl_c_during_a_checkpoint_save_interrupts_after_it():
  """A Ctrl-C that lands inside the periodic checkpoint save waits for the save to finish, then
  interrupts as usual (a save cut in half once made the interrupt's own save of that step fail
  and lost the steps since the last checkpoint); the usual handler is back afterwards, and a
  process that ignores Ctrl-C keeps ignoring it."""
  done = subprocess.run([sys.executable, "-c", _SIGINT_DURING_SAVE], capture_output=True,
                        text=True, timeout=120, check=False, cwd=REPO)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ["['save", "started',", "'save", "finished',", "'interrupted']",
                                 "ignored"], done.stdout


def test_kill_9_then_resume_gives_the_uninterrupted_result(tmp_path, listops_dir):
  steps = 60
  reference = subprocess.run(_main(tmp_path / "ref", *_tiny_listops(listops_dir, steps, 10)),
                             cwd=REPO, capture_output=True, text=True, timeout=300)
  assert reference.returncode == 0, reference.stderr[-2000:]
  workdir = tmp_path / "run"
  args = _main(workdir, *_tiny_listops(listops_dir, steps, 10))
  log = tmp_path / "stderr.log"
  with open(log, "w") as err:
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
  _wait_for(lambda: len(_records(workdir, "train")) >= 3, 240, "training to log step 15", proc,
            log)
  proc.kill()
  proc.wait()
  assert not (workdir / "result.json").exists()
  done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  want = json.loads((tmp_path / "ref" / "result.json").read_text())
  got = json.loads((workdir / "result.json").read_text())
  assert got["step"] == want["step"] == steps
  np.testing.assert_allclose(got["test"]["loss"], want["test"]["loss"], rtol=1e-6)
  assert got["test"]["accuracy"] == want["test"]["accuracy"]
