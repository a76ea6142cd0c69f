"""scripts/collapse_probe.py: the classifier head's spreads and live units, on a trained run."""
import os
import subprocess
import sys

import numpy as np
import pytest

from lra_sparse import train
from scripts import collapse_probe
from tests.conftest import REPO, make_tiny_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, listops_dir):
  """A tiny ListOps run (a registered task, so that the CLI's own process can load it)."""
  workdir = str(tmp_path_factory.mktemp("probe") / "run")
  train.train_and_evaluate(make_tiny_config("listops", num_train_steps=20, **{
      "data.data_dir": listops_dir, "data.max_length": 128}), workdir)
  return workdir


def _numpy_head(params, features):
  """The head written again: relu(f W0 + b0) W1 + b1, float64."""
  head = {k: {n: np.asarray(v, np.float64) for n, v in layer.items()}
          for k, layer in params["head"].items()}
  hidden = features @ head["Dense_0"]["kernel"] + head["Dense_0"]["bias"]
  return hidden, np.maximum(hidden, 0) @ head["Dense_1"]["kernel"] + head["Dense_1"]["bias"]


def test_a_trained_head_is_alive_and_a_dead_one_gives_every_example_the_same_logits(run_dir):
  model, params, batch, targets, step = collapse_probe.load_run(run_dir, num_examples=64)
  assert step == 20 and len(targets) == 64
  _, state = model.apply({"params": params}, batch, deterministic=True,
                         capture_intermediates=True, mutable=["intermediates"])
  features = np.asarray(state["intermediates"]["encoder"]["__call__"][0], np.float64)
  hidden, logits = _numpy_head(params, features)
  alive = collapse_probe.head_report(model, params, batch, targets)
  assert alive["hidden_units_live"] == int((hidden > 0).any(axis=0).sum()) > 0
  assert alive["hidden_max"] == pytest.approx(hidden.max(), rel=1e-4)
  assert alive["logits_spread"] == pytest.approx(logits.std(axis=0).mean(), rel=1e-4)
  assert alive["logits_spread"] > 0
  assert alive["accuracy"] == pytest.approx((logits.argmax(-1) == targets).mean())
  # Every hidden unit below zero for every input: the logits are the output bias.
  dead_params = {**params, "head": {**params["head"], "Dense_0": {
      **params["head"]["Dense_0"], "bias": params["head"]["Dense_0"]["bias"] - 1e4}}}
  dead = collapse_probe.head_report(model, dead_params, batch, targets)
  assert dead["hidden_units_live"] == 0 and dead["hidden_max"] < 0
  assert dead["logits_spread"] == 0.0
  assert dead["features_spread"] == pytest.approx(alive["features_spread"])


def test_the_cli_prints_one_line_per_run_and_names_a_missing_run(run_dir, tmp_path):
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  command = [sys.executable, "-m", "scripts.collapse_probe", f"--workdir={run_dir}",
             "--num_examples=8"]
  out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True)
  lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
  assert len(lines) == 1 and '"checkpoint": 20' in lines[0]
  missing = subprocess.run(command[:3] + [f"--workdir={tmp_path / 'none'}"], cwd=REPO,
                           env=env, capture_output=True, text=True)
  assert missing.returncode != 0 and "no config.json there" in missing.stderr


def test_init_seed_probes_the_parameters_the_trainer_starts_from(tmp_path, listops_dir):
  """A run at learning rate 0 keeps its initial parameters in its checkpoint: the probe at
  --init_seed of the run's seed reports the same, another seed does not."""
  workdir = str(tmp_path / "frozen")
  config = make_tiny_config("listops", num_train_steps=2, seed=3, **{
      "data.data_dir": listops_dir, "data.max_length": 128, "optim.learning_rate": 0.0,
      "optim.warmup_steps": 0, "checkpoint_every_steps": 2})
  train.train_and_evaluate(config, workdir)
  stored = collapse_probe.probe(workdir, num_examples=16)
  started = collapse_probe.probe(workdir, num_examples=16, init_seed=3)
  other = collapse_probe.probe(workdir, num_examples=16, init_seed=4)
  assert (stored["checkpoint"], started["checkpoint"]) == (2, 0)
  for key in ("features_spread", "hidden_spread", "hidden_max", "logits_spread",
              "mean_logit_gap"):
    assert started[key] == pytest.approx(stored[key], rel=1e-5), key
    assert other[key] != pytest.approx(stored[key], rel=1e-3), key
