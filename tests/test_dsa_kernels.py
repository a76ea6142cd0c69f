"""Tests of DSA's selection rule, its L_MSE and its kernels.

CPU: ``kernels.dsa.reference`` (the pure-JAX path) against the rule written again in float64 numpy
with
loops (``conftest.np_select``), ties, padding, bit packing, the Gram-matrix L_MSE against
the direct [L, L] form (values and gradients), and bad inputs.
CPU also: the kernel wrapper's padding extents (key and dO row) against a numpy loop.
GPU (marked ``gpu``): ``kernels.dsa.triton`` against the reference: the kernel's chosen set equal
bit
for bit, outputs and gradients close, every kernel output poisoned (NaN) before the call; with
padding, the kernels that skip it against the full loops, bit for bit.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lra_sparse.kernels.dsa import reference as ref
from lra_sparse.ops import softmax

from conftest import REPO, check_close, np_key_multiplier, np_select, rel_err  # np_select: float64 rule
from triton_cpu import interpreted_launch, interpreting, run_interpreted

try:  # registers the NaN-filled entry points of launch(..., poison=True) (GPU tests)
  import poisoned_kernels  # noqa: F401  pylint: disable=unused-import
except ImportError:   # no triton here: the GPU tests skip
  pass

HI = jax.lax.Precision.HIGHEST


def _mask(b, l, lengths, hole=None):
  mask = np.arange(l)[None, :] < np.asarray(lengths)[:, None]
  if hole is not None:
    mask[hole] = False
  return mask


def _preds(seed, shape, ints=False):
  rng = np.random.default_rng(seed)
  if ints:  # many exact ties in the integer scores
    return tuple(rng.integers(-1, 2, size=shape).astype(np.float32) for _ in range(2))
  return tuple(rng.normal(size=shape).astype(np.float32) for _ in range(2))


# ----------------------------------------------------------------------------- CPU: the rule
@pytest.mark.parametrize("vector,sparsity,selection,ints", [
    (1, 0.75, "topk", False), (1, 0.9, "topk", True), (4, 0.5, "topk", False),
    (8, 0.9, "topk", False), (1, 0.0, "topk", False), (4, 0.9, "threshold", False),
    (1, 0.9, "threshold", True)])
def test_reference_select_matches_numpy(vector, sparsity, selection, ints):
  b, l, h, r = 3, 40, 2, 7
  qp, kp = _preds(vector * 10 + int(ints), (b, l, h, r), ints)
  mask = _mask(b, l, [40, 27, 0], hole=(0, 5))       # a hole, end padding, an empty example
  scale = 1 / math.sqrt(16)
  ops = ref.selection_operands(jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(mask),
                               vector=vector, scale=scale)
  assert ops.q8.shape == (b, h, l // vector, 32) and ops.k8.shape == (b, h, l, 32)
  got = np.asarray(jax.jit(lambda ops: ref.reference_select(   # operands are a pytree
      ops, jnp.asarray(mask), sparsity=sparsity, selection=selection, threshold=0.05))(ops))
  want = np_select(qp, kp, mask, vector=vector, sparsity=sparsity, selection=selection,
                       threshold=0.05, scale=scale)
  np.testing.assert_array_equal(got, want)
  assert not got[2].any()                             # no real key: nothing kept
  assert not got[1][..., 27:].any() and not got[0][..., 5].any()   # padded keys never
  for bi, n_real, end in ((0, 39, 40), (1, 27, 27)):
    live = np.arange(l // vector) * vector < end     # groups past the last real token: none
    assert not got[bi][:, ~live].any() and live.all() == (bi == 0)
    if selection == "topk":
      need = max(1, math.ceil((1 - sparsity) * n_real - 1e-6))
      assert (got[bi].sum(-1)[:, live] == need).all()


def test_ties_go_to_the_lower_key_index():
  """Equal codes: the lowest key indices win (q~ = k~ = ones: every score ties)."""
  b, l, h, r = 1, 16, 1, 4
  ones = jnp.ones((b, l, h, r))
  ops = ref.selection_operands(ones, ones)
  keep = np.asarray(ref.reference_select(ops, sparsity=0.75))
  np.testing.assert_array_equal(keep[0, 0], np.tile(np.arange(l) < 4, (l, 1)))
  # Two distinct values: the larger ones first, then ties by index.
  k = np.ones((b, l, h, r), np.float32)
  k[0, [3, 9], 0] = 2.0
  ops = ref.selection_operands(ones, jnp.asarray(k))
  keep = np.asarray(ref.reference_select(ops, sparsity=0.75))[0, 0, 0]
  np.testing.assert_array_equal(np.flatnonzero(keep), [0, 1, 3, 9])


@pytest.mark.parametrize("vector", [1, 4])
def test_factored_selection_operands_group_before_projecting(vector):
  """LowRank(x, w) operands (DSA's (X P) W~) give the operands of the expanded Q~, K~: the
  group mean of x over a group's real rows, projected, is the group mean of Q~ (up to fp32
  rounding: at most a few int8 codes move by one)."""
  rng = np.random.default_rng(12 + vector)
  b, l, h, r = 2, 24, 3, 10
  x = jnp.asarray(rng.normal(size=(b, l, r)), jnp.float32)
  wq, wk = (jnp.asarray(rng.normal(size=(h, r, r)), jnp.float32) for _ in range(2))
  mask = jnp.asarray(_mask(b, l, [24, 13], hole=(0, slice(2, 7))))
  expand = lambda w: jnp.einsum("blr,hrk->blhk", x, w, precision=HI)  # noqa: E731
  got = ref.selection_operands(ref.LowRank(x, wq), ref.LowRank(x, wk), mask, vector=vector,
                               scale=0.125)
  want = ref.selection_operands(expand(wq), expand(wk), mask, vector=vector, scale=0.125)
  np.testing.assert_array_equal(np.asarray(got.k8), np.asarray(want.k8))
  moved = np.abs(np.asarray(got.q8, np.int32) - np.asarray(want.q8, np.int32))
  assert moved.max() <= 1 and np.mean(moved) < 0.01
  np.testing.assert_allclose(np.asarray(got.factor), np.asarray(want.factor), rtol=1e-5)
  assert got.q8.shape == (b, h, l // vector, ref.padded_rank(r))


def test_topk_algorithms_agree_on_the_rule():
  qp, kp = _preds(4, (2, 48, 2, 9), ints=True)
  ops = ref.selection_operands(jnp.asarray(qp), jnp.asarray(kp), vector=4)
  a, b = (np.asarray(ref.reference_select(ops, sparsity=0.8, topk_algorithm=alg))
          for alg in ("top_k", "radix"))
  np.testing.assert_array_equal(a, b)


def test_pack_unpack_bits_roundtrip():
  keep = np.random.default_rng(0).random((2, 3, 5, 70)) < 0.3
  words = ref.pack_bits(jnp.asarray(keep))
  assert words.shape == (2, 3, 5, 3) and words.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(ref.unpack_bits(words, 70)), keep)
  np.testing.assert_array_equal(np.asarray(ref.unpack_bits(words, 96))[..., 70:], False)
  word = np.asarray(ref.pack_bits(jnp.asarray(np.eye(32, dtype=bool)[31])))
  assert word.tolist() == [-2 ** 31]                   # bit 31 is the sign bit


def test_dropout_key_multiplier_matches_numpy_rule_and_its_statistics():
  """dfss_dropout.key_multiplier (what both DSA backends apply) against the rule in numpy, on
  a key length that is not a multiple of 8; over ~1M entries the drop share is the rate for
  each of the 8 keys of a Philox call alike, the factor averages 1 (unbiased), and adjacent
  keys and rows are uncorrelated (within 5 standard errors)."""
  from lra_sparse.ops import dropout as dd
  seed = np.array([-123456789, 987654321], np.int32)
  got = np.asarray(dd.key_multiplier(jnp.asarray(seed), 2, 3, 9, 70, 0.3))
  np.testing.assert_allclose(got, np_key_multiplier(seed, 2, 3, 9, 70, 0.3), rtol=1e-7)
  rate = 0.1
  mult = np.asarray(dd.key_multiplier(dd.seed_words(jax.random.PRNGKey(5)), 2, 4, 256, 512,
                                      rate))
  p = dd.threshold(rate) / 65536
  se = math.sqrt(p * (1 - p) / mult.size)
  assert abs(np.mean(mult == 0) - p) < 5 * se
  assert abs(np.mean(mult) - 1.0) < 5 * se / (1 - p)
  for slot in range(8):
    dropped = (mult[..., slot::8] == 0)
    assert abs(dropped.mean() - p) < 5 * math.sqrt(p * (1 - p) / dropped.size), slot
  d = (mult == 0).astype(np.float64)
  for a, c in ((d[..., :-1].ravel(), d[..., 1:].ravel()),
               (d[..., :-1, :].ravel(), d[..., 1:, :].ravel())):
    assert abs(np.corrcoef(a, c)[0, 1]) < 5 / math.sqrt(a.size)


def test_reference_with_dropout_matches_numpy_values_and_gradients():
  """attention_under_keep with attention dropout equals float64 numpy attention with the same
  Z: O = (A * Zs) V, dV = (A Zs)^T dO, dS = A * (Zs * dO V^T - rowsum), dQ = dS K / sqrt(d),
  dK = dS^T Q / sqrt(d); a row that keeps nothing gives zeros."""
  from lra_sparse.ops import dropout as dd
  rng = np.random.default_rng(11)
  b, l, h, d, rate = 2, 37, 2, 8, 0.25
  q, k, v, ct = (rng.normal(size=(b, l, h, d)) for _ in range(4))
  keep = rng.random((b, h, l, l)) < 0.4
  keep[1, :, 3] = False                      # a row that keeps nothing
  seed = dd.seed_words(jax.random.PRNGKey(9))
  f = lambda q, k, v: ref.attention_under_keep(   # noqa: E731
      q, k, v, jnp.asarray(keep), dropout_rate=rate, dropout_seed=seed)
  args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
  with jax.default_matmul_precision("highest"):
    out, vjp = jax.vjp(f, *args)
    grads = vjp(jnp.asarray(ct, jnp.float32))
  zs = np_key_multiplier(np.asarray(seed), b, h, l, l, rate)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
  s = np.where(keep, s, -np.inf)
  m = np.max(s, -1, keepdims=True)
  e = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
  a = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  want = np.einsum("bhqk,bkhd->bqhd", a * zs, v)
  dp = np.einsum("bqhd,bkhd->bhqk", ct, v) * zs
  ds = a * (dp - np.sum(dp * a, -1, keepdims=True))
  want_grads = (np.einsum("bhqk,bkhd->bqhd", ds, k) / math.sqrt(d),
                np.einsum("bhqk,bqhd->bkhd", ds, q) / math.sqrt(d),
                np.einsum("bhqk,bqhd->bkhd", a * zs, ct))
  assert rel_err(out, want) < 1e-5
  np.testing.assert_array_equal(np.asarray(out)[1, 3], 0.0)
  for got, w in zip(grads, want_grads):
    assert rel_err(got, w) < 1e-5
  assert 0.15 < np.mean(zs[keep] == 0) < 0.35


def _direct_mse(q, k, qp, kp, mask, normalization):
  """L_MSE from the [L, L] scores (fp32, full precision): the form the Gram one replaces."""
  a = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HI)
  c = jnp.einsum("bqhd,bkhd->bhqk", qp, kp, precision=HI)
  pairs = mask[:, None, :, None] & mask[:, None, None, :]
  total = jnp.sum(jnp.where(pairs, (a - c) ** 2, 0.0))
  if normalization == "eq6":
    return total / q.shape[0]
  count = jnp.sum(jnp.sum(mask, -1, dtype=jnp.float32) ** 2) * q.shape[2]
  return total / q.shape[-1] / count


@pytest.mark.parametrize("normalization", ["eq6", "scaled_mean"])
def test_gram_mse_matches_the_direct_form_and_its_gradients(normalization):
  rng = np.random.default_rng(3)
  b, l, h, d, r = 2, 33, 2, 8, 5
  q, k = (jnp.asarray(rng.normal(size=(b, l, h, d)), jnp.float32) for _ in range(2))
  qp, kp = (jnp.asarray(rng.normal(size=(b, l, h, r)), jnp.float32) for _ in range(2))
  mask = jnp.asarray(_mask(b, l, [33, 20], hole=(0, 3)))
  gram = lambda *a: ref.prediction_mse(*a, mask, normalization=normalization)  # noqa: E731
  direct = lambda *a: _direct_mse(*a, mask, normalization)                      # noqa: E731
  args = (q, k, qp, kp)
  assert float(gram(*args)) == pytest.approx(float(direct(*args)), rel=1e-5)
  for g1, g2 in zip(jax.grad(gram, argnums=(0, 1, 2, 3))(*args),
                    jax.grad(direct, argnums=(0, 1, 2, 3))(*args)):
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-4,
                               atol=1e-4 * float(jnp.max(jnp.abs(g2))))
  # Factored predictors (Q~_h = x w_h, as DSA's (X P) W~): the same value and gradients,
  # also w.r.t. the factors.
  x = jnp.asarray(rng.normal(size=(b, l, 7)), jnp.float32)
  wq, wk = (jnp.asarray(rng.normal(size=(h, 7, r)), jnp.float32) for _ in range(2))
  expand = lambda x, w: jnp.einsum("blr,hrk->blhk", x, w, precision=HI)      # noqa: E731
  low = lambda q, k, x, wq, wk: gram(q, k, ref.LowRank(x, wq), ref.LowRank(x, wk))  # noqa: E731
  full = lambda q, k, x, wq, wk: direct(q, k, expand(x, wq), expand(x, wk))  # noqa: E731
  fargs = (q, k, x, wq, wk)
  assert float(low(*fargs)) == pytest.approx(float(full(*fargs)), rel=1e-5)
  for g1, g2 in zip(jax.grad(low, argnums=range(5))(*fargs),
                    jax.grad(full, argnums=range(5))(*fargs)):
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-4,
                               atol=1e-4 * float(jnp.max(jnp.abs(g2))))
  # bf16 operands (the model's compute dtype) give the same value as their fp32 copies.
  half = [x.astype(jnp.bfloat16) for x in args]
  assert float(gram(*half)) == pytest.approx(
      float(direct(*[x.astype(jnp.float32) for x in half])), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("near", [False, True])
def test_gram_mse_on_a_gpu_matches_float64(near):
  """The GPU's three-pass bf16 Gram matmuls against float64 numpy, also when S~ ~ S (the
  terms cancel).  H100: the value is off by 1.4e-5 of sum_ij a_ij^2 with every matmul
  algorithm, fp32 included (the fp32 sums of the Frobenius products cancel); the gradients
  by 5e-4 (S~ ~ S) and 6e-6 (random) relative to float64."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(11 + near)
  b, l, h, d, r = 2, 300, 2, 64, 96
  q, k = (rng.normal(size=(b, l, h, d)).astype(np.float32) for _ in range(2))
  if near:   # Q~ K~^T = Q K^T + a small perturbation
    rot = np.linalg.qr(rng.normal(size=(d, d)))[0]
    qp = np.concatenate([q @ rot, 0.05 * rng.normal(size=(b, l, h, r - d))], -1)
    kp = np.concatenate([k @ rot, rng.normal(size=(b, l, h, r - d))], -1)
  else:
    qp, kp = (rng.normal(size=(b, l, h, r)) for _ in range(2))
  qp, kp = qp.astype(np.float32), kp.astype(np.float32)
  mask = _mask(b, l, [300, 211], hole=(0, slice(5, 9)))
  pairs = mask[:, None, :, None] & mask[:, None, None, :]
  a = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64))
  c = np.einsum("bqhd,bkhd->bhqk", qp.astype(np.float64), kp.astype(np.float64))
  want = np.sum(np.where(pairs, (a - c) ** 2, 0.0)) / b
  scale = np.sum(np.where(pairs, a ** 2, 0.0)) / b
  got = float(ref.prediction_mse(*(jnp.asarray(x) for x in (q, k, qp, kp)), jnp.asarray(mask)))
  assert abs(got - want) < 5e-5 * scale, (got, want, scale)
  grads = jax.grad(lambda *x: ref.prediction_mse(*x, jnp.asarray(mask)), argnums=(0, 2))(
      *(jnp.asarray(x) for x in (q, k, qp, kp)))
  diff = np.where(pairs, a - c, 0.0)                        # d/dq_i = 2 sum_j diff_ij k_j / b
  want_dq = 2 * np.einsum("bhqk,bkhd->bqhd", diff, k.astype(np.float64)) / b
  want_dqp = -2 * np.einsum("bhqk,bkhd->bqhd", diff, kp.astype(np.float64)) / b
  assert rel_err(grads[0], want_dq) < 2e-3, rel_err(grads[0], want_dq)
  assert rel_err(grads[1], want_dqp) < 2e-3, rel_err(grads[1], want_dqp)
  if not near:   # factored Q~_h = x w_h (the module's form)
    x = rng.normal(size=(b, l, 40)).astype(np.float32)
    wq, wk = (rng.normal(size=(h, 40, r)).astype(np.float32) for _ in range(2))
    # (x wq_h)(x wk_h)^T as two products: one 4-operand einsum loops over every index at once
    # (~1e12 steps here; the reason this test never finished).
    qf, kf = (np.einsum("bqr,hrk->bqhk", x.astype(np.float64), w.astype(np.float64))
              for w in (wq, wk))
    c = np.einsum("bqhk,bshk->bhqs", qf, kf)
    want = np.sum(np.where(pairs, (a - c) ** 2, 0.0)) / b
    got = float(ref.prediction_mse(jnp.asarray(q), jnp.asarray(k),
                                   ref.LowRank(jnp.asarray(x), jnp.asarray(wq)),
                                   ref.LowRank(jnp.asarray(x), jnp.asarray(wk)),
                                   jnp.asarray(mask)))
    assert abs(got - want) < 5e-5 * max(scale, np.sum(np.where(pairs, c ** 2, 0.0)) / b)


def test_bad_inputs_give_one_clear_error():
  from lra_sparse.kernels.dsa import triton as dsa_triton
  q = jnp.ones((1, 16, 1, 160), jnp.bfloat16)
  bits = jnp.zeros((1, 1, 16, 1), jnp.int32)
  with pytest.raises(ValueError, match="head_dim 160 not in"):
    dsa_triton.dsa_attention_triton(q, q, q, bits)
  q = jnp.ones((1, 18, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="length 18 is not a multiple of the column-vector size 4"):
    dsa_triton.dsa_attention_triton(q, q, q, bits, vector=4)
  q = jnp.ones((1, 16, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"bits must be int32 \(1, 1, 16, 1\)"):
    dsa_triton.dsa_attention_triton(q, q, q, jnp.zeros((1, 1, 16, 2), jnp.int32))
  ops = ref.selection_operands(jnp.ones((1, 16, 1, 4)), jnp.ones((1, 16, 1, 4)))
  for sparsity in (1.0, -0.1, 1.5):
    with pytest.raises(ValueError, match=rf"DSA sparsity {sparsity} must be in \[0, 1\)"):
      dsa_triton.select_bits(ops, sparsity=sparsity)
  with pytest.raises(ValueError, match="unknown DSA selection 'random'"):
    dsa_triton.select_bits(ops, selection="random")
  with pytest.raises(ValueError, match="predictor rank 0 not in"):
    ref.selection_operands(jnp.ones((1, 16, 1, 0)), jnp.ones((1, 16, 1, 0)))
  with pytest.raises(ValueError, match="length 18 is not a multiple of the column-vector size 8"):
    ref.selection_operands(jnp.ones((1, 18, 1, 4)), jnp.ones((1, 18, 1, 4)), vector=8)
  with pytest.raises(ValueError, match=r"vector 1 gives 64 \(use vector 4 or 8"):
    dsa_triton.dsa_attention_triton(q, q, q, bits, forward="gather")
  with pytest.raises(ValueError, match="DSA forward 'sparse' not in"):
    dsa_triton.dsa_attention_triton(q, q, q, bits, forward="sparse")
  long = jax.ShapeDtypeStruct((1, 32768, 1, 64), jnp.bfloat16)
  assert "length 32768 > 32767" in dsa_triton.unsupported_reason(long, long, vector=8,
                                                                 forward="gather")
  assert dsa_triton.unsupported_reason(long, long, vector=8) is None
  from lra_sparse.attention import DSAConfig   # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=r"dsa.forward='gather' needs vector 4 or 8"):
    DSAConfig(forward="gather")
  with pytest.raises(ValueError, match=r"dsa.forward='sparse' is not one of"):
    DSAConfig(forward="sparse", vector=8)
  auto = {(v, s): DSAConfig(vector=v, sparsity=s).kernel_forward()
          for v in (1, 4, 8) for s in (0.5, 0.9, 0.95, 0.99)}
  assert [k for k, f in auto.items() if f == "gather"] == [(4, 0.95), (4, 0.99), (8, 0.9),
                                                           (8, 0.95), (8, 0.99)]
  assert [DSAConfig(vector=v, selection="threshold").kernel_forward() for v in (1, 4, 8)] == [
      "tiles", "tiles", "gather"]
  assert DSAConfig(vector=8, forward="tiles").kernel_forward() == "tiles"


def test_backend_triton_without_a_gpu_is_one_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU only")
  from lra_sparse.attention import AttentionDims, DSAConfig, build_attention
  dims = AttentionDims(num_heads=2, head_dim=8, model_dim=16, length=32, dropout_rate=0.0)
  with pytest.raises(ValueError, match="backend='triton' but"):
    build_attention(DSAConfig(backend="triton"), dims)


def test_padding_extents_match_a_loop():
  """The kernel wrapper's key extents (EXT: one past the last real key) and dO row extents
  (ROWS: one past the last row with a non-zero dO in any head or column), against a loop."""
  from lra_sparse.kernels.dsa import triton as dsa_triton
  rng = np.random.default_rng(7)
  b, l, h, d = 6, 300, 2, 8
  mask = np.zeros((b, l), bool)
  mask[0] = True                                  # no padding
  mask[1, :170] = True                            # end padding
  mask[2, 64:250] = True                          # prefix padding (a whole key tile) and end
  mask[3, rng.random(l) < 0.3] = True             # holes
  mask[3, 280:] = False
  mask[5, 131] = True                             # a single real key; example 4: none
  do = rng.normal(size=(b, l, h, d)).astype(np.float32)
  do[~mask] = 0.0                                 # padded rows reach no loss
  do[0, 290:] = 0.0                               # nor do some real rows: at the end,
  do[1, 100:130] = 0.0                            # inside (ROWS stays at the last live row)
  do[1, 169] = 0.0                                # and on the last real row
  do[0, 289, 1, 3] = 0.0                          # a partly zero row stays live
  ext = np.asarray(dsa_triton._key_extent(jnp.asarray(mask), b, l))
  rows = np.asarray(dsa_triton._row_extent(jnp.asarray(do)))
  assert ext.dtype == np.int32 and rows.dtype == np.int32
  for i in range(b):
    assert ext[i] == max([j + 1 for j in range(l) if mask[i, j]], default=0), i
    assert rows[i] == max([j + 1 for j in range(l) if (do[i, j] != 0).any()], default=0), i
  assert ext.tolist() == [300, 170, 250, ext[3], 0, 132] and rows[:2].tolist() == [290, 169]
  assert rows[4] == 0 and rows[5] == 132
  np.testing.assert_array_equal(np.asarray(dsa_triton._key_extent(None, b, l)), l)
  # The dO the kernels read (cast to the operands' dtype) gives the same rows.
  assert np.asarray(dsa_triton._row_extent(jnp.asarray(do, jnp.bfloat16))).tolist() == \
      rows.tolist()
  # A mask of the wrong shape: one clear error, before any kernel runs.
  q = jnp.ones((2, 32, 1, 16), jnp.bfloat16)
  bits = jnp.zeros((2, 1, 32, 1), jnp.int32)
  with pytest.raises(ValueError, match=r"mask must be bool \[batch, length\] = \(2, 32\)"):
    dsa_triton.dsa_attention_triton(q, q, q, bits, mask=jnp.ones((2, 31), bool))
  with pytest.raises(ValueError, match=r"mask must be bool \[batch, length\] = \(2, 32\)"):
    dsa_triton.dsa_attention_triton(q, q, q, bits, mask=jnp.ones((32,), bool))


# ----------------------------------------------------------------------------- GPU: kernels
def _kernels():
  from lra_sparse.kernels.dsa import triton as dsa_triton
  if not dsa_triton.is_available() and not interpreting():
    pytest.skip("needs a GPU and jax_triton")
  return dsa_triton


def tf32_exact(x):
  """Multiples of 2^-6 in [-4, 4]: exact in TF32 (fp32 cases: only P / dS rounding remains)."""
  return jnp.clip(jnp.round(x * 64.0) / 64.0, -4.0, 4.0).astype(x.dtype)


TOL = {jnp.float32: 2e-3, jnp.bfloat16: 2e-2, jnp.float16: 1e-2}

GPU_CASES = [
    # dtype, batch, length, heads, head_dim, vector, sparsity, rank (sigma * 256), selection
    (jnp.bfloat16, 2, 130, 2, 64, 1, 0.75, 26, "topk"),
    (jnp.float32, 2, 257, 2, 32, 1, 0.9, 84, "topk"),
    (jnp.bfloat16, 2, 1000, 2, 64, 4, 0.95, 84, "topk"),
    (jnp.bfloat16, 2, 1000, 2, 64, 8, 0.99, 26, "topk"),
    (jnp.float32, 2, 1000, 1, 64, 8, 0.9, 26, "threshold"),
    (jnp.bfloat16, 2, 2048, 2, 64, 1, 0.99, 84, "topk"),
    (jnp.float32, 2, 2048, 1, 64, 4, 0.75, 26, "topk"),
    (jnp.bfloat16, 2, 2048, 2, 128, 8, 0.95, 84, "topk"),
    (jnp.bfloat16, 2, 257, 2, 48, 1, 0.9, 26, "threshold"),
    (jnp.float16, 2, 1000, 2, 16, 1, 0.5, 130, "topk"),
]


def _case_id(c):
  return (f"{jnp.dtype(c[0]).name}-B{c[1]}L{c[2]}H{c[3]}D{c[4]}-V{c[5]}-s{c[6]}-k{c[7]}-"
          f"{c[8]}")


# True in the interpreted tests (``_interpret``): the references run as one XLA program each.
_JIT_REFERENCES = False


def _attention_reference(keep, mult=None):
  """softmax(S over ``keep``) V in fp32 at full precision, a function of (q, k, v); keep bool
  [batch, heads, length, length]; mult: the dropout factors Z / (1 - rate) of every entry."""

  def f_ref(q, k, v, keep, mult):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    scores = softmax.attention_scores(q, k, precision=HI)
    probs = softmax.masked_softmax(jnp.where(keep, scores, -jnp.inf), keep)
    if mult is not None:
      probs = probs * mult
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=HI)

  f_ref = jax.jit(f_ref) if _JIT_REFERENCES else f_ref
  return lambda q, k, v: f_ref(q, k, v, keep, mult)


def _select_and_check(qp, kp, mask, vector, d, sparsity, selection, threshold=0.02):
  """(bits of the poisoned selection kernel, the reference's keep mask), checked equal."""
  dt = _kernels()
  ops = ref.selection_operands(qp, kp, mask, vector=vector, scale=d ** -0.5)
  bits = jax.jit(lambda ops: dt.select_bits(ops, mask, sparsity=sparsity, selection=selection,
                                            threshold=threshold, poison=True))(ops)
  want = ref.reference_select(ops, mask, sparsity=sparsity, selection=selection,
                              threshold=threshold)
  _check_bits(bits, want, qp.shape[1], vector, selection, mask)
  return bits, want


def _check_bits(bits, want, l, vector, selection, mask):
  """The kernel's bits (poisoned before the call) are the reference's chosen set, exactly."""
  b, h = want.shape[:2]
  w = -(-l // 32)
  assert bits.shape == (b, h, l // vector, w)
  got = np.asarray(ref.unpack_bits(bits, 32 * w))
  np.testing.assert_array_equal(got[..., :l], np.asarray(want))   # the chosen set, exactly
  assert not got[..., l:].any()                                    # no bit past the keys
  if selection == "topk":   # every live row group keeps keys
    live = np.asarray(ref.live_groups(mask, l // vector))[0]
    assert 0 < np.asarray(want)[0][:, live].sum(-1).min()


def _check_close(label, pairs, dtype):
  """Each (name, kernel result, reference) pair: no NaN, relative error below TOL[dtype]."""
  check_close(label, pairs, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("ints", [False, True])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_kernels_match_reference(case, ints):
  _check_kernels_against_reference(case, ints)


def np_key_lists(keep_groups, vector, block):
  """Each block of ``block`` query rows' kept keys, by numpy: {(bh, block index): [(key,
  mask of the block's groups that keep it), ...] in key order}; keep_groups bool [batch,
  heads, groups, L]."""
  keep = np.asarray(keep_groups)
  b, h, g, l = keep.shape
  per = block // vector
  lists = {}
  for bh in range(b * h):
    rows = keep[bh // h, bh % h]
    for t in range(-(-l // block)):
      part = rows[t * per:(t + 1) * per]
      masks = (part.astype(np.int64) << np.arange(len(part))[:, None]).sum(0)
      lists[bh, t] = [(j, int(masks[j])) for j in np.flatnonzero(masks)]
  return lists


def _check_key_lists(bits, want, ext, vector):
  """``key_lists`` (poisoned) gives numpy's lists of the reference's kept set; no slot past a
  block's count is written."""
  dt = _kernels()
  block = dt._tiles("gather", jnp.float32)[0]  # pylint: disable=protected-access
  slots, count = jax.jit(lambda bits, ext: dt.key_lists(bits, ext, vector=vector, block=block,
                                                        poison=True))(bits, ext)
  slots, count = np.asarray(slots), np.asarray(count)
  for (bh, t), pairs in np_key_lists(want, vector, block).items():
    n = count[bh, t]
    assert n == len(pairs), (bh, t, n, len(pairs))
    got = [(int(x) >> 16, int(x) & 0xFFFF) for x in slots[bh, t, :n]]
    assert got == pairs, (bh, t)
    assert (slots[bh, t, n:] == -1).all(), (bh, t)   # nothing written past the list


def _check_kernels_against_reference(case, ints, rate=0.0, forward="tiles"):
  """Selection bits exactly the reference's; out, dq, dk, dv against full-precision fp32 on
  those bits (outputs poisoned); a fully padded example gives zeros.  rate > 0: attention
  dropout, the reference multiplied by ``ops.dropout.key_multiplier`` of the same seed.
  forward "gather": the key lists checked against numpy too, then the gathered forward."""
  dt = _kernels()
  dtype, b, l, h, d, vector, sparsity, rank, selection = case
  seed = zlib.crc32(f"{_case_id(case)}-{ints}".encode()) % (2 ** 31)
  qp, kp = (jnp.asarray(x) for x in _preds(seed, (b, l, h, rank), ints))
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k, v, ct = (jax.random.normal(kk, (b, l, h, d), dtype) for kk in keys)
  if dtype == jnp.float32:
    q, k, v, ct = (tf32_exact(x) for x in (q, k, v, ct))
  n_real = int(l * 0.7) + 3
  mask = jnp.asarray(_mask(b, l, [n_real] * (b - 1) + [0], hole=(0, 1)))  # last: all padded
  bits, want = _select_and_check(qp, kp, mask, vector, d, sparsity, selection)
  drop = {}
  mult = None
  if rate:
    from lra_sparse.ops import dropout as dfss_dropout
    drop = dict(dropout_rate=rate, dropout_seed=dfss_dropout.seed_words(keys[0]))
    mult = dfss_dropout.key_multiplier(drop["dropout_seed"], b, h, l, l, rate)
    assert 0 < float(jnp.mean(mult == 0)) < 2 * rate
  f_ref = _attention_reference(ref.expand_groups(want, vector), mult)
  if forward == "gather":
    ext = dt._key_extent(mask, b, l)  # pylint: disable=protected-access
    _check_key_lists(bits, want, ext, vector)

  # The tie-heavy cases run the deterministic (two-kernel) backward, the others the one-pass.
  f_tri = jax.jit(lambda q, k, v: dt.dsa_attention_triton(q, k, v, bits, vector=vector,
                                                          deterministic=ints, poison=True,
                                                          forward=forward, **drop))
  out, vjp = jax.vjp(f_tri, q, k, v)
  want_out, vjp_ref = jax.vjp(f_ref, q, k, v)
  pairs = [("out", out, want_out)] + list(zip(("dq", "dk", "dv"), vjp(ct),
                                              vjp_ref(ct.astype(jnp.float32))))
  assert out.dtype == dtype and out.shape == q.shape
  _check_close(f"{_case_id(case)} ints={ints} rate={rate}", pairs, dtype)
  np.testing.assert_array_equal(np.asarray(out[-1].astype(jnp.float32)), 0.0)  # all padded
  if rate:   # the same seed gives the same output; another seed another one
    np.testing.assert_array_equal(np.asarray(f_tri(q, k, v)), np.asarray(out))
    other = dict(drop, dropout_seed=drop["dropout_seed"] + 1)
    again = dt.dsa_attention_triton(q, k, v, bits, vector=vector, forward=forward, **other)
    assert np.any(np.asarray(again) != np.asarray(out))


DROPOUT_CASES = [
    # GPU_CASES' fields, then the attention dropout rate
    (jnp.bfloat16, 2, 257, 2, 64, 1, 0.75, 26, "topk", 0.1),
    (jnp.float32, 2, 1000, 2, 32, 8, 0.9, 84, "topk", 0.3),
    (jnp.bfloat16, 2, 2048, 2, 128, 4, 0.95, 84, "threshold", 0.1),
    (jnp.float16, 2, 1000, 1, 48, 1, 0.5, 26, "topk", 0.2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: f"{_case_id(c[:-1])}-p{c[-1]}")
def test_kernels_with_dropout_match_reference_with_the_same_mask(case, deterministic):
  _check_kernels_against_reference(case[:-1], deterministic, rate=case[-1])


GATHER_CASES = [c for c in GPU_CASES if c[5] >= 4] + [
    (jnp.bfloat16, 2, 136, 2, 48, 8, 0.9, 26, "topk"),
    (jnp.float16, 2, 260, 2, 64, 4, 0.5, 130, "topk"),
]
GATHER_DROPOUT_CASES = [c for c in DROPOUT_CASES if c[5] >= 4]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GATHER_CASES + GATHER_DROPOUT_CASES,
                         ids=lambda c: _case_id(c[:9]) + (f"-p{c[9]}" if len(c) > 9 else ""))
def test_gather_forward_matches_reference(case):
  """The gathered forward (key lists, then the union's keys only) under the same checks, the
  backward kernels on its log-sum-exp; the deterministic backward on the tie-heavy cases."""
  _check_kernels_against_reference(case[:9], case[6] >= 0.95,
                                   rate=case[9] if len(case) > 9 else 0.0, forward="gather")


PAD_CASES = [
    # dtype, length, heads, head_dim, vector, sparsity, rank (sigma * 256), selection
    (jnp.bfloat16, 1000, 2, 64, 1, 0.9, 26, "topk"),
    (jnp.float32, 1000, 1, 32, 8, 0.75, 84, "threshold"),
    (jnp.bfloat16, 2048, 2, 128, 4, 0.95, 84, "topk"),
    (jnp.float16, 2048, 2, 48, 1, 0.99, 26, "topk"),
]


def _pad_case_id(c):
  return f"{jnp.dtype(c[0]).name}-L{c[1]}H{c[2]}D{c[3]}-V{c[4]}-s{c[5]}-k{c[6]}-{c[7]}"


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", PAD_CASES, ids=_pad_case_id)
def test_kernels_skip_padding_exactly(case, deterministic, monkeypatch):
  """Padded batches (LRA ListOps: real lengths 500..2000 of a 2000 window): the kernels stop
  at each example's last real key and, in the backward, at its last row with a non-zero dO.
  Against the reference as test_kernels_match_reference, and bit for bit against the same
  kernels over every key and row (no mask, ROWS = length): the skipped tiles add exactly 0."""
  _check_padding_skip(case, deterministic, monkeypatch, PAD_LAYOUT_GPU)


# Where the padding goes (positions for the GPU's 2000-long cases; the interpreted one scales
# them to its 320 keys): real lengths of the 4 examples, a hole in example 0, example 1's
# leading padded key tile and one padded key, the rows of example 0 whose dO is 0, and where
# example 1's rows with a non-zero dO end (before its last real key).
PAD_LAYOUT_GPU = dict(lengths=(None, 700, 90, 0), hole=slice(200, 260), lead=64, key=333,
                      dead_rows=slice(128, 256), live_end=600)
PAD_LAYOUT_INTERPRETED = dict(lengths=(None, 170, 40, 0), hole=slice(100, 130), lead=64,
                              key=150, dead_rows=slice(64, 128), live_end=140)


def _check_padding_skip(case, deterministic, monkeypatch, layout):
  dt = _kernels()
  dtype, l, h, d, vector, sparsity, rank, selection = case
  b = 4
  seed = zlib.crc32(f"pad-{_pad_case_id(case)}-{deterministic}".encode()) % (2 ** 31)
  qp, kp = (jnp.asarray(x) for x in _preds(seed, (b, l, h, rank)))
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k, v, ct = (jax.random.normal(kk, (b, l, h, d), dtype) for kk in keys)
  if dtype == jnp.float32:
    q, k, v, ct = (tf32_exact(x) for x in (q, k, v, ct))
  # Real lengths (layout): all, a prefix with a leading key tile and a key padded too, a short
  # one, none; a hole in 0.
  lengths = [l if n is None else n for n in layout["lengths"]]
  mask = _mask(b, l, lengths, hole=(0, layout["hole"]))
  mask[1, :layout["lead"]] = False
  mask[1, layout["key"]] = False
  # dO: 0 on padded rows (their outputs reach no loss) and on blocks of real rows: inside
  # example 0, and example 1's last real rows (its dO row extent < its key extent).
  live = mask.copy()
  live[0, layout["dead_rows"]] = False
  live[1, layout["live_end"]:] = False
  ct = jnp.where(jnp.asarray(live)[:, :, None, None], ct, 0).astype(dtype)
  mask = jnp.asarray(mask)
  bits, want = _select_and_check(qp, kp, mask, vector, d, sparsity, selection)
  assert np.asarray(dt._key_extent(mask, b, l)).tolist() == lengths
  assert np.asarray(dt._row_extent(ct)).tolist() == [l, layout["live_end"]] + lengths[2:]
  f_ref = _attention_reference(ref.expand_groups(want, vector))

  def attend(mask):
    f = jax.jit(lambda q, k, v: dt.dsa_attention_triton(
        q, k, v, bits, mask=mask, vector=vector, deterministic=deterministic, poison=True))
    out, vjp = jax.vjp(f, q, k, v)
    return [np.asarray(x.astype(jnp.float32)) for x in (out,) + vjp(ct)]

  got = attend(mask)
  want_out, vjp_ref = jax.vjp(f_ref, q, k, v)
  names = ("out", "dq", "dk", "dv")
  _check_close(f"pad {_pad_case_id(case)} det={deterministic}",
               zip(names, got, (want_out,) + vjp_ref(ct.astype(jnp.float32))), dtype)
  out, dq, dk, dv = got
  np.testing.assert_array_equal(out[-1], 0.0)                     # no real key: zeros
  np.testing.assert_array_equal(dk[~np.asarray(mask)], 0.0)       # padded keys: no gradient
  np.testing.assert_array_equal(dv[~np.asarray(mask)], 0.0)
  np.testing.assert_array_equal(dq[~live], 0.0)                   # rows with dO = 0: none

  # The full loops (every key tile, every query row), as the kernels ran before skipping.
  monkeypatch.setattr(dt, "_row_extent",
                      lambda do: jnp.full(do.shape[:1], do.shape[1], jnp.int32))
  full = attend(None)
  # One pass: dQ's fp32 atomics vary run to run.  And the two runs are two XLA programs (with
  # and without the mask) around the same kernels: in float32 the backward's row sums
  # delta = rowsum(dO * O), an XLA reduction, can round differently between them.  On an H100
  # that moved the last bits of dK once (one-pass kernel; 658 of 128k elements, 6e-6 absolute)
  # and of the deterministic kernels' dQ once (347 of 128k, 2.7e-6 absolute), both in the
  # float32 threshold case, for example 0, which has no padded tile to skip, while out matched
  # bit for bit.  So those gradients are held to a relative error far below the reference
  # tolerance (a skipped tile that mattered would move them by orders of magnitude more), and
  # out (and, in bf16, every deterministic gradient) bit for bit.
  if not deterministic:
    inexact = {"dq": 1e-4, "dk": 1e-5, "dv": 1e-5}
  elif dtype == jnp.float32:
    inexact = {"dq": 1e-5, "dk": 1e-5}
  else:
    inexact = {}
  for name, a, r in zip(names, got, full):
    if name in inexact:
      assert rel_err(a, r) < inexact[name], (name, rel_err(a, r))
    else:
      np.testing.assert_array_equal(a, r, err_msg=name)


def _module_runs(configs, length, lengths, dropout, seed):
  """{name: (out, state, grads)} of the DSA Flax core built from each ``configs[name]``
  (DSAConfig fields) on the same bf16 inputs with padding, grads of sum(out) + L_MSE w.r.t.
  the parameters and q, k, v; training (same dropout rng) when ``dropout``, else
  evaluation."""
  _kernels()
  from lra_sparse.attention import AttentionDims, DSAConfig, build_attention
  b, h, d, model = 2, 2, 64, 128
  dims = AttentionDims(num_heads=h, head_dim=d, model_dim=model, length=length,
                       dropout_rate=dropout)
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  q, k, v = (jax.random.normal(kk, (b, length, h, d), jnp.bfloat16) for kk in keys[:3])
  x = jax.random.normal(keys[3], (b, length, model), jnp.bfloat16)
  mask = jnp.asarray(_mask(b, length, lengths))
  results = {}
  for name, fields in configs.items():
    core = build_attention(DSAConfig(**fields), dims)
    params = core.init(keys[4], q, k, v, mask=mask, inputs=x)["params"]

    def loss(params, q, k, v, core=core):
      out, state = core.apply({"params": params}, q, k, v, mask=mask, inputs=x,
                              deterministic=not dropout, rngs={"dropout": keys[0]},
                              mutable=["aux_loss", "aux_metrics"])
      return jnp.sum(out.astype(jnp.float32)) + state["aux_loss"]["dsa_mse"][0], (out, state)

    (_, (out, state)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                          has_aux=True))(params, q, k, v)
    results[name] = (out, state, grads)
  return results


def _assert_close_trees(got, want, tol):
  for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(a.astype(jnp.float32), r.astype(jnp.float32)) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_module_paths_agree_on_a_gpu(dropout):
  """The Flax core on backend='triton' and 'reference': same outputs, MSE, hit rate and
  gradients (bf16, padding, V = 4); with attention dropout (training) both drop the same
  entries for the same rng."""
  common = dict(vector=4, sparsity=0.9)
  results = _module_runs({"gather": dict(common, backend="triton", forward="gather"),
                          "tiles": dict(common, backend="triton", forward="tiles"),
                          "reference": dict(common, backend="reference")},
                         256, [256, 150], dropout, seed=0)
  (o1, s1, g1), (o2, s2, g2) = results["tiles"], results["reference"]
  o3, _, g3 = results["gather"]
  assert rel_err(o3.astype(jnp.float32), o1.astype(jnp.float32)) < 1e-2
  _assert_close_trees(g3, g1, 1e-2)
  assert rel_err(o1.astype(jnp.float32), o2.astype(jnp.float32)) < 2e-2
  _assert_close_trees(g1, g2, 3e-2)
  if dropout:   # the hit rate is an evaluation metric: not computed while training
    return
  assert float(s1["aux_metrics"]["dsa_hit_rate"][0]) == float(s2["aux_metrics"]["dsa_hit_rate"][0])
  assert float(s1["aux_metrics"]["dsa_mse"][0]) == pytest.approx(
      float(s2["aux_metrics"]["dsa_mse"][0]), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_block_module_paths_agree_on_a_gpu(dropout):
  """granularity='block' on backend='triton' (tiles cut to the blocks, empty tiles skipped)
  and 'reference': same outputs and gradients (bf16, padding), the same hit rate and kept
  share in evaluation; with attention dropout both drop the same entries."""
  block = dict(granularity="block", block_size=64, sparsity=0.6)
  results = _module_runs({"triton": dict(block, backend="triton"),
                          "reference": dict(block, backend="reference")},
                         320, [320, 150], dropout, seed=1)
  (o1, s1, g1), (o2, s2, g2) = results["triton"], results["reference"]
  assert rel_err(o1.astype(jnp.float32), o2.astype(jnp.float32)) < 2e-2
  _assert_close_trees(g1, g2, 3e-2)
  if not dropout:
    for name in ("dsa_hit_rate", "dsa_kept_share"):
      assert float(s1["aux_metrics"][name][0]) == float(s2["aux_metrics"][name][0]), name
    assert 0.0 < float(s1["aux_metrics"]["dsa_kept_share"][0]) < 1.0


def test_float_selection_rule_of_older_runs_still_runs():
  """selection_rule='float' (the rule before the kernels; old config.json files read with it)
  ranks the float S~ the core sows, on the pure-JAX path."""
  from lra_sparse.attention import AttentionDims, DSAConfig, build_attention
  from lra_sparse.kernels.dsa import reference as dsa_ref
  b, l, h, d, model = 2, 32, 2, 8, 16
  dims = AttentionDims(num_heads=h, head_dim=d, model_dim=model, length=l, dropout_rate=0.0)
  keys = jax.random.split(jax.random.PRNGKey(1), 5)
  q, k, v = (jax.random.normal(kk, (b, l, h, d)) for kk in keys[:3])
  x = jax.random.normal(keys[3], (b, l, model))
  mask = jnp.asarray(_mask(b, l, [32, 20]))
  core = build_attention(DSAConfig(selection_rule="float", vector=4, sparsity=0.75), dims)
  params = core.init(keys[4], q, k, v, mask=mask, inputs=x)["params"]
  out, state = core.apply({"params": params}, q, k, v, mask=mask, inputs=x,
                          mutable=["intermediates", "aux_metrics"])
  predicted = state["intermediates"]["predicted_scores"][0]
  keep = np.asarray(dsa_ref.predicted_mask(predicted, mask=mask, sparsity=0.75, vector=4))
  s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64))
  s = np.where(keep, s / math.sqrt(d), -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  want = np.einsum("bhqk,bkhd->bqhd", p, np.asarray(v, np.float64))
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
  assert 0.0 < float(state["aux_metrics"]["dsa_hit_rate"][0]) <= 1.0
  with pytest.raises(ValueError, match="selection_rule='int4' is not one of"):
    DSAConfig(selection_rule="int4")


# ----------------------------------------------------------------------------- block rule
@pytest.mark.parametrize("block,length,vector", [(16, 100, 1), (32, 96, 8), (64, 130, 1),
                                                 (16, 64, 8)])
def test_block_bits_are_the_expanded_block_keep(block, length, vector):
  """``block_bits`` (what the kernels read) is ``pack_bits`` of the block rule's [L, L] keep,
  rows grouped by ``vector``, padded keys and holes excluded; built without the [L, L] array."""
  rng = np.random.default_rng(block + length)
  blocks = -(-length // block)
  keep_blocks = jnp.asarray(rng.random((2, 3, blocks, blocks)) < 0.4)
  mask = jnp.asarray(_mask(2, length, [length - 7, length // 2], hole=(0, 3)))
  bits = ref.block_bits(keep_blocks, block, length, mask, vector=vector)
  keep = np.asarray(ref.expand_blocks(keep_blocks, block, length, mask))
  assert bits.shape == (2, 3, length // vector, -(-length // 32)) and bits.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(ref.unpack_bits(bits, length)), keep[:, :, ::vector])
  assert not np.asarray(keep)[0, :, :, 3].any() and keep.any()       # the hole is never kept
  with pytest.raises(ValueError, match="vector 8 must divide block_size 16 and length 100"):
    ref.block_bits(keep_blocks, 16, 100, vector=8)


@pytest.mark.parametrize("block,length,rows,keys", [(64, 300, 64, 64), (64, 300, 32, 64),
                                                    (16, 100, 16, 32), (128, 260, 64, 64)])
def test_tile_lists_are_the_tiles_with_a_kept_entry(block, length, rows, keys):
  """``tile_lists`` gives each tile of ``rows`` query rows exactly the tiles of ``keys`` keys
  holding an entry of the expanded block keep (numpy, from the [L, L] array), in increasing
  order, and their count; with the block keep transposed, each key tile's query tiles."""
  rng = np.random.default_rng(block + length + rows)
  blocks = -(-length // block)
  keep_blocks = jnp.asarray(rng.random((2, 3, blocks, blocks)) < 0.3)
  keep = np.asarray(ref.expand_blocks(keep_blocks, block, length))
  padded = -(-length // rows) * rows, -(-length // keys) * keys
  grid = np.zeros((2, 3) + padded, bool)
  grid[:, :, :length, :length] = keep
  hits = grid.reshape(2, 3, padded[0] // rows, rows, padded[1] // keys, keys).any(axis=(3, 5))
  for transpose in (False, True):
    got = ref.tile_lists(jnp.swapaxes(keep_blocks, 2, 3) if transpose else keep_blocks, block,
                         length, *((keys, rows) if transpose else (rows, keys)))
    want = np.swapaxes(hits, 2, 3) if transpose else hits
    want = want.reshape((6,) + want.shape[2:])
    lists, count = (np.asarray(x) for x in got)
    assert lists.shape == want.shape and lists.dtype == np.int32 and count.dtype == np.int32
    np.testing.assert_array_equal(count, want.sum(-1))
    for i in np.ndindex(*want.shape[:2]):
      np.testing.assert_array_equal(lists[i][:count[i]], np.flatnonzero(want[i]))
  assert hits.any() and not hits.all()


def test_block_tiles_fit_one_block_and_skip():
  from lra_sparse.kernels.dsa import tiles as dsa_tiles  # pylint: disable=import-outside-toplevel
  for block, dtype in ((64, "bfloat16"), (32, "float32"), (16, "float16"), (128, "bfloat16")):
    overrides = dict(dsa_tiles.block_overrides(block, dtype))
    assert sorted(overrides) == sorted(dsa_tiles.ATTENTION_KERNELS)
    for kernel, t in overrides.items():
      default = dsa_tiles.tiles(kernel, dtype)
      cap = dsa_tiles.BLOCK_RULE_MAX_BM.get(kernel, default.bm)
      assert t.skip and t.bm == min(default.bm, block, cap) and t.bn == min(default.bn,
                                                                             max(32, block))
      assert block % t.bm == 0 and (max(32, block) % t.bn == 0)


def _check_block_kernels(case, deterministic, check_skip=True):
  """The block rule on the attention kernels as the model runs it (tiles cut to the blocks,
  each kernel visiting only its tile lists, ``ref.tile_lists``): out, dq, dk, dv against
  full-precision fp32 on the expanded keep (outputs poisoned), a fully padded example gives
  zeros, and (``check_skip``) the lists and the bit-test skip are exact: bit for bit the same
  kernels looping over every tile."""
  from lra_sparse.kernels.dsa import tiles as dsa_tiles  # pylint: disable=import-outside-toplevel
  dt = _kernels()
  dtype, b, l, h, d, block, sparsity, rate = case
  seed = zlib.crc32(f"block-{case}-{deterministic}".encode()) % (2 ** 31)
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  q, k, v, ct = (jax.random.normal(kk, (b, l, h, d), dtype) for kk in keys[:4])
  if dtype == jnp.float32:
    q, k, v, ct = (tf32_exact(x) for x in (q, k, v, ct))
  x = jax.random.normal(keys[4], (b, l, 24))
  wq, wk = (jax.random.normal(kk, (h, 24, 16)) for kk in keys[5:7])
  mask = jnp.asarray(_mask(b, l, [int(l * 0.7) + 3] * (b - 1) + [0], hole=(0, 1)))
  keep_blocks = ref.block_select(ref.LowRank(x, wq), ref.LowRank(x, wk), mask,
                                 block_size=block, sparsity=sparsity)
  kept = np.asarray(keep_blocks)[0]
  assert kept.any() and not kept.all()                  # some tiles to skip, some to compute
  vector = ref.block_vector(l)
  bits = ref.block_bits(keep_blocks, block, l, mask, vector=vector)
  drop, mult = {}, None
  if rate:
    from lra_sparse.ops import dropout as ops_dropout  # pylint: disable=import-outside-toplevel
    drop = dict(dropout_rate=rate, dropout_seed=ops_dropout.seed_words(keys[0]))
    mult = ops_dropout.key_multiplier(drop["dropout_seed"], b, h, l, l, rate)
  f_ref = _attention_reference(ref.expand_blocks(keep_blocks, block, l, mask), mult)
  tiles = dsa_tiles.block_overrides(block, jnp.dtype(dtype).name)

  def run(tiles, lists=True):
    return jax.jit(lambda q, k, v: dt.dsa_attention_triton(
        q, k, v, bits, mask=mask, vector=vector, deterministic=deterministic, poison=True,
        tiles=tiles, blocks=keep_blocks if lists else None, block_size=block, **drop))

  out, vjp = jax.vjp(run(tiles), q, k, v)
  want_out, vjp_ref = jax.vjp(f_ref, q, k, v)
  grads = vjp(ct)
  _check_close(f"block {case} det={deterministic}",
               [("out", out, want_out)] + list(zip(("dq", "dk", "dv"), grads,
                                                   vjp_ref(ct.astype(jnp.float32)))), dtype)
  np.testing.assert_array_equal(np.asarray(out[-1].astype(jnp.float32)), 0.0)  # all padded
  if not check_skip:
    return
  unskipped = tuple((name, dsa_tiles.Tiles(t.bm, t.bn, t.num_warps, t.num_stages, False))
                    for name, t in tiles)
  out_full, vjp_full = jax.vjp(run(unskipped, lists=False), q, k, v)
  out_bits, vjp_bits = jax.vjp(run(tiles, lists=False), q, k, v)
  for other in (out_full, out_bits):
    np.testing.assert_array_equal(np.asarray(other), np.asarray(out))
  if deterministic:     # the one-pass dQ sums by atomics: its last bits may vary
    for got, full, by_bits in zip(grads, vjp_full(ct), vjp_bits(ct)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(full))
      np.testing.assert_array_equal(np.asarray(by_bits), np.asarray(full))


BLOCK_CASES = [
    # dtype, batch, length, heads, head_dim, block_size, sparsity, dropout rate
    (jnp.bfloat16, 2, 2048, 2, 64, 64, 0.9, 0.0),
    (jnp.bfloat16, 2, 2000, 2, 64, 64, 0.95, 0.1),
    (jnp.float32, 2, 1000, 2, 32, 32, 0.75, 0.0),
    (jnp.float16, 2, 257, 2, 48, 16, 0.5, 0.1),
    (jnp.bfloat16, 2, 1024, 2, 128, 128, 0.75, 0.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{jnp.dtype(c[0]).name}-"
                         f"B{c[1]}L{c[2]}H{c[3]}D{c[4]}-block{c[5]}-s{c[6]}-p{c[7]}")
def test_block_rule_on_the_kernels_matches_reference(case, deterministic):
  _check_block_kernels(case, deterministic)


# ----------------------------------------------------------------------------- CPU: the source
INTERPRETED_CASES = [   # small: Triton's interpreter runs every program in numpy
    (jnp.float32, 2, 70, 2, 32, 1, 0.75, 26, "topk"),
    (jnp.bfloat16, 2, 96, 1, 64, 8, 0.9, 26, "threshold"),
    (jnp.float32, 2, 64, 1, 16, 4, 0.5, 84, "topk"),
]
INTERPRETED_DROPOUT_CASES = [
    (jnp.float32, 2, 70, 2, 32, 1, 0.5, 26, "topk", 0.3),
    (jnp.float32, 2, 96, 1, 16, 8, 0.75, 26, "threshold", 0.2),
]


# The reference functions the interpreted checks call, with their static arguments.
_REFERENCES = (
    ("selection_operands", ("vector", "scale")),
    ("reference_select", ("sparsity", "selection", "threshold", "topk_algorithm")),
    ("block_select", ("block_size", "sparsity", "selection", "threshold", "scale",
                      "topk_algorithm")),
    ("expand_groups", ("vector",)),
    ("expand_blocks", ("block_size", "length")),
    ("block_bits", ("block_size", "length", "vector")),
    ("unpack_bits", ("length",)),
)


def _interpret(monkeypatch):
  """Skips outside ``run_interpreted``'s subprocess; there, the kernels run under Triton's
  interpreter and the references of the checks (the same functions) each as one XLA program:
  run op by op, every new shape compiled some hundred small programs, most of these tests'
  time outside the interpreter."""
  if not interpreting():
    pytest.skip("runs under Triton's interpreter (test_kernel_source_on_the_cpu_...)")
  from lra_sparse.kernels.dsa import triton as dsa_triton  # pylint: disable=import-outside-toplevel
  from lra_sparse.ops import dropout  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(dsa_triton, "launch", interpreted_launch())
  for name, static in _REFERENCES:
    monkeypatch.setattr(ref, name, jax.jit(getattr(ref, name), static_argnames=static))
  monkeypatch.setattr(dropout, "key_multiplier",
                      jax.jit(dropout.key_multiplier, static_argnums=(1, 2, 3, 4, 5)))
  monkeypatch.setitem(globals(), "_JIT_REFERENCES", True)


def test_kernel_source_on_the_cpu_matches_reference():
  """The selection and attention kernels' Triton source, run by Triton's interpreter on the
  CPU (in a subprocess: ``triton_cpu``), through the same checks as the GPU test at small
  shapes (``test_interpreted_kernels``)."""
  run_interpreted(__file__, "test_interpreted_kernels or test_interpreted_dropout_kernels or "
                  "test_interpreted_gather or test_interpreted_padding_skip or "
                  "test_interpreted_block_rule")


@pytest.mark.parametrize("ints", [False, True])
@pytest.mark.parametrize("case", INTERPRETED_CASES, ids=_case_id)
def test_interpreted_kernels(monkeypatch, case, ints):
  _interpret(monkeypatch)
  _check_kernels_against_reference(case, ints)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", INTERPRETED_DROPOUT_CASES,
                         ids=lambda c: f"{_case_id(c[:-1])}-p{c[-1]}")
def test_interpreted_dropout_kernels(monkeypatch, case, deterministic):
  _interpret(monkeypatch)
  _check_kernels_against_reference(case[:-1], deterministic, rate=case[-1])


@pytest.mark.parametrize("deterministic", [False, True])
def test_interpreted_padding_skip(monkeypatch, deterministic):
  """The padding skip of the kernels (key tiles past an example's last real key, query tiles
  past its last row with a non-zero dO) against the reference and the full loops, under the
  interpreter, at 320 keys in 64-key tiles."""
  _interpret(monkeypatch)
  _check_padding_skip((jnp.float32, 320, 1, 16, 4, 0.75, 26, "topk"), deterministic,
                      monkeypatch, PAD_LAYOUT_INTERPRETED)


@pytest.mark.parametrize("case", [c for c in INTERPRETED_CASES if c[5] >= 4] +
                         [c for c in INTERPRETED_DROPOUT_CASES if c[5] >= 4],
                         ids=lambda c: _case_id(c[:9]) + (f"-p{c[9]}" if len(c) > 9 else ""))
def test_interpreted_gather(monkeypatch, case):
  _interpret(monkeypatch)
  _check_kernels_against_reference(case[:9], False, rate=case[9] if len(case) > 9 else 0.0,
                                   forward="gather")


@pytest.mark.parametrize("case,deterministic", [
    ((jnp.float32, 2, 96, 1, 16, 32, 0.5, 0.0), False),      # one-pass backward
    ((jnp.float32, 2, 80, 1, 16, 16, 0.5, 0.2), True)],      # dropout, two-kernel backward
                         ids=["block32", "block16-p0.2-det"])
def test_interpreted_block_rule(monkeypatch, case, deterministic):
  _interpret(monkeypatch)
  _check_block_kernels(case, deterministic, check_skip=not case[-1])   # once, without dropout


def _register_report(*args: str) -> dict:
  """(kernel, dropout) -> (stack bytes, STL, LDL) of the table ``benchmarks/dsa_kernel_registers``
  prints (head_dim 64, vector 8; sm_90a, compiled on the CPU) when run with ``args``."""
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.dsa_kernel_registers", "--head_dim=64", "--vector=8",
       *args], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  report = {}
  for line in result.stdout.split("\n\n")[-1].splitlines()[2:]:   # the table's rows
    kernel, rate, _, _, stack, spills, _ = (c.strip() for c in line.strip("|").split("|"))
    stl, ldl = spills.split(" / ")
    report[(kernel, float(rate))] = (int(stack), int(stl), int(ldl))
  return report


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("block_rule", [False, True], ids=["fine", "block-lists"])
def test_runtime_tiles_compile_for_hopper_without_spills(dtype, block_rule):
  """Every DSA attention kernel at the tile ``kernels.dsa.triton`` launches it with, with and
  without attention dropout, compiled for sm_90a on the CPU: ptxas spills nothing (no STL /
  LDL; the 128x64 forward with dropout spilled, hence its own "fwd_drop" tile); also the block
  rule's (tile lists and the skip test at its tiles; the one-pass backward with dropout
  spilled at 64 rows, hence ``tiles.BLOCK_RULE_MAX_BM``)."""
  pytest.importorskip("triton")
  report = _register_report(f"--dtype={dtype}", "--dropout=0,0.1",
                            *(["--block_rule"] if block_rule else []))
  kernels = ("dsa_fwd", "dsa_fwd_gather", "dsa_bwd_onepass", "dsa_bwd_dkdv", "dsa_bwd_dq")
  assert set(report) == {(kernel, rate) for kernel in kernels for rate in (0.0, 0.1)}
  for key, stats in report.items():
    assert stats == (0, 0, 0), (key, stats)


def test_register_report_sees_a_spill():
  """The check above sees a spill where there is one: the forward with dropout at 128x64."""
  pytest.importorskip("triton")
  report = _register_report("--dtype=bf16", "--kernels=dsa_fwd", "--dropout=0.1",
                            "--tiles=128:64:4:3")
  assert report[("dsa_fwd", 0.1)][1] > 0
