"""The model's parameters are LRA's (LRA_DIFFERENCES.md), each one field away from the earlier
choice; runs recorded before the fields existed read back what they ran; the evaluation
diagnostics (predicted-class histogram, train-mode validation, window maxima)."""
from __future__ import annotations

import json
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lra_sparse import config as config_lib
from lra_sparse import train, workdir as workdir_lib
from lra_sparse.config import load_config_file
from lra_sparse.data import get_task
from lra_sparse.tables import stability

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, MLP = 64, 128          # fans where xavier_uniform and lecun_normal have different ranges
EARLIER = {"model.attention_bias": True, "model.kernel_init": "lecun_normal",
           "model.mlp_bias_init_std": 0.0, "model.cls_init_std": 0.02,
           "model.float32_head": False}


def _config(**overrides):
  config = load_config_file(os.path.join(REPO, "configs", "listops.py"))
  config.task = "synthetic"
  config.update_from_flattened_dict({
      "data.max_length": 24, "model.num_layers": 2, "model.num_heads": 4,
      "model.emb_dim": WIDTH, "model.qkv_dim": WIDTH, "model.mlp_dim": MLP,
      "model.classifier_dim": MLP, **overrides})
  return config_lib.run_config(config)


def _model_and_params(seed=0, **overrides):
  config = _config(**overrides)
  spec = get_task(config.task).spec(config)
  model = train.make_model(config, spec)
  tokens = np.random.default_rng(seed).integers(1, spec.vocab_size, (3, 24)).astype(np.int32)
  params = model.init(jax.random.key(seed), {"inputs": tokens}, deterministic=True)["params"]
  return model, flax.core.unfreeze(params), tokens


def _flat(params):
  return {"/".join(path): value for path, value in
          flax.traverse_util.flatten_dict(params).items()}


def _xavier_bound(kernel, fan_in_axes):
  fan_in = int(np.prod([kernel.shape[a] for a in fan_in_axes]))
  fan_out = kernel.size // fan_in
  return np.sqrt(6.0 / (fan_in + fan_out))


def _kernels(flat):
  """(name, kernel, fan-in axes) of every q/k/v/out projection and MLP layer."""
  for name, value in flat.items():
    if not name.endswith("kernel") or "block_" not in name:
      continue
    if "/attention/out/" in name:
      yield name, np.asarray(value), (0, 1)             # [heads, head_dim, emb]
    elif "/attention/" in name or "Dense" in name:
      yield name, np.asarray(value), (0,)


def test_default_projections_have_no_bias():
  _, params, _ = _model_and_params()
  flat = _flat(params)
  attention = [name for name in flat if "/attention/" in name]
  assert attention and all(name.endswith("kernel") for name in attention), attention
  _, params, _ = _model_and_params(**{"model.attention_bias": True})
  assert sum(name.endswith("bias") for name in _flat(params) if "/attention/" in name) == 8


def test_default_kernels_are_xavier_uniform():
  _, params, _ = _model_and_params()
  kernels = list(_kernels(_flat(params)))
  assert len(kernels) == 2 * 6      # per block: query, key, value, out, two MLP layers
  for name, kernel, fan_in_axes in kernels:
    bound = _xavier_bound(kernel, fan_in_axes)
    # U(-b, b): every entry inside, the largest near b, variance b^2 / 3.
    assert np.abs(kernel).max() <= bound, name
    assert np.abs(kernel).max() > 0.95 * bound, name
    assert kernel.std() == pytest.approx(bound / np.sqrt(3), rel=0.08), name


def test_lecun_normal_kernels_reach_past_the_xavier_bound():
  _, params, _ = _model_and_params(**{"model.kernel_init": "lecun_normal"})
  for name, kernel, fan_in_axes in _kernels(_flat(params)):
    fan_in = int(np.prod([kernel.shape[a] for a in fan_in_axes]))
    assert kernel.std() == pytest.approx(fan_in ** -0.5, rel=0.08), name
    assert np.abs(kernel).max() > 1.1 * _xavier_bound(kernel, fan_in_axes), name


def test_mlp_biases_start_at_lra_normal_1e6_and_cls_at_zeros():
  _, params, _ = _model_and_params()
  flat = _flat(params)
  biases = [np.asarray(v) for n, v in flat.items() if "Dense" in n and n.endswith("bias")
            and "block_" in n]
  assert len(biases) == 4
  values = np.concatenate(biases)
  assert np.all(values != 0) and values.std() == pytest.approx(1e-6, rel=0.1)
  assert np.all(np.asarray(params["encoder"]["cls"]) == 0)
  _, params, _ = _model_and_params(**{"model.mlp_bias_init_std": 0.0,
                                      "model.cls_init_std": 0.02})
  flat = _flat(params)
  assert all(np.all(np.asarray(v) == 0) for n, v in flat.items()
             if "Dense" in n and n.endswith("bias") and "block_" in n)
  assert np.asarray(params["encoder"]["cls"]).std() == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize("float32_head, expected", [(True, jnp.float32),
                                                    (False, jnp.bfloat16)])
def test_classifier_head_runs_in_float32_in_a_bf16_model(float32_head, expected):
  model, params, tokens = _model_and_params(**{"model.dtype": "bfloat16",
                                               "model.float32_head": float32_head})
  _, state = model.apply({"params": params}, {"inputs": tokens}, deterministic=True,
                         capture_intermediates=True)
  hidden = state["intermediates"]["head"]["Dense_0"]["__call__"][0]
  assert hidden.dtype == expected


def test_padded_queries_do_not_change_the_logits():
  """LRA masks padded queries as well as keys; masking keys alone gives the same logits: the
  same examples with 40 more padding tokens at the end (their positions come after every
  real one) give the same logits."""
  model, params, tokens = _model_and_params()
  tokens[:, 18:] = 0                                     # real tokens first, then padding
  logits = model.apply({"params": params}, {"inputs": tokens}, deterministic=True)
  config = _config(**{"data.max_length": 64})
  longer = train.make_model(config, get_task(config.task).spec(config))
  padded = np.pad(tokens, ((0, 0), (0, 40)))
  logits_padded = longer.apply({"params": params}, {"inputs": padded}, deterministic=True)
  np.testing.assert_allclose(logits_padded, logits, rtol=2e-5, atol=2e-5)


def test_a_run_recorded_before_the_fields_reads_back_the_earlier_model(tmp_path):
  stored = json.loads(_config().to_json_best_effort())
  for key in EARLIER:
    del stored["model"][key.split(".")[1]]
  (tmp_path / "config.json").write_text(json.dumps(stored))
  model_config = workdir_lib.read_config(str(tmp_path))["model"]
  assert {k: model_config[k.split(".")[1]] for k in EARLIER} == EARLIER
  _, params, _ = _model_and_params(**EARLIER)
  assert any(n.endswith("bias") for n in _flat(params) if "/attention/" in n)


@pytest.mark.parametrize("override, message", [
    ({"model.kernel_init": "he_normal"}, "config.model.kernel_init='he_normal'"),
    ({"model.cls_init_std": -0.1}, "config.model.cls_init_std=-0.1 must be a number >= 0"),
    ({"model.mlp_bias_init_std": -1e-6},
     "config.model.mlp_bias_init_std=-1e-06 must be a number >= 0"),
])
def test_bad_init_fields_are_one_clear_error(override, message):
  config = _config()
  config.update_from_flattened_dict(override)
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    train.make_model(config, get_task(config.task).spec(config))


def _records(workdir, split):
  return [r for _, r in workdir_lib.read_metrics(str(workdir)) if r["split"] == split]


def test_evaluations_record_the_predicted_class_histogram_and_train_mode(tmp_path,
                                                                         tiny_config):
  config = tiny_config(num_train_steps=10, eval_every_steps=5, log_every_steps=5,
                       eval_train_mode=True, **{"model.dropout_rate": 0.3})
  train.train_and_evaluate(config, str(tmp_path))
  for split in ("val", "test", "val_train_mode"):
    for record in _records(tmp_path, split):
      shares = [record[f"predicted_{c}"] for c in range(10) if f"predicted_{c}" in record]
      assert len(shares) >= 2 and sum(shares) == pytest.approx(1.0, abs=1e-6), split
      # accuracy is the share of examples predicted right: at most the shares summed
      assert 0 <= record["accuracy"] <= 1
  val, checks = _records(tmp_path, "val"), _records(tmp_path, "val_train_mode")
  assert [r["step"] for r in checks] == [r["step"] for r in val] == [5, 10]
  # Dropout 0.3 on: the train-mode pass sees other activations than the evaluation.
  assert all(c["loss"] != v["loss"] for c, v in zip(checks, val))
  for record in _records(tmp_path, "train"):
    assert record["grad_norm_max"] >= record["grad_norm"] > 0
    assert record["loss_max"] >= record["loss"]


def test_train_mode_evaluation_without_dropout_is_the_evaluation(tmp_path, tiny_config):
  config = tiny_config(num_train_steps=5, eval_every_steps=5, eval_train_mode=True)
  assert config.model.dropout_rate == 0 and config.model.attention_dropout_rate == 0
  train.train_and_evaluate(config, str(tmp_path))
  (val,), (check,) = _records(tmp_path, "val"), _records(tmp_path, "val_train_mode")
  assert check["loss"] == pytest.approx(val["loss"], rel=1e-5)
  assert check["accuracy"] == val["accuracy"]


def test_eval_mode_gaps_names_gaps_and_collapses(tmp_path):
  """lra_sparse.tables.stability.mode_gaps on a hand-written log: a gap where evaluation mode
  falls below the train-mode pass, a collapse where both fall after the run had learned,
  nothing at the start (not yet learned)."""
  run = tmp_path / "run"
  run.mkdir()
  history = [(200, 0.167, 0.167), (400, 0.35, 0.34), (600, 0.17, 0.33), (800, 0.21, 0.20)]
  lines = []
  for step, val, check in history:
    lines.append({"step": step, "split": "val", "accuracy": val, "predicted_0": 0.9,
                  "predicted_1": 0.1})
    lines.append({"step": step, "split": "val_train_mode", "accuracy": check})
  (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
  row = stability.mode_gaps(str(run), gap=0.05, low=0.25, learned=0.30)
  assert row[1].startswith("unfinished (step 800)")
  assert row[3] == "600: 0.170 / 0.330 (0.90)"
  assert row[4] == "800: 0.210 / 0.200 (0.90)"


def test_bf16_training_path_with_attention_dropout_follows_float32():
  """The training path that bf16 runs with attention dropout (dense: the explicit softmax,
  then dropout, then A V) against float32 on the same parameters, batch and dropout key:
  the same dropped entries (the mask does not depend on the dtype), logits and loss within
  bf16's rounding, gradients pointing the same way."""
  def loss_and_grads(dtype):
    model, params, tokens = _model_and_params(**{
        "model.dtype": dtype, "model.attention_dropout_rate": 0.1,
        "model.dropout_rate": 0.1})
    tokens[:, 20:] = 0
    targets = jnp.asarray([1, 4, 7])

    def loss_fn(p):
      logits = model.apply({"params": p}, {"inputs": tokens}, deterministic=False,
                           rngs={"dropout": jax.random.key(3)})
      return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(3), targets]), logits
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, logits, grads

  loss32, logits32, grads32 = loss_and_grads("float32")
  loss16, logits16, grads16 = loss_and_grads("bfloat16")
  # Measured: logits within 0.01, loss within 7e-4, cosine 0.99994; the float32 path at
  # attention dropout 0.3 instead of 0.1 is 0.30 / 0.048 / 0.93 away.
  np.testing.assert_allclose(np.asarray(logits16), np.asarray(logits32), rtol=0, atol=0.03)
  assert abs(float(loss16) - float(loss32)) < 0.01
  flat32 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads32)])
  flat16 = np.concatenate([np.ravel(np.asarray(g, np.float32))
                           for g in jax.tree.leaves(grads16)])
  cosine = flat16 @ flat32 / (np.linalg.norm(flat16) * np.linalg.norm(flat32))
  assert cosine > 0.999, cosine
  assert np.linalg.norm(flat16) == pytest.approx(np.linalg.norm(flat32), rel=0.05)


def test_predicted_class_histogram_counts_real_examples_only():
  """The last evaluation batch is padded with weight-0 rows: they count neither in the
  histogram nor in the example count."""
  model, params, tokens = _model_and_params()
  eval_step = train.make_eval_step(model)
  batch = {"inputs": tokens, "targets": jnp.asarray([0, 1, 2])}
  sums = eval_step(params, None, batch, jnp.asarray([1.0, 1.0, 0.0]))
  predicted = [float(sums[f"predicted_{c}"]) for c in range(10) if f"predicted_{c}" in sums]
  assert float(sums["count"]) == 2.0 and sum(predicted) == pytest.approx(2.0)
  assert all(p in (0.0, 1.0, 2.0) for p in predicted)


def test_listops_stable_preset_is_lras_config_with_the_peak_learning_rate_halved():
  """The documented stable option differs from LRA's protocol in one field, the one the recipe
  study halved (the spec's ``lr0.025`` arm); a typo in the preset is one clear error."""
  path = os.path.join(REPO, "configs", "listops.py")
  lra = config_lib.flatten_config(load_config_file(path).to_dict())
  stable = config_lib.flatten_config(load_config_file(path, "stable").to_dict())
  assert {key for key in lra if lra[key] != stable[key]} == {"optim.learning_rate"}
  assert (lra["optim.learning_rate"], stable["optim.learning_rate"]) == (0.05, 0.025)
  assert set(lra) == set(stable)
  with pytest.raises(ValueError, match="unknown preset 'stabel'.*'stable'"):
    load_config_file(path, "stabel")


def test_protocol_preset_runs_the_default_config_and_stable_with_no_other_override(tmp_path):
  """listops_recipe:protocol (the float32 study of the default config) runs
  configs/listops.py as it is, seed aside, for LRA's recipe and the halved peak: applying each
  run's overrides gives exactly the default config or the :stable preset."""
  from lra_sparse.sweep.spec import expand_sweep, load_sweep  # pylint: disable=import-outside-toplevel
  sweep = load_sweep(os.path.join(REPO, "experiments", "specs", "listops_recipe.py:protocol"))
  plans = expand_sweep(sweep, str(tmp_path), validate=False)
  path = os.path.join(REPO, "configs", "listops.py")
  default = load_config_file(path)
  presets = {"lra": default, "lr0.025": load_config_file(path, "stable")}
  assert sorted(p.name for p in plans) == sorted(
      f"fp32__listops__{arm}__seed={seed}" for arm in presets for seed in range(5))
  for plan in plans:
    assert plan.config == "configs/listops.py" and plan.preset == ""
    config = load_config_file(path)
    for key, value in plan.overrides.items():
      *parents, field = key.split(".")
      node = config
      for parent in parents:
        node = node[parent]
      node[field] = value
    want = presets[plan.name.split("__")[2]].to_dict()
    want["seed"] = config.seed
    assert config.to_dict() == want, plan.name
    assert set(plan.overrides) - {"seed"} <= {"optim.learning_rate"}


def test_last_vs_best_counts_seeds_that_end_near_their_best(tmp_path):
  """lra_sparse.tables.stability.last_vs_best on hand-written runs: per row, the finished
  seeds' last-step and best-validation test (%), how many end within the margin (a gap of
  exactly the margin counts as within), unfinished runs listed, never averaged."""
  spec = tmp_path / "spec.py"
  spec.write_text(
      "from lra_sparse.tables import Selector, Table\n"
      "def get_table(preset=''):\n"
      "  return Table(title='t', split='test', columns=[Selector('ListOps', {'task': 'listops'})],\n"
      "               rows=[Selector('a', {'optim.learning_rate': 0.05}),\n"
      "                     Selector('b', {'optim.learning_rate': 0.025})])\n")
  runs = [("a0", 0.05, 0, (0.30, 0.345)), ("a1", 0.05, 1, (0.33, 0.345)),
          ("b0", 0.025, 0, (0.34, 0.35)), ("b1", 0.025, 1, None)]
  for name, lr, seed, accs in runs:
    run = tmp_path / "root" / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(
        {"task": "listops", "seed": seed, "optim": {"learning_rate": lr}}))
    (run / "metrics.jsonl").write_text(json.dumps(
        {"step": 100, "split": "train", "accuracy": 0.3}) + "\n")
    if accs is not None:
      (run / "result.json").write_text(json.dumps(
          {"step": 100, "test": {"accuracy": accs[0]},
           "test_at_best_val": {"accuracy": accs[1], "step": 50}}))
  rows = {r["label"]: r for r in stability.last_vs_best(str(tmp_path / "root"), str(spec),
                                                        within=1.5)}
  assert [(s, round(l, 2), round(b, 2)) for s, l, b, _ in rows["a"]["runs"]] == [
      (0, 30.0, 34.5), (1, 33.0, 34.5)]
  assert rows["a"]["stable"] == 1 and rows["a"]["others"] == []
  assert [(s, round(l, 2)) for s, l, _, _ in rows["b"]["runs"]] == [(0, 34.0)]
  assert rows["b"]["stable"] == 1
  assert rows["b"]["others"] == ["b1 (unfinished, step 100)"]


def test_logit_spread_is_the_logits_std_over_examples_and_zero_for_a_dead_head(tiny_config):
  """train.evaluate's logit_spread: each class's logit std over the real examples (the padded
  copies of the last batch left out), averaged over classes, as numpy has it from the logits
  of every example at once; a head whose hidden ReLU units are all dead gives 0."""
  from jax.sharding import (  # pylint: disable=import-outside-toplevel
      Mesh, NamedSharding, PartitionSpec)
  config = tiny_config()
  task = get_task(config.task)
  model = train.make_model(config, task.spec(config))
  arrays = task.load_split(config, "val")
  inputs = jnp.asarray(arrays["inputs"])
  params = model.init(jax.random.key(1), {"inputs": inputs[:2]}, deterministic=True)["params"]
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec("data"))
  eval_step = jax.jit(train.make_eval_step(model))

  def spreads(p):
    got = train.evaluate(eval_step, p, None, arrays, 48, sharding)["logit_spread"]
    logits = np.asarray(model.apply({"params": p}, {"inputs": inputs}, deterministic=True),
                        np.float64)
    return got, logits.std(axis=0).mean()

  assert len(arrays["targets"]) % 48 != 0        # a padded last batch
  got, want = spreads(params)
  assert want > 1e-3 and got == pytest.approx(want, rel=1e-4)
  head = params["head"]
  dead = {**params, "head": {**head,
                             "Dense_0": {**head["Dense_0"], "bias": head["Dense_0"]["bias"] - 1e4},
                             "Dense_1": {**head["Dense_1"], "bias": head["Dense_1"]["bias"] + 0.3}}}
  got, want = spreads(dead)
  assert want == 0.0 and got < 1e-3
