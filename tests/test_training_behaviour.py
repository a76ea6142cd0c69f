"""Behaviour of training options that had none pinned: the cosine schedule against its formula,
gradient clipping, pad_multiple, and fine-tuning a dense run into DSA and DFSS."""
from __future__ import annotations

import json
import math

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lra_sparse import config as config_lib
from lra_sparse import train
from lra_sparse import workdir as workdir_lib
from lra_sparse.data import get_task
from lra_sparse.models import padded_length

from conftest import checkpoint_params


@pytest.mark.parametrize("warmup, total", [(10, 100), (0, 50), (30, 31)])
def test_cosine_schedule_is_linear_warmup_then_half_cosine_to_zero(warmup, total):
  optim = ml_collections.ConfigDict({"schedule": "cosine", "learning_rate": 1e-3,
                                     "warmup_steps": warmup})
  schedule = train.make_schedule(optim, total)
  for step in sorted({0, 1, warmup // 2, warmup, warmup + 1, (warmup + total) // 2,
                      total - 1, total}):
    if step < warmup:
      expected = 1e-3 * step / warmup
    else:
      done = min(step - warmup, total - warmup) / (total - warmup)
      expected = 1e-3 * 0.5 * (1.0 + math.cos(math.pi * done))
    assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9), step


def _updates(clip: float, grads_sequence):
  config = ml_collections.ConfigDict({
      "optim": {"schedule": "constant", "learning_rate": 0.01, "warmup_steps": 0, "b1": 0.9,
                "b2": 0.98, "eps": 1e-9, "weight_decay": 0.0, "grad_clip_norm": clip,
                "trainable": ""},
      "num_train_steps": 10})
  tx = train.make_optimizer(config)
  params = {"w": jnp.ones(3), "b": jnp.ones(2)}
  state = tx.init(params)
  out = []
  for grads in grads_sequence:
    updates, state = tx.update(grads, state, params)
    out.append(updates)
  return out


def test_gradient_clipping_rescales_a_large_gradient_to_the_norm():
  """Clipping at norm 1: a gradient of norm 100 enters Adam as itself / 100, a gradient of
  norm 0.5 unchanged (checked through Adam's second update, which sees both scales)."""
  big = {"w": jnp.asarray([60.0, 0.0, 80.0]), "b": jnp.asarray([0.0, 0.0])}     # norm 100
  small = {"w": jnp.asarray([0.3, 0.0, 0.0]), "b": jnp.asarray([0.4, 0.0])}     # norm 0.5
  clipped = _updates(1.0, [big, small])
  by_hand = _updates(0.0, [jax.tree.map(lambda g: g / 100.0, big), small])
  unclipped = _updates(0.0, [big, small])
  for a, b in zip(jax.tree.leaves(clipped[1]), jax.tree.leaves(by_hand[1])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
  assert not np.allclose(clipped[1]["w"], unclipped[1]["w"], rtol=1e-3)


def _synthetic_model(pad_multiple: int, tiny_config):
  config = config_lib.run_config(tiny_config(**{"model.pad_multiple": pad_multiple}))
  spec = get_task(config.task).spec(config)
  return train.make_model(config, spec), config, spec


def test_pad_multiple_pads_the_sequence_without_changing_the_logits(tiny_config):
  model_1, config_1, spec = _synthetic_model(1, tiny_config)
  model_16, config_16, _ = _synthetic_model(16, tiny_config)
  length = config_1.data.max_length
  assert padded_length(length, config_1.model) == length + 1          # + CLS
  assert padded_length(length, config_16.model) == -(-(length + 1) // 16) * 16
  tokens = np.random.default_rng(0).integers(1, spec.vocab_size, (4, length)).astype(np.int32)
  tokens[:, length - 5:] = 0
  batch = {"inputs": tokens}
  params = model_1.init(jax.random.key(0), batch, deterministic=True)
  _, state = model_16.apply(params, batch, deterministic=True, capture_intermediates=True)
  inside = state["intermediates"]["encoder"]["final_norm"]["__call__"][0]
  assert inside.shape[1] == padded_length(length, config_16.model)
  np.testing.assert_allclose(model_16.apply(params, batch, deterministic=True),
                             model_1.apply(params, batch, deterministic=True),
                             rtol=1e-5, atol=1e-5)


def _params(workdir):
  return flax.traverse_util.flatten_dict(checkpoint_params(workdir), sep="/")


@pytest.mark.parametrize("kind, overrides, fresh_marker", [
    ("dsa", {"attention.dsa.sparsity": 0.75}, "predictor"),
    ("dfss", {"attention.dfss.nm": "2:4"}, None),
])
def test_fine_tuning_a_dense_run_into_another_kind(tmp_path, tiny_config, kind, overrides,
                                                   fresh_marker):
  """The DSA paper's workflow: a dense run, then fine-tuning with another kind. Every
  parameter the two models share starts at the dense run's value; the new kind's own
  parameters (DSA's predictor) are freshly initialised and named; a few steps train."""
  train.train_and_evaluate(tiny_config(num_train_steps=6), str(tmp_path / "dense"))
  finetune = tiny_config(num_train_steps=4, init_from=str(tmp_path / "dense"),
                         **{"attention.kind": kind, "optim.learning_rate": 0.0, **overrides})
  result = train.train_and_evaluate(finetune, str(tmp_path / kind))
  init = [r for _, r in workdir_lib.read_metrics(str(tmp_path / kind))
          if r["split"] == "init_from"]
  dense, tuned = _params(str(tmp_path / "dense")), _params(str(tmp_path / kind))
  fresh = sorted(set(tuned) - set(dense))
  assert init[0]["fresh_params"] == len(fresh) and init[0]["unused_params"] == 0
  if fresh_marker:
    assert fresh and all(fresh_marker in name for name in fresh), fresh
  else:
    assert not fresh
  # Learning rate 0: the shared parameters are still exactly the dense run's.
  for name in set(dense) & set(tuned):
    np.testing.assert_array_equal(tuned[name], dense[name], err_msg=name)
  assert np.isfinite(result["test"]["loss"])
  with open(tmp_path / kind / "config.json") as f:
    assert json.load(f)["attention"]["kind"] == kind


KINDS = {"dense": {}, "dfss": {"attention.dfss.nm": "2:4"},
         "nystrom": {"attention.nystrom.num_landmarks": 8},
         "dsa": {"attention.dsa.sparsity": 0.75}}


def test_each_kind_builds_its_own_attention(tiny_config):
  """The model a config builds runs the attention its kind names: with every shared
  parameter equal, the four kinds give four different sets of logits (a model that ignored
  config.attention and built dense would repeat dense's)."""
  logits = {}
  shared = None
  for kind, overrides in KINDS.items():
    config = config_lib.run_config(tiny_config(**{"attention.kind": kind, **overrides}))
    spec = get_task(config.task).spec(config)
    model = train.make_model(config, spec)
    tokens = np.random.default_rng(1).integers(1, spec.vocab_size, (4, config.data.max_length))
    batch = {"inputs": tokens.astype(np.int32)}
    variables = flax.core.unfreeze(model.init(jax.random.key(0), batch, deterministic=True))
    flat = flax.traverse_util.flatten_dict(variables["params"])
    if shared is None:
      shared = flat
    flat.update({path: value for path, value in shared.items() if path in flat})
    variables["params"] = flax.traverse_util.unflatten_dict(flat)
    logits[kind] = np.asarray(model.apply(variables, batch, deterministic=True))
  kinds = list(KINDS)
  for i, a in enumerate(kinds):
    for b in kinds[i + 1:]:
      assert not np.allclose(logits[a], logits[b], atol=1e-4), (a, b)
