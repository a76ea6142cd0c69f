"""Every task's tiny preset, and every attention kind, trains 30 steps through the one trainer."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lra_sparse import config as config_lib
from lra_sparse import train
from lra_sparse.config import load_config_file
from lra_sparse.data import get_task
from lra_sparse.models.encoder import sinusoidal_positions
from tests.conftest import task_data_overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _short(config, **overrides):
  config.num_train_steps = 30
  config.log_every_steps = 5
  config.eval_every_steps = 30
  config.checkpoint_every_steps = 30
  config.optim.warmup_steps = 5
  config.num_eval_batches = 2
  config.update_from_flattened_dict(overrides)
  return config


def _train_losses(workdir) -> list[float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [r["loss"] for r in records if r["split"] == "train"]


def _assert_trains(config, workdir):
  result = train.train_and_evaluate(config, str(workdir))
  losses = _train_losses(workdir)
  assert len(losses) == 6 and all(np.isfinite(losses)), losses
  assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses
  assert np.isfinite(result["test"]["loss"])
  return result


@pytest.mark.parametrize("task", ["listops", "text", "retrieval", "image", "pathfinder"])
def test_tiny_preset_trains(task, tmp_path, listops_dir):
  config = load_config_file(os.path.join(REPO, "configs", f"{task}.py"), "tiny")
  overrides = task_data_overrides(task, tmp_path, listops_dir)
  overrides.setdefault("batch_size", 16)
  _assert_trains(_short(config, **overrides), tmp_path / "run")


@pytest.mark.parametrize("attention", [
    {"attention.kind": "dfss", "attention.dfss.nm": "2:4"},
    {"attention.kind": "dfss", "attention.dfss.nm": "1:2"},
    {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9, "attention.dsa.sigma": 0.25},
    {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9, "attention.dsa.quant_bits": 4,
     "attention.dsa.vector": 4},
    {"attention.kind": "nystrom", "attention.nystrom.num_landmarks": 16,
     "attention.nystrom.nm": ""},
    {"attention.kind": "nystrom", "attention.nystrom.num_landmarks": 16,
     "attention.nystrom.nm": "2:4"},
], ids=lambda a: "-".join(str(v) for v in a.values()))
def test_attention_kind_trains_on_listops(attention, tmp_path, listops_dir):
  config = load_config_file(os.path.join(REPO, "configs", "listops.py"), "tiny")
  overrides = {"data.data_dir": listops_dir, "data.max_length": 128, "batch_size": 16,
               "optim.learning_rate": 0.01, **attention}
  _assert_trains(_short(config, **overrides), tmp_path / "run")
  # config.json holds the kind and only that kind's block, with the values set.
  with open(tmp_path / "run" / "config.json") as f:
    recorded = json.load(f)["attention"]
  kind = attention["attention.kind"]
  assert set(recorded) == {"kind", kind}
  for key, value in attention.items():
    if key != "attention.kind":
      assert recorded[kind][key.rsplit(".", 1)[1]] == value
  if attention["attention.kind"] == "dsa":
    with open(tmp_path / "run" / "metrics.jsonl") as f:
      val = [json.loads(l) for l in f if '"val"' in l][-1]
    assert 0.0 <= val["dsa_hit_rate"] <= 1.0 and val["dsa_mse"] >= 0.0


@pytest.mark.parametrize("task, preset", [
    (task, preset) for task in ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
    for preset in ("", "tiny")] + [("image", "nystromformer")])
def test_every_config_builds_the_model_it_describes(task, preset):
  """Each config file and preset passes the run checks and its model traces (shapes only), with
  the widths it declares: a field renamed or left unused breaks this, not only a literal."""

  config = load_config_file(os.path.join(REPO, "configs", f"{task}.py"), preset)
  train.validate_config(config)
  config = config_lib.run_config(config)
  spec = get_task(config.task).spec(config)
  model = train.make_model(config, spec)
  batch = {name: jnp.zeros((1, config.data.max_length), jnp.int32) for name in spec.input_names}
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), batch, deterministic=True))
  params = shapes["params"]
  block = params["encoder"]["block_0"]
  mc = config.model
  head_dim = mc.qkv_dim // mc.num_heads
  assert len([k for k in params["encoder"] if k.startswith("block_")]) == mc.num_layers
  assert block["attention"]["query"]["kernel"].shape == (mc.emb_dim, mc.num_heads, head_dim)
  assert block["Dense_0"]["kernel"].shape == (mc.emb_dim, mc.mlp_dim)
  if spec.model_kind == "dual_encoder" and mc.dual_head == "lra":
    assert params["head"]["mlp"]["kernel"].shape == (2 * mc.emb_dim, mc.classifier_dim)
    assert params["head"]["mlp2"]["kernel"].shape == (mc.classifier_dim, mc.classifier_dim // 2)
    assert params["head"]["logits"]["kernel"].shape[1] == spec.num_classes
  else:
    assert params["head"]["Dense_0"]["kernel"].shape[1] == mc.classifier_dim
    assert params["head"]["Dense_1"]["kernel"].shape[1] == spec.num_classes


def _np_sinusoid(length, dim):
  """LRA's position table, written out entry by entry in float64."""
  table = np.zeros((length, dim))
  for p in range(length):
    for i in range(dim // 2):
      table[p, 2 * i] = np.sin(p / 10000.0 ** (2 * i / dim))
      table[p, 2 * i + 1] = np.cos(p / 10000.0 ** (2 * i / dim))
  return table


def test_task_configs_default_to_lras_attention_dropout():
  """LRA's attention dropout per task (0.1; Image 0.2); the Nystromformer image preset keeps
  its official code's 0 (their Nystrom attention has none) and the tiny CPU presets have none."""
  want = {"listops": 0.1, "text": 0.1, "retrieval": 0.1, "image": 0.2, "pathfinder": 0.1,
          "pathx": 0.1}
  for task, rate in want.items():
    path = os.path.join(REPO, "configs", f"{task}.py")
    assert load_config_file(path).model.attention_dropout_rate == rate, task
    assert load_config_file(path, "tiny").model.attention_dropout_rate == 0.0, task
  image = os.path.join(REPO, "configs", "image.py")
  assert load_config_file(image, "nystromformer").model.attention_dropout_rate == 0.0


def test_default_listops_model_has_fixed_sinusoidal_positions_and_unit_std_embeddings():
  """LRA's AddPositionEmbs (fixed sinusoids unless the task learns them) and its token
  embedding init normal(stddev=1.0)."""

  config = config_lib.run_config(load_config_file(os.path.join(REPO, "configs", "listops.py")))
  config.data.max_length = 64                    # the LRA model, on a short input for speed
  spec = get_task("listops").spec(config)
  model = train.make_model(config, spec)
  tokens = np.random.default_rng(0).integers(1, spec.vocab_size, (2, 64)).astype(np.int32)
  batch = {"inputs": jnp.asarray(tokens), "targets": jnp.zeros((2,), jnp.int32)}
  variables = model.init(jax.random.key(0), batch, deterministic=True)
  encoder = variables["params"]["encoder"]
  assert "pos_embed" not in encoder
  embedding = np.asarray(encoder["embed"]["embedding"])
  assert embedding.shape == (spec.vocab_size, 512) and abs(embedding.std() - 1.0) < 0.05
  # The encoder adds exactly the sinusoid table to [CLS, tokens]: what enters the first
  # block minus the token embeddings is the table at positions 1..64.
  _, state = model.apply(variables, batch, deterministic=True, capture_intermediates=True)
  embedded = np.asarray(state["intermediates"]["encoder"]["embed"]["__call__"][0])
  block_input = np.asarray(state["intermediates"]["encoder"]["Dropout_0"]["__call__"][0])
  np.testing.assert_allclose(block_input[:, 1:65] - embedded, np.broadcast_to(
      _np_sinusoid(80, 512)[1:65], embedded.shape), atol=1e-5)
  np.testing.assert_allclose(sinusoidal_positions(80, 512)[0], _np_sinusoid(80, 512), atol=1e-6)
  # Image (CIFAR-10) and Path-X learn their positions, as LRA's configs do.
  for task in ("image", "pathx"):
    learned = load_config_file(os.path.join(REPO, "configs", f"{task}.py"), "tiny")
    assert learned.model.pos_emb == "learned"
  learned = config_lib.run_config(load_config_file(os.path.join(REPO, "configs", "image.py")))
  image_model = train.make_model(learned, get_task("image").spec(learned))
  shapes = jax.eval_shape(lambda: image_model.init(
      jax.random.key(0), {"inputs": jnp.zeros((1, 1024), jnp.int32)}, deterministic=True))
  assert shapes["params"]["encoder"]["pos_embed"].shape == (1, 1040, 128)
