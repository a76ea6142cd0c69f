"""Shared test setup: a synthetic task, GPU skipping, and a small ListOps dataset."""
from __future__ import annotations

import os

import numpy as np
import pytest
import jax

from lra_sparse.data.registry import TaskSpec, register_task, _TASKS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


if "synthetic" not in _TASKS:
  @register_task("synthetic")
  class SyntheticTask:
    """Label = first token mod 3: learnable in a few steps; rows have end padding."""

    def spec(self, config):
      return TaskSpec("synthetic", num_classes=3, vocab_size=12)

    def load_split(self, config, split):
      rng = np.random.default_rng({"train": 0, "val": 1, "test": 2}[split])
      n, length = 128, config.data.max_length
      tokens = rng.integers(1, 12, size=(n, length)).astype(np.int32)
      lengths = rng.integers(length // 2, length + 1, size=n)
      tokens[np.arange(length)[None] >= lengths[:, None]] = 0
      return {"inputs": tokens, "targets": (tokens[:, 0] % 3).astype(np.int32)}


@pytest.fixture(scope="session")
def listops_dir(tmp_path_factory):
  """A small generated ListOps set in the official layout (short sequences for speed)."""
  from lra_sparse.generators.listops import write_listops_dataset
  out = tmp_path_factory.mktemp("listops")
  write_listops_dataset(str(out), num_train=400, num_val=64, num_test=64, seed=0,
                        min_length=20, max_length=120)
  return str(out)


@pytest.fixture
def tiny_config():
  """Factory: the tiny ListOps preset shrunk further for tests, with dotted overrides."""
  return make_tiny_config


def make_tiny_config(task: str = "synthetic", **overrides):
  from lra_sparse.config import load_config_file
  config = load_config_file(os.path.join(REPO, "configs", "listops.py"), "tiny")
  config.task = task
  config.data.max_length = 32
  config.model.num_layers = 1
  config.model.emb_dim = 32
  config.model.qkv_dim = 32
  config.model.mlp_dim = 64
  config.model.classifier_dim = 32
  config.batch_size = 16
  config.num_train_steps = 30
  config.eval_every_steps = 15
  config.checkpoint_every_steps = 10
  config.log_every_steps = 5
  config.optim.learning_rate = 0.05
  config.optim.warmup_steps = 10
  config.update_from_flattened_dict(overrides)
  return config
