"""What a run records besides checkpoints: TensorBoard and W&B copies of metrics.jsonl, profile
traces, and the checks of their config fields."""
from __future__ import annotations

import json
import os
import sys
import types

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from lra_sparse import config as config_lib
from lra_sparse import metric_writers
from lra_sparse import profiling
from lra_sparse import train
from lra_sparse import workdir as workdir_lib
from lra_sparse.data import pipeline


class _FakeRun:
  """A W&B run that records what it is given."""

  def __init__(self, init_kwargs):
    self.init_kwargs = init_kwargs
    self.logged = []
    self.exit_codes = []

  def log(self, data, step=None):
    self.logged.append((step, dict(data)))

  def finish(self, exit_code=None):
    self.exit_codes.append(exit_code)


class _FakeWandb(types.ModuleType):
  """Stands in for the wandb package (``sys.modules["wandb"]``)."""

  def __init__(self, init_error=None):
    super().__init__("wandb")
    self.runs = []
    self._init_error = init_error

  def init(self, **kwargs):
    if self._init_error is not None:
      raise self._init_error
    self.runs.append(_FakeRun(kwargs))
    return self.runs[-1]


class _Interrupt(RuntimeError):
  pass


def _metric_records(records):
  """(tag, step, value, time) of each metric of each metrics.jsonl record, in order."""
  return [(f"{r['split']}/{key}", r["step"], float(value), r["time"]) for r in records
          for key, value in r.items() if key not in ("step", "split", "time")]


def _tensorboard_scalars(workdir):
  """{tag: [(step, value, wall_time)]} as TensorBoard's own reader loads the workdir."""
  accumulator = event_accumulator.EventAccumulator(
      str(workdir), size_guidance={event_accumulator.SCALARS: 0})
  accumulator.Reload()
  return {tag: [(e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag)]
          for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_and_wandb_get_the_metrics_jsonl_records_across_a_resume(
    tmp_path, tiny_config, monkeypatch):
  """A run killed after logging step 6 (last checkpoint 5), then resumed: TensorBoard's reader
  sees every record of metrics.jsonl as `<split>/<metric>` scalars (same values and times),
  the killed run's records after step 5 replaced by the resumed run's; W&B gets each process's
  records in one run (same id) with the run's config; train records carry the schedule's
  learning rate and steps/s; the profile window 6:20 is traced in both processes, stopped by
  the failure in the first and at the run's last step (9) in the second."""
  wandb = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", wandb)
  config = tiny_config(num_train_steps=10, log_every_steps=2, eval_every_steps=5,
                       checkpoint_every_steps=5, profile_steps="6:20",
                       **{"wandb.project": "lra", "wandb.entity": "team"})
  workdir = tmp_path / "run"
  real_dataset = pipeline.train_dataset

  class Killing:
    def __init__(self, *args, **kwargs):
      self._inner = real_dataset(*args, **kwargs)

    def __getitem__(self, step):
      if step == 7:
        raise _Interrupt("killed")
      return self._inner[step]

  monkeypatch.setattr(train, "train_dataset", Killing)
  with pytest.raises(_Interrupt):
    train.train_and_evaluate(config, str(workdir))
  first = [record for _, record in workdir_lib.read_metrics(str(workdir))]
  monkeypatch.setattr(train, "train_dataset", real_dataset)
  train.train_and_evaluate(config, str(workdir))
  second = [record for _, record in workdir_lib.read_metrics(str(workdir))][len(first):]

  assert [r["step"] for r in first if r["split"] == "train"] == [2, 4, 6]
  assert [r["step"] for r in second if r["split"] == "train"] == [6, 8, 10]
  assert len([f for f in os.listdir(workdir) if f.startswith("events.out.tfevents.")]) == 2

  # TensorBoard: the resumed run restarted at step 5, so the killed run's step-6 records give way.
  want: dict[str, list] = {}
  for tag, step, value, time in _metric_records([r for r in first if r["step"] <= 5] + second):
    want.setdefault(tag, []).append((step, value, time))
  got = _tensorboard_scalars(workdir)
  assert sorted(got) == sorted(want)
  assert {"train/loss", "train/accuracy", "train/grad_norm", "train/learning_rate",
          "train/steps_per_sec", "val/accuracy", "test_at_best_val/accuracy",
          "test/loss"} <= set(got)
  for tag, points in want.items():
    assert [(step, time) for step, _, time in got[tag]] == [(s, t) for s, _, t in points], tag
    np.testing.assert_allclose([v for _, v, _ in got[tag]], [v for _, v, _ in points],
                               rtol=1e-6, err_msg=tag)   # event files hold float32

  # The learning rate of the window's last update, from the optimizer's schedule.
  schedule = train.make_schedule(config.optim, config.num_train_steps)
  for record in first + second:
    if record["split"] == "train":
      assert record["learning_rate"] == pytest.approx(float(schedule(record["step"] - 1)))
      assert record["steps_per_sec"] > 0

  # W&B: one run, resumed under the id kept in the workdir; each process logs its own records.
  assert len(wandb.runs) == 2
  stored = json.loads((workdir / "config.json").read_text())
  for run, records in zip(wandb.runs, (first, second)):
    kwargs = run.init_kwargs
    assert (kwargs["project"], kwargs["entity"], kwargs["name"]) == ("lra", "team", "run")
    assert kwargs["resume"] == "allow" and kwargs["config"] == stored
    assert kwargs["id"] == json.loads((workdir / "wandb_run.json").read_text())["id"]
    want_logged = [(r["step"], {f"{r['split']}/{k}": float(v) for k, v in r.items()
                                if k not in ("step", "split", "time")}) for r in records]
    assert run.logged == want_logged
  assert [run.exit_codes for run in wandb.runs] == [[1], [0]]

  # Two traces (one per process), each closed: jax writes its files when a trace stops.
  traces = [root for root, _, files in os.walk(workdir / "profile")
            if any(name.endswith(".xplane.pb") for name in files)]
  assert len(traces) == 2 and all(os.sep + os.path.join("plugins", "profile") in t
                                  for t in traces)


def test_profile_window_starts_and_stops_around_its_steps(monkeypatch):
  """Steps 3..4 traced: the work before step 3 is waited for before the trace starts, step 4's
  outputs before it stops; a run resumed inside the window traces the rest; stop() without
  outputs ends a trace left running by a failure."""
  calls = []
  monkeypatch.setattr(profiling.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
  monkeypatch.setattr(profiling.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
  monkeypatch.setattr(profiling.jax, "block_until_ready", lambda x: calls.append(("block", x)))

  window = profiling.ProfileWindow((3, 5), "/w/profile")
  for step in range(8):
    window.before_step(step, f"state{step}")
    window.after_step(step, f"out{step}")
  window.stop("final")                          # after the loop: nothing left running
  assert calls == [("block", "state3"), ("start", "/w/profile"), ("block", "out4"), ("stop",)]

  calls.clear()
  window = profiling.ProfileWindow((3, 5), "/w/profile")
  window.before_step(4, "state4")               # resumed at step 4
  window.after_step(4, "out4")
  assert calls == [("block", "state4"), ("start", "/w/profile"), ("block", "out4"), ("stop",)]

  calls.clear()
  window = profiling.ProfileWindow((3, 50), "/w/profile")
  window.before_step(3, "state3")
  window.after_step(3, "out3")
  window.stop("final")                          # the loop ended inside the window
  assert calls == [("block", "state3"), ("start", "/w/profile"), ("block", "final"), ("stop",)]

  calls.clear()
  window = profiling.ProfileWindow((3, 50), "/w/profile")
  window.before_step(3, "state3")
  window.stop()                                 # the step failed
  window.stop()
  assert calls == [("block", "state3"), ("start", "/w/profile"), ("stop",)]
  assert profiling.ProfileWindow(None, "/w/profile").before_step(0, "s") is None


@pytest.mark.parametrize("overrides, message", [
    ({"profile_steps": "5"}, "config.profile_steps='5': it is not two integers separated by "
                             "':'; use 'START:STOP' with integers 0 <= START < STOP"),
    ({"profile_steps": "5:3"}, "config.profile_steps='5:3': START=5 is not below STOP=3"),
    ({"profile_steps": "4:4"}, "START=4 is not below STOP=4"),
    ({"profile_steps": "-1:4"}, "it is not two integers"),
    ({"profile_steps": "a:b"}, "it is not two integers"),
    ({"profile_steps": "1:2:3"}, "it is not two integers"),
    ({"profile_steps": "30:40"}, "config.profile_steps='30:40' starts at or after "
                                 "config.num_train_steps=30: nothing would be traced"),
    ({"wandb.entity": "team"}, "config.wandb.entity='team' is set but config.wandb.project is "
                               "empty"),
])
def test_bad_profile_or_wandb_fields_are_one_clear_error(tmp_path, tiny_config, overrides,
                                                         message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    train.train_and_evaluate(tiny_config(**overrides), str(tmp_path / "run"))
  assert not (tmp_path / "run" / "config.json").exists()


def test_wandb_project_without_wandb_installed_is_one_clear_error(tmp_path, tiny_config,
                                                                  monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)     # import wandb -> ImportError
  with pytest.raises(ValueError, match=r"^config.wandb.project='lra' logs to Weights & Biases, "
                                       r"but the wandb package is not installed: pip install "
                                       r"wandb \(or leave config.wandb.project empty\)$"):
    train.train_and_evaluate(tiny_config(**{"wandb.project": "lra"}), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_wandb_init_failure_names_the_fix_and_keeps_no_run_id(tmp_path, tiny_config,
                                                               monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb",
                      _FakeWandb(RuntimeError("api_key not configured (no-tty)")))
  config = config_lib.run_config(tiny_config(**{"wandb.project": "lra"}))
  with pytest.raises(ValueError, match=r"wandb.init failed \(RuntimeError: api_key not "
                                       r"configured \(no-tty\)\); log in with `wandb login`"):
    metric_writers.RunWriter(str(tmp_path), config)
  assert os.listdir(tmp_path) == []


def test_old_config_json_resumes_and_the_new_fields_may_change(tmp_path, tiny_config):
  """A config.json written before profile_steps and wandb existed reads as 'off' (so it equals
  a new run's config), and a resume may switch either on."""
  config = config_lib.run_config(tiny_config())
  stored = json.loads(config.to_json_best_effort())
  del stored["profile_steps"], stored["wandb"]
  (tmp_path / "config.json").write_text(json.dumps(stored))
  old = workdir_lib.read_config(str(tmp_path))
  assert old["profile_steps"] == "" and old["wandb"] == {"project": "", "entity": ""}
  assert train.check_resume_config(old, config, str(tmp_path)) == []
  config.profile_steps = "3:5"
  config.wandb.project = "lra"
  assert train.check_resume_config(old, config, str(tmp_path)) == [
      "profile_steps: '' -> '3:5'", "wandb.project: '' -> 'lra'"]
