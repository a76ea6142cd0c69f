"""DSA's L_MSE on the Gram kernels (``lra_sparse.kernels.dsa.gram``).

CPU: the wrapper's algebra (the custom VJP's explicit gradients, padding, the normalisations)
with each Triton kernel stood in for by numpy code of its documented contract, against the
XLA Gram form's autodiff (``kernels.dsa.reference.prediction_mse``) and the direct [L, L] form. 
Also
bad inputs.  GPU (marked): the kernels themselves against float64 numpy.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lra_sparse.kernels.dsa import gram as dsa_gram
from lra_sparse.kernels.dsa import reference as ref
from triton_cpu import interpreted_launch, interpreting, run_interpreted

jax.config.update("jax_enable_x64", False)


def _real(km, ext, has_mask, length):
  """bool [b, L]: the rows the kernels count (before the extent; unmasked with a mask)."""
  rows = np.arange(length)[None, :] < np.asarray(ext)[:, None]
  return rows & (np.asarray(km) != 0) if has_mask else rows


def _stand_in(kernel, args, out_shapes, grid, **kw):
  """The four kernels' contracts in float64 numpy, including their padded output widths and
  the (hi, lo) parts of their operands (lo unread for an exact X)."""
  from lra_sparse.kernels.dsa import gram_kernels  # pylint: disable=import-outside-toplevel
  assert kernel in (gram_kernels.gram_fwd, gram_kernels.gram_fwd_xp, gram_kernels.gram_bwd_qk,
                    gram_kernels.gram_bwd_xp), kernel
  kernel = kernel.__name__
  d, rp, = kw.get("D"), kw["RP"]
  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  join = lambda hi, lo, exact=False: f64(hi) + (0.0 if exact else f64(lo))  # noqa: E731
  exact = kw.get("X_EXACT", False)
  for x in args:   # every array operand is bf16 parts, fp32 / int32 outside the parts
    assert isinstance(x, int) or x.dtype in (jnp.bfloat16, jnp.int32), (kernel, x.dtype)

  def widen(x, axis, width):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - x.shape[axis])
    return np.pad(x, pad)

  if kernel == "gram_fwd":
    qh, ql, kh, kl, xph, xpl, km, ext, length = args
    assert (kw["H"], kw["D0"], kw["R0"]) == qh.shape[2:] + xph.shape[2:]
    live = _real(km, ext, kw["HAS_MASK"], length)[:, :, None, None]
    q, k = (widen(np.where(live, join(*x, exact), 0), 3, d) for x in ((qh, ql), (kh, kl)))
    xp = widen(np.where(live[..., 0], join(xph, xpl), 0), 2, rp)
    g = np.stack([np.einsum("blhd,blhe->bhde", x, x) for x in (q, k)], 2)
    c = np.stack([np.einsum("blhd,blr->bhdr", x, xp) for x in (q, k)], 2)
    return tuple(jnp.asarray(x.reshape(s.shape), s.dtype) for x, s in zip((g, c), out_shapes))
  if kernel == "gram_fwd_xp":
    xph, xpl, km, ext, length = args
    live = _real(km, ext, kw["HAS_MASK"], length)[:, :, None]
    xp = widen(np.where(live, join(xph, xpl), 0), 2, rp)
    return (jnp.asarray(np.einsum("blr,bls->brs", xp, xp), jnp.float32),)
  if kernel == "gram_bwd_qk":
    qh, ql, kh, kl, xph, xpl, km, ext, ah, al, mh, ml, length = args
    h, d0 = kw["H"], kw["D0"]
    b = qh.shape[0]
    live = _real(km, ext, kw["HAS_MASK"], length)[:, :, None, None]
    a, m = join(ah, al).reshape(b, h, 2, d, d), join(mh, ml).reshape(b, h, 2, rp, d)
    xpw = widen(join(xph, xpl), 2, rp)
    outs = []
    for side, x in enumerate(((qh, ql), (kh, kl))):
      out = (np.einsum("blhd,bhde->blhe", widen(join(*x, exact), 3, d), a[:, :, side])
             + np.einsum("blr,bhrd->blhd", xpw, m[:, :, side]))[..., :d0]
      outs.append(jnp.asarray(np.where(live, out, 0), out_shapes[side].dtype))
    return tuple(outs)
  if kernel == "gram_bwd_xp":
    qh, ql, kh, kl, xph, xpl, km, ext, nh, nl, ph, pl, rh, rl, length = args
    h, r0 = kw["H"], kw["R0"]
    b = qh.shape[0]
    live = _real(km, ext, kw["HAS_MASK"], length)[:, :, None]
    p, r = join(ph, pl).reshape(b, h, d, rp), join(rh, rl).reshape(b, h, d, rp)
    out = (np.einsum("blr,brs->bls", widen(join(xph, xpl), 2, rp), join(nh, nl))
           + np.einsum("blhd,bhdr->blr", widen(join(qh, ql, exact), 3, d), p)
           + np.einsum("blhd,bhdr->blr", widen(join(kh, kl, exact), 3, d), r))[..., :r0]
    return (jnp.asarray(np.where(live, out, 0), jnp.float32),)
  raise AssertionError(kernel)


def _mask(b, l, lengths, hole=None):
  mask = np.arange(l)[None, :] < np.asarray(lengths)[:, None]
  if hole is not None:
    mask[hole] = False
  return mask


def _operands(rng, b, l, h, d, r, dtype=jnp.float32):
  q, k = (jnp.asarray(rng.normal(size=(b, l, h, d)), dtype) for _ in range(2))
  xp = jnp.asarray(rng.normal(size=(b, l, r)), jnp.float32)
  wq, wk = (jnp.asarray(rng.normal(size=(h, r, r)) / np.sqrt(r), jnp.float32) for _ in range(2))
  return q, k, xp, wq, wk


def _reference(q, k, xp, wq, wk, mask, normalization):
  return ref.prediction_mse(q.astype(jnp.float32), k.astype(jnp.float32),
                            ref.LowRank(xp, wq), ref.LowRank(xp, wk), mask,
                            normalization=normalization)


@pytest.mark.parametrize("normalization", ["eq6", "scaled_mean"])
@pytest.mark.parametrize("shape,masking", [
    ((2, 40, 3, 8, 5), "holes"),        # odd widths: D 8 -> 16, r 5 -> 16
    ((3, 33, 2, 20, 36), "padding"),    # an example with no real token; r 36 -> 64
    ((1, 17, 1, 16, 16), None),
])
def test_custom_vjp_matches_autodiff_of_the_gram_form(monkeypatch, normalization, shape,
                                                      masking):
  """Value and the gradients w.r.t. q, k, xp, w_q, w_k of the kernel path's custom VJP (each
  kernel stood in for by numpy) equal autodiff of the XLA Gram form."""
  monkeypatch.setattr(dsa_gram, "launch", _stand_in)
  rng = np.random.default_rng(sum(shape))
  b, l, h, d, r = shape
  args = _operands(rng, b, l, h, d, r)
  mask = {None: None, "holes": _mask(b, l, [l, 25], hole=(0, slice(3, 9))),
          "padding": _mask(b, l, [l, 0, 7])}[masking]
  mask = None if mask is None else jnp.asarray(mask)
  got = functools.partial(dsa_gram.prediction_mse, mask=mask, normalization=normalization)
  want = functools.partial(_reference, mask=mask, normalization=normalization)
  assert float(got(*args)) == pytest.approx(float(want(*args)), rel=1e-5)
  g_got = jax.grad(got, argnums=range(5))(*args)
  g_want = jax.grad(want, argnums=range(5))(*args)
  for name, x, y in zip(("q", "k", "xp", "w_q", "w_k"), g_got, g_want):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4,
                               atol=2e-4 * float(jnp.max(jnp.abs(y))), err_msg=name)
  if mask is not None:     # padded rows get exactly zero gradients
    dead = ~np.asarray(mask)
    for x in g_got[:3]:
      assert np.all(np.asarray(x)[dead] == 0)


def test_bf16_operands_keep_their_dtype(monkeypatch):
  monkeypatch.setattr(dsa_gram, "launch", _stand_in)
  rng = np.random.default_rng(4)
  q, k, xp, wq, wk = _operands(rng, 2, 24, 2, 16, 12, jnp.bfloat16)
  mask = jnp.asarray(_mask(2, 24, [24, 13]))
  dq, dk, dxp = jax.grad(lambda q, k, xp: dsa_gram.prediction_mse(q, k, xp, wq, wk, mask),
                         argnums=(0, 1, 2))(q, k, xp)
  assert dq.dtype == dk.dtype == jnp.bfloat16 and dxp.dtype == jnp.float32
  want = jax.grad(lambda q: _reference(q, k, xp, wq, wk, mask, "eq6"))(q.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(dq, np.float32), np.asarray(want), rtol=2e-2,
                             atol=2e-2 * float(jnp.max(jnp.abs(want))))


def test_bad_inputs_give_one_clear_error():
  rng = np.random.default_rng(5)
  q, k, xp, wq, wk = _operands(rng, 2, 16, 2, 8, 4)
  cases = [
      (dict(normalization="sum"), r"^unknown DSA MSE normalization 'sum'"),
      (dict(k=k.astype(jnp.bfloat16)), r"^q and k must be \[batch, length, heads, head_dim\]"),
      (dict(q=jnp.zeros((2, 16, 2, 130)), k=jnp.zeros((2, 16, 2, 130))),
       r"^head_dim 130 not in \[1, 128\]$"),
      (dict(xp=jnp.zeros((2, 16, 300))), r"^xp must be \[batch, length, r\] = \(2, 16, r <= 256"),
      (dict(w_k=wk[:1]), r"^w_k must be \[heads, r, k\] = \(2, 4, k\)"),
      (dict(mask=jnp.ones((2, 15), bool)), r"^mask must be bool \[batch, length\] = \(2, 16\)"),
  ]
  base = dict(q=q, k=k, xp=xp, w_q=wq, w_k=wk)
  for change, message in cases:
    kw = {**base, **change}
    normalization = kw.pop("normalization", "eq6")
    with pytest.raises(ValueError, match=message):
      dsa_gram.prediction_mse(kw.pop("q"), kw.pop("k"), kw.pop("xp"), kw.pop("w_q"),
                              kw.pop("w_k"), kw.pop("mask", None), normalization=normalization)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape,near", [
    ((2, 300, 2, 64, 128), False),
    ((2, 300, 2, 64, 128), True),      # S~ ~ S: the terms cancel
    ((3, 257, 3, 20, 26), False),      # odd head dim and rank (sigma 0.1 of 256)
    ((2, 130, 2, 128, 169), False),    # the widest tiles: rank 0.33 x 512
])
def test_gram_kernels_match_float64(dtype, shape, near):
  """The kernels' value and every gradient (q, k, the shared projection, both predictor
  weights) against float64 numpy of the direct [L, L] form, with padding and a hole;
  gradients of padded rows exactly 0."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  _check_against_float64(dtype, shape, near)


def test_gram_kernel_source_on_the_cpu_matches_float64():
  """The Triton source itself, run by Triton's interpreter on the CPU (in a subprocess: see
  ``triton_cpu``), through the wrapper's custom VJP, with outputs starting as NaN: the GPU
  test's checks at small shapes (``test_interpreted_gram_kernels``)."""
  run_interpreted(__file__, "test_interpreted_gram_kernels")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape,near", [
    ((2, 70, 2, 64, 128), True),       # S~ ~ S; two row blocks, the second partly padded
    ((3, 67, 3, 20, 26), False),       # odd head dim and rank: padded columns
    ((2, 40, 1, 128, 169), False),     # the wide tiles (rank above 128: column blocks)
])
def test_interpreted_gram_kernels(monkeypatch, dtype, shape, near):
  if not interpreting():
    pytest.skip("runs under Triton's interpreter (test_gram_kernel_source_on_the_cpu_...)")
  monkeypatch.setattr(dsa_gram, "launch", interpreted_launch())
  _check_against_float64(dtype, shape, near)


def _check_against_float64(dtype, shape, near):
  rng = np.random.default_rng(sum(shape) + near)
  b, l, h, d, r = shape
  q, k = (rng.normal(size=(b, l, h, d)) for _ in range(2))
  xp = rng.normal(size=(b, l, r))
  wq, wk = (rng.normal(size=(h, r, r)) / np.sqrt(r) for _ in range(2))
  if near:   # W~q, W~k chosen so that Q~ K~^T ~ Q K^T: Q = XP A, K = XP B + noise
    amap, bmap = (rng.normal(size=(h, r, d)) / np.sqrt(r) for _ in range(2))
    q = np.einsum("blr,hrd->blhd", xp, amap)
    k = np.einsum("blr,hrd->blhd", xp, bmap)
    wq = np.concatenate([amap, np.zeros((h, r, r - d))], -1)
    wk = np.concatenate([bmap, 0.01 * rng.normal(size=(h, r, r - d))], -1)
    q, k = q + 0.01 * rng.normal(size=q.shape), k + 0.01 * rng.normal(size=k.shape)
  q, k = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64) for x in (q, k))
  mask = _mask(b, l, [l] + [l // 2 + 3] * (b - 1), hole=(0, slice(5, 9)))
  live = mask[:, :, None, None]
  pairs = mask[:, None, :, None] & mask[:, None, None, :]
  qp, kp = (np.einsum("blr,hrk->blhk", xp, w) for w in (wq, wk))
  diff = np.where(pairs, np.einsum("bqhd,bkhd->bhqk", q, k)
                  - np.einsum("bqhd,bkhd->bhqk", qp, kp), 0.0)
  want = np.sum(diff ** 2) / b
  want_dq = np.where(live, 2 * np.einsum("bhqk,bkhd->bqhd", diff, k) / b, 0)
  want_dqp = -2 * np.einsum("bhqk,bkhd->bqhd", diff, kp) / b
  want_dwq = np.einsum("blr,blhk->hrk", xp * mask[..., None], want_dqp)
  want_dk = np.where(live, 2 * np.einsum("bhqk,bqhd->bkhd", diff, q) / b, 0)
  want_dkp = -2 * np.einsum("bhqk,bqhd->bkhd", diff, qp) / b
  want_dwk = np.einsum("blr,blhk->hrk", xp * mask[..., None], want_dkp)
  want_dxp = np.where(mask[..., None], np.einsum("blhk,hrk->blr", want_dqp, wq)
                      + np.einsum("blhk,hrk->blr",
                                  2 * np.einsum("bhqk,bqhd->bkhd", -diff, qp) / b, wk), 0)
  scale = np.sum(np.where(pairs, np.einsum("bqhd,bkhd->bhqk", q, k) ** 2, 0)) / b
  args = [jnp.asarray(q, dtype), jnp.asarray(k, dtype)] + [
      jnp.asarray(x, jnp.float32) for x in (xp, wq, wk)]
  fn = jax.jit(jax.value_and_grad(
      lambda *a: dsa_gram.prediction_mse(*a, jnp.asarray(mask)), argnums=range(5)))
  value, grads = fn(*args)
  assert abs(float(value) - want) < 5e-5 * scale, (float(value), want, scale)
  rel = lambda x, y: np.linalg.norm(np.asarray(x, np.float64) - y) / np.linalg.norm(y)  # noqa
  tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3      # dq, dk are stored in the input dtype
  assert rel(grads[0], want_dq) < tol, rel(grads[0], want_dq)
  assert rel(grads[1], want_dk) < tol, rel(grads[1], want_dk)
  assert rel(grads[3], want_dwq) < 2e-3, rel(grads[3], want_dwq)
  assert rel(grads[4], want_dwk) < 2e-3, rel(grads[4], want_dwk)
  assert rel(grads[2], want_dxp) < 2e-3, rel(grads[2], want_dxp)
  for x in grads[:3]:
    assert np.all(np.isfinite(np.asarray(x, np.float32)))
    assert np.all(np.asarray(x, np.float32)[~mask] == 0)
