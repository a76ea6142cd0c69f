"""The model around the attention core: LRA's pixel padding mask and the retrieval heads."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lra_sparse import config as config_lib
from lra_sparse import train
from lra_sparse.attention import parse_attention_config
from lra_sparse.config import load_config_file
from lra_sparse.data import get_task
from lra_sparse.models import attention_for_masks, build_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDE = 8                                  # 8 x 8 "images": the model takes any length
KINDS = {
    "dense": {},
    "dfss": {"attention.dfss.nm": "2:4"},
    "dsa": {"attention.dsa.sparsity": 0.75},
    "nystrom": {"attention.nystrom.num_landmarks": 8},
}


def _image_model(kind: str, pooling: str, mask_black_pixels: bool = True):
  config = load_config_file(os.path.join(REPO, "configs", "image.py"), "tiny")
  config.update_from_flattened_dict({
      "data.max_length": SIDE * SIDE, "data.mask_black_pixels": mask_black_pixels,
      "model.pooling": pooling, "attention.kind": kind, **KINDS[kind]})
  config = config_lib.run_config(config)
  spec = get_task("image").spec(config)
  return train.make_model(config, spec), spec


def _images(mask_black_pixels: bool = True) -> np.ndarray:
  """Row 0 all black, row 1 half black (left half), row 2 without black pixels."""
  rng = np.random.default_rng(0)
  pixels = rng.integers(1, 256, (3, SIDE, SIDE))
  pixels[0] = 0
  pixels[1, :, :SIDE // 2] = 0
  tokens = pixels.reshape(3, -1) + (0 if mask_black_pixels else 1)
  return tokens.astype(np.int32)


def _moved_embedding(params, token: int):
  """params with the embedding of ``token`` moved by a random (not constant: LayerNorm would
  remove a constant shift) vector."""
  table = params["encoder"]["embed"]["embedding"]
  shift = np.random.default_rng(9).normal(size=table.shape[1]).astype(np.float32) * 3.0
  moved = jax.tree.map(lambda x: x, params)
  moved["encoder"]["embed"]["embedding"] = table.at[token].add(shift)
  return moved


def _compiled(model):
  """(init(tokens), logits_and_grads(params, tokens)), each compiled once for the model."""
  init = jax.jit(lambda tokens: model.init(jax.random.key(0), {"inputs": tokens},
                                           deterministic=True)["params"])

  @jax.jit
  def logits_and_grads(params, tokens):
    batch = {"inputs": tokens, "targets": jnp.arange(tokens.shape[0], dtype=jnp.int32)}

    def loss(params):
      logits, _ = model.apply({"params": params}, batch, deterministic=True,
                              mutable=["aux_loss", "aux_metrics"])
      rows = jnp.arange(tokens.shape[0])
      return jnp.sum(jax.nn.log_softmax(logits)[rows, batch["targets"]]), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, grads

  return init, lambda params, tokens: jax.tree.map(np.asarray, logits_and_grads(params, tokens))


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_black_pixels_are_padding_and_an_all_black_image_is_finite(kind, pooling):
  """LRA's inputs > 0 mask: black pixels are token 0 = padding. Whatever their embedding, the
  logits do not move (never attended to, never pooled); an all-black image gives finite
  logits and gradients (no real key at all with mean pooling; only CLS with CLS pooling)."""
  model, spec = _image_model(kind, pooling)
  assert spec.vocab_size == 256 and not spec.padding_at_end
  tokens = _images()
  init, logits_and_grads = _compiled(model)
  params = init(tokens)
  logits, grads = logits_and_grads(params, tokens)
  assert np.all(np.isfinite(logits))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
  # The embedding of token 0 gets no gradient and does not change the logits.
  np.testing.assert_array_equal(np.asarray(grads["encoder"]["embed"]["embedding"][0]), 0.0)
  moved_logits, _ = logits_and_grads(_moved_embedding(params, 0), tokens)
  np.testing.assert_allclose(moved_logits, logits, rtol=0, atol=1e-6)
  if pooling == "mean":
    # Nothing kept: the pooled features are zeros, so the logits are the head's at 0.
    head = params["head"]
    hidden = np.maximum(np.asarray(head["Dense_0"]["bias"], np.float64), 0.0)
    want = hidden @ np.asarray(head["Dense_1"]["kernel"], np.float64) + np.asarray(
        head["Dense_1"]["bias"], np.float64)
    np.testing.assert_allclose(logits[0], want, rtol=1e-5, atol=1e-6)


def test_without_masking_black_pixels_are_tokens():
  """mask_black_pixels=False: black is token 1, a real token whose embedding moves the logits."""
  model, spec = _image_model("dense", "mean", mask_black_pixels=False)
  assert spec.vocab_size == 257 and spec.padding_at_end
  tokens = _images(mask_black_pixels=False)
  init, logits_and_grads = _compiled(model)
  params = init(tokens)
  logits, _ = logits_and_grads(params, tokens)
  moved_logits, _ = logits_and_grads(_moved_embedding(params, 1), tokens)
  assert np.abs(moved_logits[:2] - logits[:2]).min() > 1e-3      # images with black pixels
  np.testing.assert_allclose(moved_logits[2], logits[2], atol=1e-6)  # the one without


def test_attention_with_holes_in_the_mask_gives_cudnn_a_bias():
  """cuDNN takes key padding as sequence lengths (padding at the end only): with holes "auto"
  gives it the mask as a bias (mask_holes, set by the builder, never a config field) and an
  explicit "cudnn" is refused."""
  base = config_lib.get_base_config().attention
  assert "mask_holes" not in base.dense and "mask_holes" not in base.nystrom
  auto = parse_attention_config(base)
  holes = attention_for_masks(auto, padding_at_end=False)
  assert (holes.implementation, holes.mask_holes) == ("auto", True)
  assert attention_for_masks(auto, padding_at_end=True) is auto and not auto.mask_holes
  base.dense.implementation = "cudnn"
  cudnn = parse_attention_config(base)
  assert attention_for_masks(cudnn, padding_at_end=True).implementation == "cudnn"
  with pytest.raises(ValueError, match=r"^config.attention.dense.implementation='cudnn' takes "
                                       r"key padding as sequence lengths [^\n]*$"):
    attention_for_masks(cudnn, padding_at_end=False)
  model, _ = _image_model("dense", "cls")
  assert model.attention_config.mask_holes
  base.kind = "nystrom"     # the Nystromformer's B V on cuDNN: the same rule
  nys = parse_attention_config(base)
  assert attention_for_masks(nys, padding_at_end=False).mask_holes
  assert attention_for_masks(nys, padding_at_end=True) is nys
  base.nystrom.implementation = "cudnn"
  with pytest.raises(ValueError, match=r"^config.attention.nystrom.implementation='cudnn' "):
    attention_for_masks(parse_attention_config(base), padding_at_end=False)
  base.kind = "dsa"
  dsa = parse_attention_config(base)
  assert attention_for_masks(dsa, padding_at_end=False) is dsa
  base.kind = "dense"
  base.dense.implementation = "auto"
  with base.unlocked():
    base.dense.mask_holes = True
  with pytest.raises(ValueError, match=r"config.attention.dense has no field\(s\) "
                                       r"\['mask_holes'\]"):
    parse_attention_config(base)


# ----------------------------------------------------------------------------- retrieval heads
def _retrieval_model(dual_head: str, preset: str = "tiny"):
  config = load_config_file(os.path.join(REPO, "configs", "retrieval.py"), preset)
  config.data.max_length = 16
  config.model.dual_head = dual_head
  config = config_lib.run_config(config)
  return train.make_model(config, get_task("retrieval").spec(config)), config


def _batch(vocab: int = 257, length: int = 16):
  rng = np.random.default_rng(3)
  tokens = rng.integers(1, vocab, (2, 4, length)).astype(np.int32)
  tokens[:, 1, 10:] = 0
  return {"inputs1": jnp.asarray(tokens[0]), "inputs2": jnp.asarray(tokens[1])}


def _features(model, variables, batch):
  _, state = model.apply(variables, batch, deterministic=True, capture_intermediates=True,
                         mutable=["intermediates"])
  outputs = state["intermediates"]["encoder"]["__call__"]
  return [np.asarray(x, np.float64) for x in outputs]        # u, v (shared encoder, 2 calls)


def test_lra_dual_head_is_classifier_head_dual():
  """concat[u, v] -> Dense(512) -> ReLU -> Dense(256) -> ReLU -> Dense(2) at LRA's sizes, and
  its values against numpy on a small model."""
  full, config = _retrieval_model("lra", preset="")
  shapes = jax.eval_shape(lambda: full.init(jax.random.key(0), _batch(), deterministic=True))
  head = shapes["params"]["head"]
  assert {name: head[name]["kernel"].shape for name in head} == {
      "mlp": (2 * 128, 512), "mlp2": (512, 256), "logits": (256, 2)}
  assert config.model.dual_head == "lra"

  model, _ = _retrieval_model("lra")
  batch = _batch()
  variables = model.init(jax.random.key(1), batch, deterministic=True)
  logits = np.asarray(model.apply(variables, batch, deterministic=True))
  u, v = _features(model, variables, batch)
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), variables["params"]["head"])
  hidden = np.maximum(np.concatenate([u, v], -1) @ p["mlp"]["kernel"] + p["mlp"]["bias"], 0)
  hidden = np.maximum(hidden @ p["mlp2"]["kernel"] + p["mlp2"]["bias"], 0)
  want = hidden @ p["logits"]["kernel"] + p["logits"]["bias"]
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_nli_one_hidden_head_is_kept_as_an_option():
  model, config = _retrieval_model("nli_one_hidden")
  batch = _batch()
  variables = model.init(jax.random.key(2), batch, deterministic=True)
  logits = np.asarray(model.apply(variables, batch, deterministic=True))
  u, v = _features(model, variables, batch)
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), variables["params"]["head"])
  assert p["Dense_0"]["kernel"].shape == (4 * config.model.emb_dim, config.model.classifier_dim)
  combined = np.concatenate([u, v, u * v, u - v], -1)
  hidden = np.maximum(combined @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"], 0)
  want = hidden @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_bad_dual_head_is_one_clear_error():
  config = config_lib.run_config(
      load_config_file(os.path.join(REPO, "configs", "retrieval.py"), "tiny"))
  config.model.dual_head = "concat"
  with pytest.raises(ValueError, match=r"^config.model.dual_head='concat'; choose one of "
                                       r"\('lra', 'nli_one_hidden'\) [^\n]*$"):
    train.make_model(config, get_task("retrieval").spec(config))
  missing = ml_collections.ConfigDict(config.to_dict())
  del missing.model["dual_head"]
  with pytest.raises(ValueError, match=r"^config.model.dual_head=None"):
    build_model(missing, model_kind="dual_encoder", vocab_size=257, num_classes=2)
