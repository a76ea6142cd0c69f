"""Self-pretraining (config.objective="denoise", lra_sparse/objectives.py): the corruption on a
hand-worked batch and in distribution, a loss that counts the selected positions only
(against numpy), the fine-tune that loads every encoder parameter and none of the LM head,
rotary positions that are relative, and one clear error per bad field."""
from __future__ import annotations

import json
import os
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lra_sparse import objectives, train
from lra_sparse.config import load_config_file
from lra_sparse.models.encoder import rotary
from tests.conftest import checkpoint_params, pathfinder_dir_with_cue, spec_on_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _corrupt(tokens, rate, mask_share, random_share, seed=0, vocab=10):
  return objectives.corrupt(jnp.asarray(tokens), jax.random.key(seed), vocab_size=vocab,
                            mask_rate=rate, mask_share=mask_share, random_share=random_share)


def test_corruption_on_a_hand_worked_batch():
  """Rates at 0 and 1 pin every position: padding (0) is never selected or changed; with
  every real token selected and every selected one masked, the row is the mask id (the
  vocabulary size) exactly where tokens are real; with nothing replaced, tokens stay and the
  selection is the real tokens."""
  tokens = np.array([[3, 5, 0, 0], [0, 7, 9, 1]], np.int32)
  real = tokens != 0
  corrupted, selected = _corrupt(tokens, 1.0, 1.0, 0.0)
  np.testing.assert_array_equal(selected, real)
  np.testing.assert_array_equal(corrupted, np.where(real, 10, 0))
  corrupted, selected = _corrupt(tokens, 1.0, 0.0, 0.0)
  np.testing.assert_array_equal(selected, real)
  np.testing.assert_array_equal(corrupted, tokens)
  corrupted, selected = _corrupt(tokens, 0.0, 0.8, 0.1)
  assert not np.asarray(selected).any()
  np.testing.assert_array_equal(corrupted, tokens)
  corrupted, selected = _corrupt(tokens, 1.0, 0.0, 1.0)       # every real token redrawn
  assert np.all((np.asarray(corrupted)[real] >= 1) & (np.asarray(corrupted)[real] < 10))
  np.testing.assert_array_equal(np.asarray(corrupted)[~real], 0)


def test_corruption_rates_and_shares_in_distribution():
  """BERT's 15% / 80-10-10 on 200k tokens: the selected share, the masked, redrawn and kept
  shares of the selected, and redrawn tokens uniform over 1..vocab-1 (never padding or the
  mask id), each within 5 standard errors."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 10, size=(400, 500)).astype(np.int32)
  tokens[:, 450:] = 0                                           # padding at the end
  corrupted, selected = map(np.asarray, _corrupt(tokens, 0.15, 0.8, 0.1, seed=3))
  real = tokens != 0
  assert not selected[~real].any() and np.all(corrupted[~real] == 0)
  n = real.sum()
  assert abs(selected.sum() / n - 0.15) < 5 * np.sqrt(0.15 * 0.85 / n)
  k = selected.sum()
  masked = selected & (corrupted == 10)
  changed = selected & (corrupted != 10) & (corrupted != tokens)
  # A redrawn token equals the original with probability 1/9: expected changed share 0.1*8/9.
  for share, want in ((masked.sum() / k, 0.8), (changed.sum() / k, 0.1 * 8 / 9)):
    assert abs(share - want) < 5 * np.sqrt(want * (1 - want) / k), (share, want)
  assert np.all((corrupted[changed] >= 1) & (corrupted[changed] <= 9))
  np.testing.assert_array_equal(corrupted[~selected], tokens[~selected])


def test_denoising_loss_counts_selected_positions_only():
  """The objective's sums against numpy cross-entropy over the selected positions of real
  examples; logits at unselected positions (and of a weight-0 example) change nothing."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, 6, size=(3, 8)).astype(np.int32)
  tokens[2, 5:] = 0
  objective = objectives.Denoise(input_keys=("inputs",), vocab_size=6, mask_rate=0.5,
                                 mask_share=0.8, random_share=0.1)
  weights = jnp.array([1.0, 1.0, 0.0])
  key = jax.random.key(7)
  _, selected = objectives.corrupt(
      jnp.asarray(tokens), jax.random.fold_in(jax.random.fold_in(key, objectives._DENOISE_STREAM),
                                               0),
      vocab_size=6, mask_rate=0.5, mask_share=0.8, random_share=0.1)
  selected = np.asarray(selected) & (np.asarray(weights)[:, None] > 0)
  assert 0 < selected.sum() < selected.size
  logits = rng.normal(size=(3, 8, 6)).astype(np.float32)
  seen = {}

  def apply(batch):
    seen["inputs"] = np.asarray(batch["inputs"])
    return {"inputs": jnp.asarray(logits)}, {}

  (loss, correct, count), _, _ = objective.score(apply, {"inputs": jnp.asarray(tokens)},
                                                 weights, key)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  picked = np.take_along_axis(log_p, tokens[..., None], -1)[..., 0]
  assert float(count) == selected.sum()
  np.testing.assert_allclose(float(loss), -picked[selected].sum(), rtol=1e-5)
  assert float(correct) == (logits.argmax(-1) == tokens)[selected].sum()
  assert (seen["inputs"] != tokens).any()              # the model saw the corrupted batch
  other = np.where(selected[..., None], logits, rng.normal(size=logits.shape) * 5)
  (loss2, _, _), _, _ = objective.score(lambda b: ({"inputs": jnp.asarray(other)}, {}),
                                        {"inputs": jnp.asarray(tokens)}, weights, key)
  np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)


def test_fine_tune_loads_every_encoder_parameter_and_no_lm_head(tmp_path, tiny_config):
  """Pretrain with the denoising objective, then fine-tune the classifier from it: every
  encoder parameter (the mask token's embedding row included) starts as the pretrain run's
  last checkpoint, compared one by one; the LM head is left behind and the classifier head
  is new."""
  pre = tiny_config(num_train_steps=10, objective="denoise", **{"model.mask_token": True})
  result = train.train_and_evaluate(pre, str(tmp_path / "pre"))
  assert 0.0 <= result["test"]["accuracy"] <= 1.0 and np.isfinite(result["test"]["loss"])
  ft = tiny_config(num_train_steps=2, init_from=str(tmp_path / "pre"),
                   **{"model.mask_token": True, "optim.learning_rate": 0.0})
  train.train_and_evaluate(ft, str(tmp_path / "ft"))
  flat = lambda p: flax.traverse_util.flatten_dict(p, sep="/")  # noqa: E731
  old, new = flat(checkpoint_params(tmp_path / "pre")), flat(checkpoint_params(tmp_path / "ft"))
  encoder = sorted(k for k in old if k.startswith("encoder/"))
  assert encoder and sorted(k for k in new if k.startswith("encoder/")) == encoder
  for name in encoder:
    np.testing.assert_array_equal(old[name], new[name], err_msg=name)
  assert any(k.startswith("lm_head/") for k in old)
  assert not any(k.startswith("lm_head/") for k in new)
  assert any(k.startswith("head/") for k in new) and not any(k.startswith("head/") for k in old)
  # the embedding has one more row than the vocabulary: the mask token
  assert old["encoder/embed/embedding"].shape[0] == new["encoder/embed/embedding"].shape[0]


def test_rotary_positions_are_relative():
  """Rotating q and k by their positions makes q.k depend on the offset only: shifting both
  positions by the same amount leaves every score unchanged, and a rotation keeps norms."""
  rng = np.random.default_rng(2)
  q, k = (jnp.asarray(rng.normal(size=(2, 12, 3, 8)), jnp.float32) for _ in range(2))
  positions = jnp.arange(12)
  scores = lambda shift: jnp.einsum(  # noqa: E731
      "bqhd,bkhd->bhqk", rotary(q, positions + shift), rotary(k, positions + shift))
  np.testing.assert_allclose(scores(0), scores(37), atol=1e-4)
  assert not np.allclose(scores(0), jnp.einsum("bqhd,bkhd->bhqk", q, k), atol=1e-2)
  np.testing.assert_allclose(jnp.linalg.norm(rotary(q, positions), axis=-1),
                             jnp.linalg.norm(q, axis=-1), rtol=1e-5)


def test_a_rotary_model_trains(tmp_path, tiny_config):
  """model.pos_emb="rotary": no position embedding added; q and k rotated in every layer."""
  result = train.train_and_evaluate(
      tiny_config(num_train_steps=4, **{"model.pos_emb": "rotary"}), str(tmp_path))
  assert np.isfinite(result["test"]["loss"])


def _conv_skip_reference(x, mask, params, heads, size):
  """float64 numpy: dense softmax attention (padded keys masked) plus the depthwise conv of the
  masked V along the length axis ('same' padding), then the output projection."""
  x = np.asarray(x, np.float64)
  proj = lambda name: np.einsum("ble,ehd->blhd", x,  # noqa: E731
                                np.asarray(params[name]["kernel"], np.float64))
  q, k, v = proj("query"), proj("key"), proj("value")
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  scores = np.where(mask[:, None, None, :], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", weights, v)
  kernel = np.asarray(params["value_conv_kernel"], np.float64)     # [size, heads]
  vm = np.where(mask[:, :, None, None], v, 0.0)
  half = size // 2
  padded = np.pad(vm, ((0, 0), (half, half), (0, 0), (0, 0)))
  for t in range(size):
    out += kernel[t][None, None, :, None] * padded[:, t:t + v.shape[1]]
  return np.einsum("blhd,hde->ble", out, np.asarray(params["out"]["kernel"], np.float64))


def test_value_conv_skip_is_a_depthwise_conv_of_v_added_to_attention(tiny_config):
  """model.value_conv_kernel: the attention layer's output is dense attention plus a per-head
  conv of the (padding-zeroed) values along the sequence, against a float64 numpy reference;
  the conv's kernel learns (a non-zero gradient)."""
  from lra_sparse.attention import parse_attention_config  # pylint: disable=import-outside-toplevel
  from lra_sparse.models import encoder  # pylint: disable=import-outside-toplevel
  config = tiny_config(**{"model.value_conv_kernel": 5, "attention.kind": "dense",
                          "attention.dense.implementation": "xla"})
  layer = encoder.MultiHeadAttention(config.model, parse_attention_config(config.attention), 24)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 24, 32)), jnp.float32)
  mask = np.ones((2, 24), bool)
  mask[1, 17:] = False
  params = layer.init(jax.random.key(0), x, jnp.asarray(mask), True)["params"]
  assert params["value_conv_kernel"].shape == (5, config.model.num_heads)
  got = layer.apply({"params": params}, x, jnp.asarray(mask), True)
  want = _conv_skip_reference(x, mask, params, config.model.num_heads, 5)
  np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=2e-4, atol=2e-4)
  # the conv is really there: without it the output differs by far more than the tolerance
  without = {k: v for k, v in params.items() if k != "value_conv_kernel"}
  plain = encoder.MultiHeadAttention(tiny_config(**{"attention.kind": "dense",
                                            "attention.dense.implementation": "xla"}).model,
                             parse_attention_config(config.attention), 24)
  assert np.abs(np.asarray(plain.apply({"params": without}, x, jnp.asarray(mask), True))
                - np.asarray(got))[mask].max() > 1e-2
  grad = jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x, jnp.asarray(mask), True)
                                    ** 2))(params)
  assert np.abs(np.asarray(grad["value_conv_kernel"])).min() > 0


@pytest.mark.parametrize("attention", [
    {"attention.kind": "dfss", "attention.dfss.nm": "2:4"},
    {"attention.kind": "dsa", "attention.dsa.sparsity": 0.5},
    {"attention.kind": "nystrom", "attention.nystrom.num_landmarks": 8,
     "attention.nystrom.nm": "", "attention.nystrom.conv_kernel": 0},
], ids=lambda a: a["attention.kind"])
def test_every_kind_trains_with_the_value_conv_skip(tmp_path, tiny_config, attention):
  """model.value_conv_kernel on the sparse kinds (Nystromformer with its own conv off): a few
  denoising steps to a finite loss, the conv kernel in every layer's parameters."""
  config = tiny_config(num_train_steps=3, objective="denoise",
                       **{"model.mask_token": True, "model.value_conv_kernel": 3, **attention})
  result = train.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(result["test"]["loss"])


@pytest.mark.parametrize("overrides,message", [
    ({"model.value_conv_kernel": 4}, "value_conv_kernel=4 must be 0"),
    ({"model.value_conv_kernel": -3}, "value_conv_kernel=-3 must be 0"),
    ({"model.value_conv_kernel": True}, "value_conv_kernel=True must be 0"),
    ({"model.value_conv_kernel": 3, "attention.kind": "nystrom", "attention.nystrom.nm": "",
      "attention.nystrom.conv_kernel": 35}, "Nystromformer has its own"),
])
def test_bad_value_conv_skip_is_one_clear_error(tiny_config, overrides, message):
  from lra_sparse.models import build_model  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=message):
    build_model(tiny_config(**overrides), model_kind="classifier", vocab_size=11, num_classes=2)


@pytest.mark.parametrize("attention", [
    {"attention.kind": "dfss", "attention.dfss.nm": "2:4"},
    {"attention.kind": "nystrom", "attention.nystrom.num_landmarks": 8,
     "attention.nystrom.nm": ""},
], ids=lambda a: a["attention.kind"])
def test_every_kind_pretrains_with_the_denoising_objective(tmp_path, tiny_config, attention):
  """The kinds the tiny spec leaves out (it runs dense and DSA end to end) train a few
  denoising steps to a finite loss, and the run records the objective and the kind."""
  result = train.train_and_evaluate(
      tiny_config(objective="denoise", num_train_steps=4, eval_every_steps=4,
                  **{"model.mask_token": True, **attention}), str(tmp_path))
  assert np.isfinite(result["test"]["loss"])
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["objective"] == "denoise" and config["attention"]["kind"] == attention[
      "attention.kind"]


def test_pathfinder_pretrains_and_fine_tunes_with_the_conv_long_fields(tmp_path):
  """The pixel path of the conv_pathfinder preset on a small generated Pathfinder-32 set
  (black pixels are holes in the key mask, pixel values the tokens): denoising with rotary
  positions and the conv skip on V trains to a finite loss above the chance of guessing one
  of 255 intensities, and the fine-tune starts from it and trains."""
  data = pathfinder_dir_with_cue(tmp_path / "pf")
  fields = {"data.data_dir": data, "model.num_layers": 1, "batch_size": 8,
            "model.mask_token": True, "model.pos_emb": "rotary",
            "model.value_conv_kernel": 35, "log_every_steps": 2, "eval_every_steps": 6,
            "checkpoint_every_steps": 6, "optim.warmup_steps": 2, "num_eval_batches": 2}
  pretrain = load_config_file(os.path.join(REPO, "configs", "pathfinder.py"), "tiny")
  pretrain.update_from_flattened_dict({**fields, "objective": "denoise",
                                       "num_train_steps": 6})
  result = train.train_and_evaluate(pretrain, str(tmp_path / "pre"))
  assert np.isfinite(result["test"]["loss"]) and result["test"]["accuracy"] > 1 / 255
  finetune = load_config_file(os.path.join(REPO, "configs", "pathfinder.py"), "tiny")
  finetune.update_from_flattened_dict({**fields, "num_train_steps": 6,
                                       "init_from": str(tmp_path / "pre")})
  result = train.train_and_evaluate(finetune, str(tmp_path / "ft"))
  assert np.isfinite(result["test"]["loss"])
  config = json.loads((tmp_path / "ft" / "config.json").read_text())
  assert config["objective"] == "classify" and config["init_from"] == str(tmp_path / "pre")


@pytest.mark.parametrize("overrides,message", [
    ({"objective": "mlm"}, "config.objective='mlm'"),
    ({"objective": "denoise"}, "set config.model.mask_token=True"),
    ({"objective": "denoise", "model.mask_token": True, "denoise.mask_rate": 0.0},
     "mask_rate must be > 0"),
    ({"denoise.mask_share": 0.9, "denoise.random_share": 0.2}, "must be at most 1"),
    ({"denoise.mask_rate": 1.5}, r"mask_rate=1.5 must be a number in \[0, 1\]"),
])
def test_bad_objective_fields_are_one_clear_error(tmp_path, tiny_config, overrides, message):
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(tiny_config(**overrides), str(tmp_path))


def test_self_pretraining_spec_runs_both_stages_end_to_end(tmp_path, monkeypatch, listops_dir):
  """experiments/specs/self_pretraining.py:tiny on a small generated ListOps set: dense and DSA
  (the tiny preset's kinds) pretrain with the denoising objective, then fine-tune the
  classifier from their own kind's pretrain run of the same seed (the classifier head new, the
  LM head left behind); each kind also trains from scratch on the fine-tune's exact config, and
  the table has a from-scratch and an SPT row per kind."""
  from lra_sparse import sweep as sweep_lib, tables  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(repo)
  spec = spec_on_data(tmp_path, "experiments/specs/self_pretraining.py", "tiny", listops_dir)
  root = tmp_path / "root"
  states = sweep_lib.run_sweep(spec, str(root), show_progress=False)
  assert len(states) == 6 and set(states.values()) == {"finished"}, states
  kinds = {}
  for name in states:
    config = json.loads((root / name / "config.json").read_text())
    stage = "scratch" if name.startswith("scratch-") else config["objective"]
    kinds.setdefault(config["attention"]["kind"], {})[stage] = (name, config)
  assert sorted(kinds) == ["dense", "dsa"]
  for kind, stages in kinds.items():
    (pre_name, pre), (_, ft), (_, scratch) = (stages["denoise"], stages["classify"],
                                              stages["scratch"])
    assert pre["model"]["mask_token"] and ft["model"]["mask_token"]
    assert ft["init_from"] == str(root / pre_name), (kind, ft["init_from"])
    assert scratch == dict(ft, init_from=""), kind     # the fine-tune's config, from scratch
    records = [json.loads(line) for line in
               (root / stages["classify"][0] / "metrics.jsonl").read_text().splitlines()]
    loaded = [r for r in records if r["split"] == "init_from"]
    assert loaded == [dict(loaded[0], fresh_params=4, unused_params=2)], (kind, loaded)
  text = tables.make_table(str(root), spec, "markdown",
                           report=tables.Reporter(echo=False))
  # 20 steps: a tiny run may still predict one class ("1 one-class")
  assert sum(re.search(r"\| \d+\.\d\d \(n=1(, 1 one-class)?(, Δ vs [^)]*)?\) \|$", line)
             is not None for line in text.splitlines()) == 4, text


@pytest.mark.parametrize("preset", ["curve", "conv_curve"])
def test_pretraining_curve_fine_tunes_each_length_from_its_own_pretrain_run(preset, tmp_path,
                                                                              monkeypatch):
  """self_pretraining.py:curve: every (kind, pretraining length) fine-tune starts from the
  pretrain run of that kind and length, whose warmup fits in it; :conv_curve the same on
  conv_long's recipe: each pretraining is conv_long's dense pretraining at its own length, each
  fine-tune conv_long's dense fine-tune but for init_from, and its table holds each fine-tune
  in its own row."""
  from lra_sparse import sweep as sweep_lib, tables  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(repo)
  runs = {run.name: run for run in sweep_lib.expand_sweep(
      sweep_lib.load_sweep(f"experiments/specs/self_pretraining.py:{preset}"), str(tmp_path))}
  if preset == "conv_curve":
    conv_long = {run.name: run for run in sweep_lib.expand_sweep(
        sweep_lib.load_sweep("experiments/specs/self_pretraining.py:conv_long"),
        str(tmp_path / "conv_long"))}
    pretrain_twin = conv_long["pretrain-listops__listops__dense__seed=0"].overrides
    finetune_twin = conv_long["finetune-listops-dense__listops-stable__seed=0"].overrides
    table = tables.load_table(f"experiments/specs/self_pretraining.py:{preset}")
    for run in runs.values():
      o = dict(run.overrides)
      if run.name.startswith("pretrain__"):
        steps = o["num_train_steps"]
        assert o == {**pretrain_twin, "num_train_steps": steps,
                     "optim.warmup_steps": min(1000, steps // 5)}, run.name
        continue
      assert {k: v for k, v in o.items() if k != "init_from"} == {
          k: v for k, v in finetune_twin.items() if k != "init_from"}, run.name
      held = [row.label for row in table.rows if _matches(row, o)]
      steps = re.fullmatch(r"finetune-dense-after-(\d+)__.*", run.name).group(1)
      assert held == [f"pretrained {steps} steps"] and _matches(table.columns[0], o), run.name
      without_conv = {k: v for k, v in o.items() if k != "model.value_conv_kernel"}
      assert not _matches(table.columns[0], without_conv), run.name
  finetunes = [run for run in runs.values() if run.name.startswith("finetune-")]
  from experiments.specs import self_pretraining as spec  # pylint: disable=import-outside-toplevel
  assert len(finetunes) == len(runs) // 2 == len(spec.CURVE_STEPS) * len(spec.CURVE_KINDS)
  for run in finetunes:
    kind, steps = re.fullmatch(r"finetune-(.+)-after-(\d+)__.*", run.name).groups()
    source = runs[os.path.basename(run.overrides["init_from"])]
    assert source.overrides["objective"] == "denoise"
    assert source.overrides["num_train_steps"] == int(steps)
    assert source.overrides["optim.warmup_steps"] <= int(steps) // 5 or \
        source.overrides["optim.warmup_steps"] == 1000
    assert source.overrides["attention.kind"] == run.overrides["attention.kind"]
    assert source.name.startswith(f"pretrain__listops__{kind}-{steps}__")


def _matches(selector, config) -> bool:
  return all(v(config.get(k)) if callable(v) else config.get(k) == v
             for k, v in selector.match.items())


@pytest.mark.parametrize("preset,finetune_table_preset", [
    ("pretrain_recipe", "pretrain_recipe_finetune"), ("long_finetune", "long_finetune"),
    ("conv_probe", "conv_probe")])
def test_recipe_presets_pretrain_fine_tune_and_train_from_scratch(preset, finetune_table_preset,
                                                                 tmp_path, monkeypatch):
  """self_pretraining.py:pretrain_recipe (and :long_finetune, a subset of its variants with a
  longer fine-tune): one denoising run per variant (same length and seed; dense variants and
  Nystromformer with and without its conv skip), each fine-tuned from its own pretraining with
  that pretraining's architecture and none of its pretraining-only fields, and each
  architecture from scratch on the fine-tune's exact config; every run lands in exactly one
  row of its table and in no row of the other table."""
  from experiments.specs import self_pretraining as spec  # pylint: disable=import-outside-toplevel
  from lra_sparse import sweep as sweep_lib, tables  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(repo)
  runs = sweep_lib.expand_sweep(
      sweep_lib.load_sweep(f"experiments/specs/self_pretraining.py:{preset}"), str(tmp_path))
  variants = {"pretrain_recipe": spec.RECIPE_VARIANTS, "conv_probe": spec.CONV_PROBE_VARIANTS,
              "long_finetune": [v for v in spec.RECIPE_VARIANTS
                                if v[0] in spec.LONG_FINETUNE_VARIANTS]}[preset]
  finetune_steps = (spec.RECIPE_FINETUNE_STEPS if preset == "pretrain_recipe" else
                    spec.LONG_FINETUNE_STEPS)
  assert len(variants) >= 2
  by_name = {run.name: run for run in runs}
  pretrains = [r for r in runs if r.name.startswith("pretrain__")]
  finetunes = [r for r in runs if r.name.startswith("finetune-")]
  scratches = [r for r in runs if r.name.startswith("scratch-")]
  assert len(pretrains) == len(finetunes) == len(variants)
  assert len(scratches) == len({arch for _, _, arch, _ in variants})
  assert len(runs) == len(by_name) == len(pretrains) + len(finetunes) + len(scratches)
  if preset == "conv_probe":
    assert all(r.overrides["model.value_conv_kernel"] == 35 for r in runs)
  if preset == "pretrain_recipe":
    assert all("model.value_conv_kernel" not in r.overrides for r in runs)
    assert sorted(r.overrides.get("attention.nystrom.conv_kernel", -1)
                  for r in pretrains)[-2:] == [0, 35]
  pretrain_table = tables.load_table(
      "experiments/specs/self_pretraining.py:"
      + ("conv_probe_pretrain_val" if preset == "conv_probe" else "pretrain_recipe"))
  finetune_table = tables.load_table(
      f"experiments/specs/self_pretraining.py:{finetune_table_preset}")
  assert (pretrain_table.split, finetune_table.split) == ("val", "test")
  arch_keys = {k for _, fields in spec.RECIPE_ARCHS.values() for k in fields} | {
      "attention.kind", "model.pos_emb"}
  arch = lambda overrides: {k: {"model.value_conv_kernel": 0, **overrides}.get(k)  # noqa: E731
                            for k in arch_keys}
  for run in runs:
    o = {"task": "listops", "model.value_conv_kernel": 0, **run.overrides}
    in_pretrain = [row.label for row in pretrain_table.rows if _matches(row, o)
                   and _matches(pretrain_table.columns[0], o)]
    in_finetune = [row.label for row in finetune_table.rows if _matches(row, o)
                   and _matches(finetune_table.columns[0], o)]
    # the same run with the conv skip on V flipped (on <-> off) lands in none of those rows
    flipped = {**o, "model.value_conv_kernel": 35 - o["model.value_conv_kernel"]}
    assert not [row.label for row in (*pretrain_table.rows, *finetune_table.rows)
                if _matches(row, flipped) and row.label in in_pretrain + in_finetune]
    if run in pretrains:
      assert (o["objective"], o["num_train_steps"], o["seed"]) == (
          "denoise", spec.RECIPE_STEPS, 0)
      assert o["attention.kind"] in ("dense", "nystrom")
      assert o["optim.warmup_steps"] <= spec.RECIPE_STEPS // 5
      assert (len(in_pretrain), in_finetune) == (1, []), (run.name, in_pretrain, in_finetune)
      continue
    assert (in_pretrain, len(in_finetune)) == ([], 1), (run.name, in_pretrain, in_finetune)
    assert (o["objective"], o["num_train_steps"]) == ("classify", finetune_steps)
    assert "optim.learning_rate" not in o and "model.dropout_rate" not in o
    if run in finetunes:
      source = by_name[os.path.basename(o["init_from"])]
      assert source in pretrains
      assert arch(source.overrides) == arch(o)
      assert in_finetune[0].endswith(" + SPT")
      label = run.name.split("__")[0].removeprefix("finetune-")
      assert source.name.startswith(f"pretrain__listops__{label}__")
    else:
      twins = [f for f in finetunes if arch(f.overrides) == arch(o)]
      assert twins
      for twin in twins:   # the fine-tune's exact config, without init_from
        assert {k: v for k, v in twin.overrides.items() if k != "init_from"} == run.overrides
      assert in_finetune[0].endswith(", from scratch")


@pytest.mark.parametrize("prefix", ["", "rotary_long_", "conv_long_", "conv_pathfinder_",
                                    "nystrom_pathx_"])
def test_main_tables_hold_each_run_once(prefix, tmp_path, monkeypatch):
  """self_pretraining.py's main sweep (and the long presets'): each pretrain run in exactly one row
  of the pretrain_val table and in no row of the accuracy table; each fine-tune and
  from-scratch run in exactly one row of the accuracy table (its own kind's "+ SPT" or
  "from scratch" row) and in no row of the pretrain_val table."""
  from lra_sparse import sweep as sweep_lib, tables  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(repo)
  main = prefix.removesuffix("_")
  runs = sweep_lib.expand_sweep(
      sweep_lib.load_sweep(f"experiments/specs/self_pretraining.py:{main}"), str(tmp_path))
  pretrain_val = tables.load_table(
      f"experiments/specs/self_pretraining.py:{prefix}pretrain_val")
  accuracy = tables.load_table(f"experiments/specs/self_pretraining.py:{main}")
  for run in runs:
    config = {"attention.dsa.sparsity": None, "attention.nystrom.nm": None,
              "model.value_conv_kernel": 0,
              "task": run.name.split("__")[1].split("-")[0], **run.overrides}
    rows = lambda table: [row.label for row in table.rows  # noqa: E731
                          if _matches(row, config) and any(_matches(c, config)
                                                           for c in table.columns)]
    stage = run.name.split("-")[0]
    assert len(rows(pretrain_val)) == (stage == "pretrain"), (run.name, rows(pretrain_val))
    hits = rows(accuracy)
    assert len(hits) == (stage != "pretrain"), (run.name, hits)
    if stage != "pretrain":
      assert hits[0].endswith(" + SPT" if stage == "finetune" else ", from scratch")
  # each "+ SPT" row shows its gain over its own from-scratch row, and each sparse kind's its
  # delta against dense with SPT
  labels = [row.label for row in accuracy.rows]
  for row in accuracy.rows:
    if row.label.endswith(" + SPT"):
      want = {"vs scratch": row.label.removesuffix(" + SPT") + ", from scratch"}
      dense = [label for label in labels
               if label.startswith("Transformer (dense)") and label.endswith(" + SPT")]
      if dense and not row.label.startswith("Transformer (dense)"):
        want["vs dense + SPT"] = dense[0]
      assert dict(row.versus) == want, row.label
    else:
      assert not row.versus, row.label


@pytest.mark.parametrize("preset", ["rotary_long", "conv_long", "conv_pathfinder"])
def test_long_presets_are_the_measured_recipe(preset, tmp_path, monkeypatch):
  """self_pretraining.py:rotary_long: rotary positions for the softmax kinds in both stages and
  from scratch (Nystromformer as measured: sinusoidal, its conv skip), the recipe study's
  pretraining length, the long fine-tune for fine-tunes and from-scratch rows, and each
  fine-tune from its own kind's pretraining of the same seed; :conv_long the same with the
  conv skip of 35 on V for the softmax kinds (and for no Nystromformer run, which has its
  own); :conv_pathfinder conv_long's fields on Pathfinder-32 at its own lengths (whole epochs,
  the config's warmup); no long preset's table holds another's runs."""
  from experiments.specs import self_pretraining as spec  # pylint: disable=import-outside-toplevel
  from lra_sparse import sweep as sweep_lib, tables  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(repo)
  runs = sweep_lib.expand_sweep(
      sweep_lib.load_sweep(f"experiments/specs/self_pretraining.py:{preset}"), str(tmp_path))
  by_name = {run.name: run for run in runs}
  assert len(runs) == 3 * len(spec.KINDS) * len(spec.SEEDS)
  tasks = {"rotary_long": "listops", "conv_long": "listops", "conv_pathfinder": "pathfinder32"}
  task = tasks[preset]
  config_file = {"listops": "configs/listops.py", "pathfinder32": "configs/pathfinder.py"}[task]
  pretrain_steps, finetune_steps = {
      "rotary_long": (2500, 10000), "conv_long": (2500, 10000),
      "conv_pathfinder": (10 * 312, 30 * 312)}[preset]
  others = {other: tables.load_table(f"experiments/specs/self_pretraining.py:{other}")
            for other in tasks if other != preset}
  for run in runs:
    o = run.overrides
    kind = re.search(rf"(?:__{task.removesuffix('32')}__|-{task}-)([^_]+)__", run.name).group(1)
    assert run.config.split(":")[0] == config_file, run.name
    softmax = o["attention.kind"] != "nystrom"
    assert (o.get("model.pos_emb") == "rotary") == softmax, run.name
    assert o.get("model.value_conv_kernel", 0) == (
        35 if softmax and preset != "rotary_long" else 0), run.name
    assert o["model.dtype"] == "bfloat16"
    # ListOps' rsqrt warmup: 1000 steps or a fifth of the stage; Pathfinder keeps its epoch
    assert o.get("optim.warmup_steps") == (
        None if task == "pathfinder32" else min(1000, o["num_train_steps"] // 5)), run.name
    if not run.name.startswith("pretrain-"):
      config = {"attention.dsa.sparsity": None, "attention.nystrom.nm": None,
                "model.value_conv_kernel": 0, "task": task.removesuffix("32"), **o}
      for other, table in others.items():
        held = [row.label for row in table.rows if _matches(row, config)
                and any(_matches(column, config) for column in table.columns)]
        # Nystromformer's runs are the same configs in every long preset of one task
        assert len(held) == (not softmax and tasks[other] == task), (run.name, other, held)
    if run.name.startswith("pretrain-"):
      assert (o["objective"], o["num_train_steps"]) == ("denoise", pretrain_steps)
      continue
    assert (o["objective"], o["num_train_steps"]) == ("classify", finetune_steps)
    if run.name.startswith("finetune-"):
      source = by_name[os.path.basename(o["init_from"])]
      assert source.name == (f"pretrain-{task}__{task.removesuffix('32')}__{kind}"
                             f"__seed={o['seed']}")
      twin = by_name[run.name.replace("finetune-", "scratch-", 1)]
      assert {k: v for k, v in o.items() if k != "init_from"} == twin.overrides


def test_slow_kinds_launch_first_on_parallel_slots(tmp_path, monkeypatch):
  """conv_long on parallel slots: DSA-90 (four times a DFSS 2:4 step on ListOps) starts its
  pretraining runs first, then its fine-tunes' and from-scratch runs outrank every other kind's
  runs; every run's cost is its steps times its kind's step cost."""
  from experiments.specs import self_pretraining as spec  # pylint: disable=import-outside-toplevel
  from lra_sparse import sweep as sweep_lib  # pylint: disable=import-outside-toplevel
  from lra_sparse.sweep.local import critical_path_work  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  runs = sweep_lib.expand_sweep(
      sweep_lib.load_sweep("experiments/specs/self_pretraining.py:conv_long"), str(tmp_path))
  work = critical_path_work(runs)
  order = [run.name for run in sorted(runs, key=lambda run: -work[run.name])]
  assert all("dsa90" in name for name in order[:9]), order[:9]
  assert all(name.startswith("pretrain-") for name in order[:3]), order[:3]
  for run in runs:
    kind = re.search(r"(?:__listops__|-listops-)([^_]+)__", run.name).group(1)
    assert run.cost == run.overrides["num_train_steps"] * spec.STEP_COST[kind], run.name
  assert spec.STEP_COST["dsa90"] > max(v for k, v in spec.STEP_COST.items() if k != "dsa90")


def test_dsa_from_dense_is_conv_long_with_the_dense_pretraining(tmp_path, monkeypatch):
  """self_pretraining.py:dsa_from_dense: conv_long's dense pretraining runs (same names and
  configs) and, per seed, conv_long's DSA-90 fine-tune config but for init_from, which names
  the dense pretraining of the same seed; its table holds those fine-tunes only (not the dense
  pretraining, not a DSA-90 run from scratch or from DSA's own pretraining)."""
  from lra_sparse import sweep as sweep_lib, tables  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  spec = "experiments/specs/self_pretraining.py"
  runs = {run.name: run for run in sweep_lib.expand_sweep(
      sweep_lib.load_sweep(f"{spec}:dsa_from_dense"), str(tmp_path / "a"))}
  conv_long = {run.name: run for run in sweep_lib.expand_sweep(
      sweep_lib.load_sweep(f"{spec}:conv_long"), str(tmp_path / "b"))}
  assert len(runs) == 6
  table = tables.load_table(f"{spec}:dsa_from_dense")
  assert [row.label for row in table.rows] == [
      "DSA-90 (sigma 0.25, mean-form L_MSE), rotary positions, conv skip of 35 on V + dense SPT"]
  for seed in (0, 1, 2):
    pretrain = runs[f"pretrain-listops__listops__dense__seed={seed}"]
    assert pretrain.overrides == conv_long[pretrain.name].overrides
    finetune = runs[f"finetune-listops-dsa90-from-dense__listops-stable__seed={seed}"]
    twin = conv_long[f"finetune-listops-dsa90__listops-stable__seed={seed}"]
    assert finetune.depends_on == [pretrain.name]
    assert finetune.overrides["init_from"] == pretrain.workdir
    assert ({k: v for k, v in finetune.overrides.items() if k != "init_from"}
            == {k: v for k, v in twin.overrides.items() if k != "init_from"})
    scratch = conv_long[f"scratch-listops-dsa90__listops-stable__seed={seed}"]
    config = {"task": "listops", "attention.dsa.sparsity": 0.9, **finetune.overrides}
    assert all(_matches(s, config) for s in (table.rows[0], table.columns[0]))
    for other in (pretrain, scratch):
      assert not _matches(table.rows[0], {"task": "listops", **other.overrides}), other.name


def test_pathx_preset_is_nystromformer_at_whole_epochs(tmp_path, monkeypatch):
  """self_pretraining.py:nystrom_pathx: Nystromformer alone on Path-X's LRA config, seed 0:
  pretraining, its fine-tune (from that pretraining) and the fine-tune's config from scratch,
  at whole epochs of 2500 steps with the config's warmup; the table's rows are those two."""
  from lra_sparse import sweep as sweep_lib, tables  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(repo)
  runs = {run.name: run for run in sweep_lib.expand_sweep(
      sweep_lib.load_sweep("experiments/specs/self_pretraining.py:nystrom_pathx"), str(tmp_path))}
  assert sorted(runs) == ["finetune-pathx-nystrom__pathx__seed=0",
                          "pretrain-pathx__pathx__nystrom__seed=0",
                          "scratch-pathx-nystrom__pathx__seed=0"]
  steps = {"pretrain": 10 * 2500, "finetune": 20 * 2500, "scratch": 20 * 2500}
  for name, run in runs.items():
    o = run.overrides
    assert run.config == "configs/pathx.py", name
    assert o["attention.kind"] == "nystrom" and "model.pos_emb" not in o, name
    assert o["num_train_steps"] == steps[name.split("-")[0]], name
    assert "optim.warmup_steps" not in o, name
    assert o["objective"] == ("denoise" if name.startswith("pretrain") else "classify"), name
  finetune = runs["finetune-pathx-nystrom__pathx__seed=0"].overrides
  assert os.path.basename(finetune["init_from"]) == "pretrain-pathx__pathx__nystrom__seed=0"
  assert ({k: v for k, v in finetune.items() if k != "init_from"}
          == runs["scratch-pathx-nystrom__pathx__seed=0"].overrides)
  table = tables.load_table("experiments/specs/self_pretraining.py:nystrom_pathx")
  assert [row.label for row in table.rows] == ["Nystromformer, from scratch",
                                               "Nystromformer + SPT"]
  assert [column.label for column in table.columns] == ["Path-X"]


def test_denoiser_predicts_every_input_of_a_dual_encoder_task(tiny_config):
  """Retrieval's two documents are both corrupted and predicted, through one shared encoder
  whose parameter paths are the classifier's (so a fine-tune loads them)."""
  from lra_sparse.models import build_model  # pylint: disable=import-outside-toplevel
  config = tiny_config(objective="denoise", **{"model.mask_token": True})
  config.model.dual_head = "lra"
  model = build_model(config, model_kind="dual_encoder", vocab_size=11, num_classes=2)
  tokens = np.random.default_rng(0).integers(1, 11, (2, 32)).astype(np.int32)
  batch = {"inputs1": tokens, "inputs2": tokens[::-1]}
  params = model.init(jax.random.key(0), batch, deterministic=True)["params"]
  out = model.apply({"params": params}, batch, deterministic=True)
  assert sorted(out) == ["inputs1", "inputs2"]
  assert all(v.shape == (2, 32, 11) and v.dtype == jnp.float32 for v in out.values())
  assert sorted(params) == ["encoder", "lm_head"]
  assert params["encoder"]["embed"]["embedding"].shape == (12, 32)   # + the mask token
  classifier = build_model(tiny_config(**{"model.mask_token": True}), model_kind="classifier",
                           vocab_size=11, num_classes=2)
  cparams = classifier.init(jax.random.key(0), {"inputs": tokens}, deterministic=True)["params"]
  shapes = lambda p: {k: v.shape for k, v in  # noqa: E731
                      flax.traverse_util.flatten_dict(p, sep="/").items()}
  assert shapes(cparams["encoder"]) == shapes(params["encoder"])
