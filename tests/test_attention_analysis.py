"""L^p ticket quality (DFSS Definition 4.1), model capture and attention-map plots."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from lra_sparse.config import get_base_config
from lra_sparse import analysis
from lra_sparse.attention import AttentionDims, build_attention


def np_lp_quality(probs, keep, p, mask):
  powered = probs.astype(np.float64) ** p
  ratios = []
  for b in range(probs.shape[0]):
    for h in range(probs.shape[1]):
      for r in range(probs.shape[2]):
        if mask[b, r] and powered[b, h, r].sum() > 0:
          ratios.append(powered[b, h, r][keep[b, h, r]].sum() / powered[b, h, r].sum())
  return float(np.mean(ratios))


def test_lp_quality_matches_numpy_definition():
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(2, 2, 8, 8)).astype(np.float32)
  mask = np.arange(8)[None] < np.array([[8], [5]])
  probs = np.asarray(analysis.dense_probabilities(jnp.asarray(scores), jnp.asarray(mask)))
  keep = rng.random(size=scores.shape) < 0.4
  for p in (0.5, 1.0, 2.0):
    got = float(analysis.lp_quality(jnp.asarray(probs), jnp.asarray(keep), p=p,
                                    mask=jnp.asarray(mask)))
    assert got == pytest.approx(np_lp_quality(probs, keep, p, mask), rel=1e-5)
  full = np.ones(scores.shape, bool)
  assert float(analysis.lp_quality(jnp.asarray(probs), jnp.asarray(full), p=1.0,
                                   mask=jnp.asarray(mask))) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="p=0"):
    analysis.lp_quality(jnp.asarray(probs), jnp.asarray(keep), p=0)


def test_ticket_qualities_follow_proposition_4_2():
  """i.i.d. N(0, sigma) scores: Q^p of 1:2 and top-50% approach the closed forms."""
  sigma = 1.0
  rng = np.random.default_rng(1)
  scores = jnp.asarray(sigma * rng.normal(size=(1, 1, 64, 4096)).astype(np.float32))
  report = analysis.ticket_qualities(scores, p=(1.0, 2.0), nm=((1, 2), (2, 4)),
                                     topk_densities=(0.5,))
  for p in (1.0, 2.0):
    theory = analysis.proposition_4_2(p, sigma, density=0.5)
    assert report["dfss_1:2"][f"Q^{p:g}"] == pytest.approx(theory["1:2"], abs=0.02)
    assert report["topk_0.5"][f"Q^{p:g}"] == pytest.approx(theory["topk"], abs=0.02)
    assert report["topk_0.5"][f"Q^{p:g}"] >= report["dfss_2:4"][f"Q^{p:g}"] - 1e-6
    assert report["dfss_2:4"][f"Q^{p:g}"] >= report["dfss_1:2"][f"Q^{p:g}"] - 0.01
  for name in ("dfss_1:2", "dfss_2:4", "topk_0.5"):
    assert report[name]["density"] == pytest.approx(0.5)


class _TwoLayers(nn.Module):
  """A stand-in model: projections + a dense core and a DSA core, as the encoder calls them."""
  dims: AttentionDims

  @nn.compact
  def __call__(self, x, mask):
    config = get_base_config().attention
    for i, kind in enumerate(("dense", "dsa")):
      config.kind = kind
      config.dsa.sparsity = 0.75
      project = lambda name: nn.DenseGeneral((self.dims.num_heads, self.dims.head_dim),
                                             name=f"{name}_{i}")
      q, k, v = project("query")(x), project("key")(x), project("value")(x)
      out = build_attention(config, self.dims)(q, k, v, mask=mask, inputs=x,
                                               deterministic=True)
      x = x + nn.DenseGeneral(self.dims.model_dim, axis=(-2, -1), name=f"out_{i}")(out)
    return x


def test_model_capture_and_qualities():
  dims = AttentionDims(num_heads=2, head_dim=8, model_dim=16, length=32)
  model = _TwoLayers(dims)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(2, 32, 16)).astype(np.float32))
  mask = jnp.arange(32)[None] < jnp.array([[32], [20]])
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x, mask)
  assert "intermediates" not in variables   # init never stores DSA's predicted scores
  captured = analysis.capture_attention(model, {"params": variables["params"]}, x, mask)
  assert [c["kind"] for c in captured] == ["DenseAttention", "DSAAttention"]
  assert captured[0]["predicted_scores"] is None
  assert captured[1]["predicted_scores"].shape == (2, 2, 32, 32)
  want_q = np.einsum("bld,dhk->blhk", np.asarray(x),
                     np.asarray(variables["params"]["query_0"]["kernel"])) + np.asarray(
                         variables["params"]["query_0"]["bias"])
  np.testing.assert_allclose(np.asarray(captured[0]["q"]), want_q, rtol=1e-5, atol=1e-5)
  report = analysis.qualities_from_captures(captured)
  dsa_layer = report["layers"][f"1:{captured[1]['path']}"]
  assert "dsa_0.75" in dsa_layer
  assert "dsa_0.75" not in report["layers"][f"0:{captured[0]['path']}"]
  # ceil(0.25 * 32) = 8 of 32 keys and ceil(0.25 * 20) = 5 of 20: density 0.25.
  assert dsa_layer["dsa_0.75"]["density"] == pytest.approx(0.25, abs=1e-6)
  for entry in dsa_layer.values():
    assert 0.0 < entry["Q^1"] <= 1.0 + 1e-6
  assert report["mean"]["dfss_1:2"]["density"] == pytest.approx(0.5)


def test_plot_attention_maps_writes_png(tmp_path):
  rng = np.random.default_rng(3)
  q, k = (rng.normal(size=(2, 32, 2, 8)).astype(np.float32) for _ in range(2))
  mask = np.arange(32)[None] < np.array([[32], [24]])
  predicted = rng.normal(size=(2, 2, 32, 32)).astype(np.float32)
  for pred in (predicted, None):
    path = analysis.plot_attention_maps(str(tmp_path / "maps.png"), q, k, mask=mask, example=1,
                                        predicted_scores=pred)
    with Image.open(path) as image:
      assert image.format == "PNG" and image.size[0] > 800
