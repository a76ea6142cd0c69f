"""DFSS, DSA and Nystromformer against independent float64 numpy references."""
import functools
import math
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lra_sparse.config import get_base_config
from lra_sparse.attention import (AttentionDims, DFSSConfig, build_attention, dense_attention,
                                  dfss_attention, nm_mask, nystrom_attention)
from lra_sparse.attention import dsa as dsa_lib
from lra_sparse.kernels.dsa import reference as dsa_ref
from lra_sparse.ops import nm as nm_lib

from conftest import np_dense, np_select  # float64 numpy references

# Jitted entry points: one compilation per shape instead of one per primitive (eager mode).
dfss_attention = jax.jit(dfss_attention, static_argnames=("n", "m", "backend", "dropout_rate"))
nystrom_attention = jax.jit(nystrom_attention,
                            static_argnames=("num_landmarks", "pinv_iters", "nm", "implementation",
                                             "dropout_rate", "mask_holes"))
dense_reference = jax.jit(functools.partial(dense_attention, implementation="reference"))


def _init(core, *args, seed=0, **kwargs):
  """Parameters with the structure core.init gives (traced only: no init compilation), filled
  with seeded normals scaled by 1/sqrt(fan_in)."""
  shapes = jax.eval_shape(core.init, jax.random.PRNGKey(0), *args, **kwargs)
  rng = np.random.default_rng(seed)
  fill = lambda s: (rng.normal(size=s.shape) / math.sqrt(s.shape[-2])).astype(np.float32)
  return {"params": jax.tree.map(fill, shapes.get("params", {}))}


def _apply(core, variables, *args, **kwargs):
  static = ("deterministic", "mutable", "method")
  kwargs = {k: tuple(v) if k == "mutable" else v for k, v in kwargs.items()}
  return jax.jit(core.apply, static_argnames=static)(variables, *args, **kwargs)


B, L, H, D = 2, 32, 2, 8
LENGTHS = np.array([29, 13])  # real tokens per example; padding at the end


def _qkv(seed=0, shape=(B, L, H, D)):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=shape).astype(np.float32) for _ in range(3)]


def _mask(lengths=LENGTHS, length=L):
  return np.arange(length)[None, :] < np.asarray(lengths)[:, None]


def _fp32_tol(cpu_tol):
  """Tolerance for float32 products: a GPU runs them in TF32 (10-bit mantissa) by default."""
  return max(cpu_tol, 3e-3) if jax.default_backend() == "gpu" else cpu_tol


# ----------------------------------------------------------------------------- numpy references
def np_nm_mask_brute(scores, n, m):
  """Python loops: sort each group by (-value, index) and keep the first n."""
  flat = scores.reshape(-1, scores.shape[-1])
  keep = np.zeros(flat.shape, bool)
  for r, row in enumerate(flat):
    for g in range(0, len(row), m):
      order = sorted(range(m), key=lambda i: (-row[g + i], i))
      for i in order[:n]:
        keep[r, g + i] = True
  return keep.reshape(scores.shape)


def np_nm_mask(scores, n, m):
  """Vectorised: a stable argsort of -scores inside each group (ties -> lower index)."""
  groups = scores.reshape(scores.shape[:-1] + (-1, m))
  order = np.argsort(-groups, axis=-1, kind="stable")
  rank = np.argsort(order, axis=-1, kind="stable")
  return (rank < n).reshape(scores.shape)


def np_softmax_where(logits, keep):
  """Softmax over entries where keep (and finite); empty rows -> 0."""
  keep = keep & np.isfinite(logits)
  safe = np.where(keep, logits, -np.inf)
  row_max = np.max(safe, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  unnorm = np.where(keep, np.exp(np.where(keep, logits, 0.0) - row_max), 0.0)
  denom = unnorm.sum(-1, keepdims=True)
  return unnorm / np.where(denom > 0, denom, 1.0)


def np_scores(q, k, mask):
  q, k = q.astype(np.float64), k.astype(np.float64)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  if mask is not None:
    s = np.where(mask[:, None, None, :], s, -np.inf)
  return s


def np_dfss(q, k, v, n, m, mask=None):
  s = np_scores(q, k, mask)
  p = np_softmax_where(s, np_nm_mask(s, n, m))
  return np.einsum("bhqk,bkhd->bqhd", p, v.astype(np.float64))


def np_topk_attention(q, k, v, mask, sparsity):
  """Oracle top-k attention: each row keeps its ceil((1-s) n_real) largest real scores."""
  s = np_scores(q, k, mask)
  keep = np.zeros(s.shape, bool)
  for b in range(s.shape[0]):
    count = max(1, math.ceil((1 - sparsity) * mask[b].sum() - 1e-6))
    order = np.argsort(-s[b], axis=-1, kind="stable")[..., :count]
    np.put_along_axis(keep[b], order, True, axis=-1)
  p = np_softmax_where(s, keep)
  return np.einsum("bhqk,bkhd->bqhd", p, v.astype(np.float64)), keep


def np_nystrom_official(q, k, v, mask, num_landmarks, iters=6, nm=None, conv=None):
  """float64 port of mlpen/Nystromformer LRA/code/attention_nystrom.py (+ N:M option)."""
  q, k, v = [np.swapaxes(x.astype(np.float64), 1, 2) for x in (q, k, v)]   # [b, h, L, d]
  maskf = mask.astype(np.float64)
  b, h, length, d = q.shape
  q = q * maskf[:, None, :, None] / math.sqrt(math.sqrt(d))
  k = k * maskf[:, None, :, None] / math.sqrt(math.sqrt(d))
  q_land = q.reshape(b, h, num_landmarks, length // num_landmarks, d).mean(-2)
  k_land = k.reshape(b, h, num_landmarks, length // num_landmarks, d).mean(-2)

  def softmax(x, prune):
    keep = np_nm_mask(x, *nm) if (prune and nm) else np.ones(x.shape, bool)
    return np_softmax_where(x, keep)

  kernel_1 = softmax(q @ np.swapaxes(k_land, -1, -2), True)
  kernel_2 = softmax(q_land @ np.swapaxes(k_land, -1, -2), False)
  kernel_3 = softmax(q_land @ np.swapaxes(k, -1, -2) - 1e9 * (1 - maskf[:, None, None, :]), True)
  eye = np.eye(num_landmarks)
  z = 1 / np.max(np.sum(kernel_2, axis=-2)) * np.swapaxes(kernel_2, -1, -2)
  for _ in range(iters):
    kz = kernel_2 @ z
    z = (0.25 * z) @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz)))
  out = kernel_1 @ z @ (kernel_3 @ v)
  if conv is not None:  # Conv2d(h, h, (K, 1), padding K // 2, groups=h, bias=False)
    size = conv.shape[0]
    vm = np.pad(v * maskf[:, None, :, None], ((0, 0), (0, 0), (size // 2, size // 2), (0, 0)))
    for t in range(size):
      out = out + conv[t][None, :, None, None] * vm[:, :, t:t + length]
  return np.swapaxes(out, 1, 2)


def _config(kind, **fields):
  """config.attention of the base config selecting ``kind``; ``fields`` set its block
  (``n``/``m`` are written as the block's ``nm="n:m"``)."""
  config = get_base_config().attention
  config.kind = kind
  config.nystrom.num_landmarks = 8
  if "n" in fields or "m" in fields:
    fields["nm"] = f"{fields.pop('n', 2)}:{fields.pop('m', 4)}"
  for name, value in fields.items():
    config[kind][name] = value
  return config


def _dims(length=L, model_dim=16, heads=H, head_dim=D, dropout=0.0):
  return AttentionDims(num_heads=heads, head_dim=head_dim, model_dim=model_dim, length=length,
                       dropout_rate=dropout, dtype=jnp.float32)


# ------------------------------------------------------------------------------------ nm_mask
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (3, 8), (1, 4), (4, 4)])
def test_nm_mask_matches_brute_force_with_ties(n, m):
  rng = np.random.default_rng(n * 10 + m)
  scores = rng.integers(-2, 3, size=(3, 5, 16)).astype(np.float32)   # many ties
  scores[0, 0, :4] = -np.inf
  scores[1, 2, 4:8] = [-np.inf, 1.0, -np.inf, 1.0]
  got = np.asarray(nm_mask(jnp.asarray(scores), n, m))
  np.testing.assert_array_equal(got, np_nm_mask_brute(scores, n, m))
  assert np.all(got.reshape(3, 5, -1, m).sum(-1) == n)


@pytest.mark.parametrize("n", nm_lib.TOURNAMENT_N)
def test_keep_n_of_4_is_nm_mask(n):
  """The tournament keeps what the rule keeps (numpy's stable argsort): small integer scores
  (ties between every pair of members) and -inf entries (padded keys, also whole groups of
  them); bad input raises."""
  rng = np.random.default_rng(n)
  s = rng.integers(-2, 3, (64, 400)).astype(np.float32)
  s[rng.random(s.shape) < 0.2] = -np.inf
  s[3, :40] = -np.inf
  members = [jnp.asarray(s[:, j::4]) for j in range(4)]
  keep, group_max = nm_lib.keep_n_of_4(members, n)
  want = np_nm_mask(s, n, 4)
  for j in range(4):
    np.testing.assert_array_equal(np.asarray(keep[j]), want[:, j::4])
  np.testing.assert_array_equal(np.asarray(group_max), s.reshape(64, 100, 4).max(-1))
  with pytest.raises(ValueError, match="n in"):
    nm_lib.keep_n_of_4(members, 3)


def test_nm_mask_bad_arguments():
  scores = jnp.zeros((2, 10))
  with pytest.raises(ValueError, match="not a multiple of m=4"):
    nm_mask(scores, 2, 4)
  for n, m in [(0, 2), (3, 2), (-1, 2)]:
    with pytest.raises(ValueError, match="0 < n <= m"):
      nm_mask(jnp.zeros((2, 8)), n, m)


# --------------------------------------------------------------------------------------- DFSS
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (3, 8)])
def test_dfss_matches_numpy(n, m):
  q, k, v = _qkv(n + m)
  mask = _mask()
  got = dfss_attention(q, k, v, n=n, m=m, mask=jnp.asarray(mask), backend="reference")
  want = np_dfss(q, k, v, n, m, mask)
  np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=2e-5, atol=2e-5)
  # Padded query rows still attend to real keys only: compare them too.
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_dfss_gradients_match_finite_differences():
  n, m = 2, 4
  q, k, v = _qkv(7)
  mask = _mask()
  weights = np.random.default_rng(8).normal(size=q.shape)

  def loss_jax(q, k, v):
    out = dfss_attention(q, k, v, n=n, m=m, mask=jnp.asarray(mask), backend="reference")
    return jnp.sum(out * weights)

  def loss_np(q, k, v):
    return float(np.sum(np_dfss(q, k, v, n, m, mask) * weights))

  grads = jax.jit(jax.grad(loss_jax, argnums=(0, 1, 2)))(q, k, v)
  rng = np.random.default_rng(9)
  eps = 1e-6
  for which in range(3):
    for _ in range(3):
      direction = rng.normal(size=q.shape)
      args_plus = [x.astype(np.float64) for x in (q, k, v)]
      args_minus = [x.astype(np.float64) for x in (q, k, v)]
      args_plus[which] = args_plus[which] + eps * direction
      args_minus[which] = args_minus[which] - eps * direction
      numeric = (loss_np(*args_plus) - loss_np(*args_minus)) / (2 * eps)
      analytic = float(np.sum(np.asarray(grads[which], np.float64) * direction))
      assert abs(numeric - analytic) <= 1e-3 * max(1.0, abs(numeric)), (which, numeric, analytic)


def test_dfss_n_equals_m_is_dense():
  q, k, v = _qkv(3)
  mask = jnp.asarray(_mask())
  got = dfss_attention(q, k, v, n=4, m=4, mask=mask, backend="reference")
  want = dense_reference(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  grad_got = jax.jit(jax.grad(lambda q: jnp.sum(
      dfss_attention(q, k, v, n=2, m=2, mask=mask) ** 2)))(q)
  grad_want = jax.grad(lambda q: jnp.sum(
      dense_reference(q, k, v, mask) ** 2))(q)
  np.testing.assert_allclose(np.asarray(grad_got), np.asarray(grad_want), rtol=1e-4, atol=1e-5)


def test_dfss_padded_groups_and_rows_give_zeros_and_finite_grads():
  q, k, v = _qkv(4)
  mask = _mask(lengths=[5, 0])   # example 0: keys 5..31 padded (whole groups); example 1: none
  mask_j = jnp.asarray(mask)
  # A real key with a tiny score still beats padded keys in its group.
  k[0, 4] = -50.0 * q[0, :, :, :].mean(0)
  out = dfss_attention(q, k, v, n=2, m=4, mask=mask_j, backend="reference")
  assert np.all(np.isfinite(np.asarray(out)))
  np.testing.assert_array_equal(np.asarray(out)[1], 0.0)
  np.testing.assert_allclose(np.asarray(out), np_dfss(q, k, v, 2, 4, mask), rtol=2e-5,
                             atol=2e-5)
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      dfss_attention(q, k, v, n=2, m=4, mask=mask_j) ** 2), argnums=(0, 1, 2)))(q, k, v)
  for grad in grads:
    assert np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_array_equal(np.asarray(grads[0])[1], 0.0)
  np.testing.assert_array_equal(np.asarray(grads[1])[0, 5:], 0.0)   # padded keys: no gradient


def test_dfss_bfloat16_close_to_float32():
  q, k, v = _qkv(5)
  mask = jnp.asarray(_mask())
  lo = dfss_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), n=2, m=4, mask=mask)
  assert lo.dtype == jnp.bfloat16
  ref = np_dfss(*(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (q, k, v)), 2,
                4, np.asarray(mask))
  np.testing.assert_allclose(np.asarray(lo, np.float32), ref, atol=3e-2)


def test_dfss_bad_inputs():
  q, k, v = _qkv(0, (1, 30, 2, 8))
  with pytest.raises(ValueError, match="length 30 is not a multiple of m=4"):
    dfss_attention(q, k, v, n=2, m=4)
  q, k, v = _qkv(0)
  with pytest.raises(ValueError, match="unknown backend"):
    dfss_attention(q, k, v, backend="cuda")
  with pytest.raises(ValueError, match="0 < n <= m"):
    dfss_attention(q, k, v, n=5, m=4)


def test_dfss_core_dropout_and_deterministic():
  q, k, v = _qkv(6)
  mask = jnp.asarray(_mask())
  core = build_attention(_config("dfss", n=1, m=2, backend="reference"), _dims(dropout=0.5))
  params = _init(core, q, k, v, mask=mask)
  out = _apply(core, params, q, k, v, mask=mask, deterministic=True)
  np.testing.assert_allclose(np.asarray(out), np_dfss(q, k, v, 1, 2, np.asarray(mask)),
                             rtol=2e-5, atol=2e-5)
  dropped = _apply(core, params, q, k, v, mask=mask, deterministic=False,
                       rngs={"dropout": jax.random.PRNGKey(1)})
  assert np.all(np.isfinite(np.asarray(dropped)))
  assert not np.allclose(np.asarray(dropped), np.asarray(out))


@pytest.mark.parametrize("kind, fields", [("dense", {}),
                                          ("dfss", {"n": 1, "m": 2, "backend": "reference"}),
                                          ("dsa", {"sparsity": 0.5})])
def test_attention_dropout_drops_at_its_rate_and_rescales_by_one_over_keep(kind, fields):
  """With V the identity over keys (head_dim = L), each output row is the row of attention
  probabilities after dropout: every entry is 0 or exactly p / (1 - rate) of the
  deterministic pass, and the share of kept probabilities that were dropped is the rate
  (within 4.5 binomial standard deviations)."""
  rate, length = 0.3, L
  q, k, _ = _qkv(12, shape=(B, L, H, length))
  v = np.broadcast_to(np.eye(length, dtype=np.float32)[None, :, None, :], (B, L, H, length))
  mask = jnp.asarray(_mask())
  x = np.random.default_rng(4).normal(size=(B, L, 16)).astype(np.float32)
  extra = {"inputs": x} if kind == "dsa" else {}
  core = build_attention(_config(kind, **fields), _dims(head_dim=length, dropout=rate))
  params = _init(core, q, k, v, mask=mask, **extra)
  mutable = ["aux_loss", "aux_metrics"] if kind == "dsa" else False
  run = lambda **kw: np.asarray(_apply(core, params, q, k, v, mask=mask, mutable=mutable,
                                       **extra, **kw)[0] if mutable else
                                _apply(core, params, q, k, v, mask=mask, **extra, **kw))
  probs = run(deterministic=True)
  dropped = run(deterministic=False, rngs={"dropout": jax.random.PRNGKey(5)})
  real = np.asarray(mask)[:, :, None, None] & (probs > 0)   # real query rows, kept keys
  kept = np.isclose(dropped, probs / (1 - rate), rtol=1e-5, atol=0)
  assert np.all(kept | (dropped == 0))
  n = int(real.sum())
  share = float(np.sum(real & (dropped == 0))) / n
  assert n > 500 and abs(share - rate) < 4.5 * math.sqrt(rate * (1 - rate) / n), (share, n)


def test_dense_with_attention_dropout_never_ignores_an_explicit_cudnn():
  """Training with attention dropout runs the explicit formulation; an explicit cuDNN choice
  (which has no dropout) is one error instead of being silently replaced."""
  from lra_sparse.attention import dense as dense_lib  # pylint: disable=import-outside-toplevel
  q, k, v = _qkv(7)
  mask = jnp.asarray(_mask())
  rngs = {"dropout": jax.random.PRNGKey(3)}
  core = build_attention(_config("dense"), _dims(dropout=0.5))
  params = _init(core, q, k, v, mask=mask)
  dropped = _apply(core, params, q, k, v, mask=mask, deterministic=False, rngs=rngs)
  kept = _apply(core, params, q, k, v, mask=mask, deterministic=True)
  np.testing.assert_allclose(np.asarray(kept), np.asarray(
      dense_lib.dense_attention_reference(q, k, v, mask)), rtol=1e-5, atol=1e-5)
  assert np.all(np.isfinite(np.asarray(dropped)))
  assert not np.allclose(np.asarray(dropped), np.asarray(kept))
  for implementation in ("cudnn", "cudnn_bias"):
    core = build_attention(_config("dense", implementation=implementation), _dims(dropout=0.5))
    with pytest.raises(ValueError, match=rf"implementation='{implementation}' cannot apply "
                                         r"attention dropout \(rate 0.5\)"):
      _apply(core, params, q, k, v, mask=mask, deterministic=False, rngs=rngs)


def test_nystrom_auto_says_once_that_dropout_trains_on_xla(monkeypatch):
  """On a GPU in bf16, 'auto' runs the core on the flash kernels; with attention dropout it runs
  the XLA formulation instead and logs that once (no silent switch)."""
  from lra_sparse.attention import common as common_lib  # pylint: disable=import-outside-toplevel
  from lra_sparse.attention import nystrom as nystrom_lib  # pylint: disable=import-outside-toplevel
  said = []
  monkeypatch.setattr(common_lib, "warn_once", said.append)
  monkeypatch.setattr(nystrom_lib.jax, "default_backend", lambda: "gpu")
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(4))
  out = nystrom_lib.nystrom_attention(q, k, v, num_landmarks=4, implementation="auto",
                                      dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0))
  assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))
  assert len(said) == 1 and "attention dropout trains on the XLA formulation" in said[0]


def test_dfss_cpu_path_never_imports_triton():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-only check")
  before = {m for m in ("jax_triton", "triton") if m in sys.modules}
  x = jnp.ones((1, 8, 1, 4))
  dfss_attention(x, x, x, n=2, m=4, backend="auto").block_until_ready()
  build_attention(_config("dfss", backend="auto"), _dims())
  assert not {m for m in ("jax_triton", "triton") if m in sys.modules} - before


def test_dfss_triton_backend_unavailable_on_cpu_is_one_error():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-only check")
  q, k, v = _qkv(0)
  with pytest.raises(ValueError, match="triton"):
    dfss_attention(q, k, v, backend="triton")
  with pytest.raises(ValueError, match="backend='triton'"):
    build_attention(_config("dfss", backend="triton"), _dims())


def test_dfss_config_errors():
  with pytest.raises(ValueError, match=r"config.attention.dfss.nm='5:4'.*need 0 < n <= m"):
    build_attention(_config("dfss", n=5, m=4), _dims())
  with pytest.raises(ValueError, match=r"config.attention.dfss.nm='3:2'.*need 0 < n <= m"):
    build_attention(_config("dfss", n=3, m=2), _dims())
  with pytest.raises(ValueError, match=r"config.attention.dfss.nm='2-4' must be 'n:m'"):
    build_attention(_config("dfss", nm="2-4"), _dims())
  with pytest.raises(ValueError, match=r"length 36 .* not a multiple of m=8 from "
                                       r"config.attention.dfss.nm='2:8'"):
    build_attention(_config("dfss", n=2, m=8), _dims(length=36))
  with pytest.raises(ValueError, match="config.attention.dfss.backend"):
    build_attention(_config("dfss", backend="cuda"), _dims())
  with pytest.raises(ValueError, match=r"config.attention.dfss.nm='0:4'"):
    build_attention(_config("dfss", n=0), _dims())
  with pytest.raises(TypeError):  # ConfigDict keeps the field a bool
    _config("dfss", deterministic_kernels="yes")
  with pytest.raises(ValueError, match="config.attention.dfss.deterministic_kernels"):
    DFSSConfig(deterministic_kernels="yes")
  core = build_attention(_config("dfss", deterministic_kernels=True), _dims())
  assert core.config.deterministic_kernels is True
  # One N:M rule everywhere: n == m is allowed (it keeps every key).
  assert build_attention(_config("dfss", n=4, m=4), _dims()).config.n_m == (4, 4)


# ---------------------------------------------------------------------------------------- DSA
def _dsa_inputs(seed=0, model_dim=16):
  rng = np.random.default_rng(seed)
  q, k, v = _qkv(seed)
  x = rng.normal(size=(B, L, model_dim)).astype(np.float32)
  return q, k, v, x


def test_dsa_sparsity_zero_is_dense():
  q, k, v, x = _dsa_inputs(1)
  mask = jnp.asarray(_mask())
  core = build_attention(_config("dsa", sparsity=0.0, sigma=0.25), _dims())
  variables = _init(core, q, k, v, mask=mask, inputs=x)
  out, state = _apply(core, {"params": variables["params"]}, q, k, v, mask=mask, inputs=x,
                          mutable=["aux_loss", "aux_metrics"])
  want = dense_reference(q, k, v, mask)
  real = np.asarray(mask)[:, :, None, None]    # trailing padding rows keep nothing: zeros
  np.testing.assert_allclose(np.where(real, np.asarray(out), 0.0),
                             np.where(real, np.asarray(want), 0.0), rtol=1e-5, atol=1e-5)
  assert not np.asarray(out)[~np.asarray(mask)].any() and not np.asarray(mask).all()
  assert float(state["aux_metrics"]["dsa_hit_rate"][0]) == pytest.approx(1.0)


def np_dsa_attention(q, k, v, keep_groups, vector):
  """float64 softmax over the kept keys ([batch, heads, L / vector, L], rows of a group
  share), then times V."""
  keep = np.repeat(np.asarray(keep_groups, bool), vector, axis=2)
  p = np_softmax_where(np_scores(q, k, None), keep)
  return np.einsum("bhqk,bkhd->bqhd", p, np.asarray(v, np.float64))


@pytest.mark.parametrize("sparsity", [0.75, 0.9])
def test_dsa_exact_predictor_is_oracle_topk(sparsity):
  """With q = X P W~q and k = X P W~k (head_dim = k), S~ = S: the predictor keeps what the
  selection rule keeps on the real scores (hit rate 1, MSE ~ 0), and the output is the
  attention under that set (the rule written again in numpy)."""
  model_dim, heads, rank = 16, 2, 8          # sigma = 0.5 -> k = 8 = head_dim
  rng = np.random.default_rng(2)
  x = rng.normal(size=(B, L, model_dim)).astype(np.float32)
  v = rng.normal(size=(B, L, heads, rank)).astype(np.float32)
  mask = _mask()
  dims = _dims(model_dim=model_dim, heads=heads, head_dim=rank)
  core = build_attention(_config("dsa", sparsity=sparsity, sigma=0.5), dims)
  dummy = jnp.zeros((B, L, heads, rank))
  params = _init(core, dummy, dummy, v, mask=jnp.asarray(mask),
                     inputs=x)["params"]
  projection = np.asarray(core.apply({"params": params}, method=lambda mdl: mdl.projection()))
  xp = x.astype(np.float64) @ projection
  q = np.einsum("blk,hkj->blhj", xp, np.asarray(params["predictor_query"], np.float64))
  k = np.einsum("blk,hkj->blhj", xp, np.asarray(params["predictor_key"], np.float64))
  q32, k32 = q.astype(np.float32), k.astype(np.float32)
  out, state = _apply(core, {"params": params}, q32, k32, v,
                          mask=jnp.asarray(mask), inputs=x, mutable=["aux_loss", "aux_metrics"])
  keep = np_select(q32, k32, mask, vector=1, sparsity=sparsity)
  want = np_dsa_attention(q32, k32, v, keep, 1)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
  assert float(state["aux_metrics"]["dsa_hit_rate"][0]) == pytest.approx(1.0)
  # The Gram form cancels three terms: zero up to ~1e-6 of sum (q.k)^2 / batch.
  scale = np.sum(np.einsum("bqhd,bkhd->bhqk", q, k) ** 2) / B
  assert float(state["aux_metrics"]["dsa_mse"][0]) < 1e-5 * scale


def test_dsa_projection_is_fixed_ternary_and_not_a_parameter():
  dims = _dims(model_dim=64)
  core = build_attention(_config("dsa", sigma=0.5), dims)
  q, k, v, _ = _dsa_inputs(3)
  x = np.ones((B, L, 64), np.float32)
  variables = _init(core, q, k, v, mask=None, inputs=x)
  assert set(variables["params"]) == {"predictor_query", "predictor_key"}
  assert variables["params"]["predictor_query"].shape == (H, 32, 32)
  other = build_attention(_config("dsa", sigma=0.5), dims)
  p1 = np.asarray(core.apply(variables, method=lambda mdl: mdl.projection()))
  p2 = np.asarray(other.apply(_init(other, q, k, v, mask=None, inputs=x, seed=5),
                              method=lambda mdl: mdl.projection()))
  np.testing.assert_array_equal(p1, p2)
  assert p1.shape == (64, 32)
  scale = math.sqrt(3 / 32)
  assert set(np.unique(np.round(p1 / scale, 6))) <= {-1.0, 0.0, 1.0}
  big = np.asarray(dsa_lib.random_projection(0, 300, 300)) / math.sqrt(
      3 / 300)
  assert abs(np.mean(big == 1) - 1 / 6) < 0.01 and abs(np.mean(big == -1) - 1 / 6) < 0.01


def np_dsa_mse(q, k, qt, kt, mask, normalization):
  """float64 reference of DSA's L_MSE. Eq. 6 of the DSA paper: ||Q K^T - Q~ K~^T||^2 / B with
  the unscaled scores, over the pairs of two real tokens (padded pairs are excluded: their
  scores never reach the output); "scaled_mean": mean over heads and real pairs of the
  difference of the 1/sqrt(head_dim)-scaled scores (S~ is scaled by q's head_dim too)."""
  q, k, qt, kt = (np.asarray(a, np.float64) for a in (q, k, qt, kt))
  unscaled = np.einsum("bqhd,bkhd->bhqk", q, k) - np.einsum("bqhd,bkhd->bhqk", qt, kt)
  total, count = 0.0, 0
  for b in range(q.shape[0]):
    real = np.flatnonzero(mask[b])
    block = unscaled[b][:, real][:, :, real]        # [heads, n_b, n_b]
    total += np.sum(block ** 2)
    count += block.size
  if normalization == "eq6":
    return total / q.shape[0]
  return total / q.shape[-1] / max(count, 1)


@pytest.mark.parametrize("normalization", ["eq6", "scaled_mean"])
def test_dsa_mse_value_against_numpy_and_gradients_reach_both_paths(normalization):
  q, k, v, x = _dsa_inputs(4)
  mask = _mask()                       # example 1 has 19 padded keys at the end
  mask[0, 5] = False                   # and a hole: padding need not be at the end
  config = _config("dsa", sparsity=0.5, mse_weight=0.3, mse_normalization=normalization)
  core = build_attention(config, _dims())
  params = _init(core, q, k, v, mask=jnp.asarray(mask), inputs=x)["params"]

  def aux(params, q, k):
    _, state = _apply(core, {"params": params}, q, k, v, mask=jnp.asarray(mask), inputs=x,
                      mutable=["aux_loss", "aux_metrics"])
    return state["aux_loss"]["dsa_mse"][0], state

  (loss, state), (grad_params, grad_q, grad_k) = jax.jit(jax.value_and_grad(
      aux, argnums=(0, 1, 2), has_aux=True))(params, q, k)
  projection = np.asarray(core.apply({"params": params}, method=lambda mdl: mdl.projection()))
  xp = x.astype(np.float64) @ projection
  qt = np.einsum("blk,hkj->blhj", xp, np.asarray(params["predictor_query"], np.float64))
  kt = np.einsum("blk,hkj->blhj", xp, np.asarray(params["predictor_key"], np.float64))
  want = np_dsa_mse(q, k, qt, kt, mask, normalization)
  assert float(state["aux_metrics"]["dsa_mse"][0]) == pytest.approx(want, rel=1e-4)
  assert float(loss) == pytest.approx(0.3 * want, rel=1e-4)
  # The two forms differ by head_dim x heads x real pairs / batch (large: not a rescaling
  # mse_weight of 1 could hide).
  pairs = sum(int(m.sum()) ** 2 for m in mask)
  other = np_dsa_mse(q, k, qt, kt, mask, "scaled_mean" if normalization == "eq6" else "eq6")
  ratio = D * H * pairs / B
  assert (want / other) == pytest.approx(ratio if normalization == "eq6" else 1 / ratio,
                                         rel=1e-9)
  # Padded pairs are excluded: changing a padded token's q and k changes nothing.
  q2, k2 = q.copy(), k.copy()
  q2[1, LENGTHS[1]:] += 5.0
  k2[0, 5] -= 3.0
  (loss2, _), _ = jax.jit(jax.value_and_grad(aux, argnums=(0, 1, 2), has_aux=True))(
      params, q2, k2)
  assert float(loss2) == pytest.approx(float(loss), rel=1e-6)
  assert np.abs(np.asarray(grad_q)).sum() > 0 and np.abs(np.asarray(grad_k)).sum() > 0
  assert np.abs(np.asarray(grad_params["predictor_query"])).sum() > 0
  assert np.abs(np.asarray(grad_params["predictor_key"])).sum() > 0
  np.testing.assert_array_equal(np.asarray(grad_q)[1, LENGTHS[1]:], 0.0)  # padded: no MSE
  np.testing.assert_array_equal(np.asarray(grad_k)[0, 5], 0.0)


def test_dsa_mse_gradient_reaches_only_what_the_options_say():
  """mse_gradient="predictor": L_MSE has the same value and gives the predictor the same
  gradient as "joint", and none to q and k (S is a fixed target); the attention output (and
  so the task loss's gradient) is the same in both. The block input X gets L_MSE's gradient
  (through X P W~) only with mse_input_gradient=True (joint's default), and exactly the
  gradient of the predictor's path: a float64 numpy derivative of the scaled-mean L_MSE with
  respect to X, S held fixed. "predictor" with True is one clear error."""
  q, k, v, x = _dsa_inputs(4)
  mask = jnp.asarray(_mask())
  grads, inits = {}, {}
  for mode, reach in (("joint", False), ("joint", True), ("predictor", False)):
    core = build_attention(_config("dsa", sparsity=0.5, mse_weight=0.3, mse_gradient=mode,
                                   mse_input_gradient=reach,
                                   mse_normalization="scaled_mean"), _dims())
    params = inits[mode, reach] = _init(core, q, k, v, mask=mask, inputs=x)["params"]

    def aux(params, q, k, x, core=core):
      out, state = _apply(core, {"params": params}, q, k, v, mask=mask, inputs=x,
                          mutable=["aux_loss", "aux_metrics"])
      return state["aux_loss"]["dsa_mse"][0], out

    grads[mode, reach] = jax.jit(jax.value_and_grad(aux, argnums=(0, 1, 2, 3),
                                                    has_aux=True))(params, q, k, x)
  (loss_j, out_j), (gp_j, gq_j, gk_j, gx_j) = grads["joint", False]
  for (mode, reach), ((loss, out), (gp, gq, gk, gx)) in grads.items():
    assert float(loss) == float(loss_j) and float(loss_j) > 0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_j))
    for name in ("predictor_query", "predictor_key"):
      np.testing.assert_allclose(np.asarray(gp[name]), np.asarray(gp_j[name]), rtol=1e-6)
      assert np.abs(np.asarray(gp[name])).sum() > 0
    if mode == "joint":
      np.testing.assert_allclose(np.asarray(gq), np.asarray(gq_j), rtol=1e-6)
      assert np.abs(np.asarray(gq)).sum() > 0 and np.abs(np.asarray(gk)).sum() > 0
    else:
      np.testing.assert_array_equal(np.asarray(gq), 0.0)
      np.testing.assert_array_equal(np.asarray(gk), 0.0)
    if not reach:
      np.testing.assert_array_equal(np.asarray(gx), 0.0)
  # The input's gradient, in float64: L = 0.3 * mean over heads and real pairs of
  # ((S - S~) / sqrt(d))^2 with S~ = (X P Wq_h)(X P Wk_h)^T; dL/dX through S~ only.
  params = inits["joint", True]
  np.testing.assert_array_equal(np.asarray(params["predictor_query"]),
                                np.asarray(inits["predictor", False]["predictor_query"]))
  projection = np.asarray(core.bind({"params": params}).projection(), np.float64)
  xs, qs, ks = (np.asarray(a, np.float64) for a in (x, q, k))
  wq, wk = (np.asarray(params[n], np.float64) for n in ("predictor_query", "predictor_key"))
  real = np.asarray(mask, bool)
  pairs = real[:, None, :, None] & real[:, None, None, :]           # [b, 1, q, k]
  heads, d = qs.shape[2], qs.shape[3]
  scores = np.einsum("bqhd,bkhd->bhqk", qs, ks)
  xp = xs @ projection
  qt, kt = np.einsum("blk,hkj->bhlj", xp, wq), np.einsum("blk,hkj->bhlj", xp, wk)
  diff = np.where(pairs, scores - np.einsum("bhqj,bhkj->bhqk", qt, kt), 0.0) / d
  count = heads * pairs.sum()
  dpred = -2 * 0.3 * diff / count                                     # dL/dS~ [b, h, q, k]
  dqt = np.einsum("bhqk,bhkj->bhqj", dpred, kt)
  dkt = np.einsum("bhqk,bhqj->bhkj", dpred, qt)
  dxp = np.einsum("bhlj,hkj->blk", dqt, wq) + np.einsum("bhlj,hkj->blk", dkt, wk)
  expected = dxp @ projection.T
  assert np.abs(expected).max() > 0
  np.testing.assert_allclose(np.asarray(grads["joint", True][1][3]), expected, rtol=2e-4,
                             atol=1e-7 * np.abs(expected).max())
  assert get_base_config().attention.dsa.mse_input_gradient is True
  with pytest.raises(ValueError, match="mse_input_gradient.*False with mse_gradient='predictor'"):
    build_attention(_config("dsa", mse_gradient="predictor"), _dims())
  with pytest.raises(ValueError, match="mse_gradient"):
    build_attention(_config("dsa", mse_gradient="both"), _dims())
  with pytest.raises(TypeError, match="mse_input_gradient"):   # ConfigDict types it
    build_attention(_config("dsa", mse_input_gradient="yes"), _dims())


def test_dsa_oracle_selection_keeps_the_top_keys_of_the_real_scores():
  """selection_scores="oracle": each real row attends to its ceil(0.25 * real keys) largest
  real scores Q K^T (float64 numpy softmax over exactly those keys), whatever the predictor's
  weights; the hit rate against the oracle reads 1. Rows whose kept and dropped scores lie
  closer than the int8 rule's rounding are left out of the comparison; the rest must match.
  Block granularity or the float rule with it is one clear error."""
  q, k, v, x = _dsa_inputs(5)
  mask = _mask()
  core = build_attention(_config("dsa", sparsity=0.75, selection_scores="oracle"), _dims())
  outs = []
  for seed in (0, 1):            # two different predictors: the same selection
    params = _init(core, q, k, v, mask=jnp.asarray(mask), inputs=x, seed=seed)
    out, state = _apply(core, params, q, k, v, mask=jnp.asarray(mask), inputs=x,
                        deterministic=True, mutable=["aux_metrics"])
    assert float(state["aux_metrics"]["dsa_hit_rate"][0]) == 1.0
    outs.append(np.asarray(out))
  np.testing.assert_array_equal(outs[0], outs[1])
  scores = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(D)
  compared = 0
  for b, n in enumerate(LENGTHS):
    keep = math.ceil(0.25 * n)
    for h in range(H):
      for row in range(n):
        real = scores[b, h, row, :n]
        order = np.sort(real)[::-1]
        if order[keep - 1] - order[keep] < 0.02 * np.abs(real).max():
          continue                 # a near tie: int8 rounding may order it either way
        kept = real >= order[keep - 1]
        weights = np.exp(real[kept] - real[kept].max())
        want = (weights / weights.sum()) @ v[b, :n][kept][:, h].astype(np.float64)
        np.testing.assert_allclose(outs[0][b, row, h], want, rtol=1e-5, atol=1e-6)
        compared += 1
  assert compared > 0.5 * H * LENGTHS.sum(), compared
  for fields in ({"granularity": "block"}, {"selection_rule": "float"}):
    with pytest.raises(ValueError, match="selection_scores.*'oracle' needs granularity='fine'"):
      build_attention(_config("dsa", selection_scores="oracle", **fields), _dims())


def test_dsa_mse_without_mask_and_with_no_real_token():
  q, k, v, x = _dsa_inputs(8)
  for normalization in ("eq6", "scaled_mean"):
    core = build_attention(_config("dsa", mse_normalization=normalization), _dims())
    params = _init(core, q, k, v, mask=None, inputs=x)["params"]
    for mask in (None, np.zeros((B, L), bool)):
      _, state = _apply(core, {"params": params}, q, k, v,
                        mask=None if mask is None else jnp.asarray(mask), inputs=x,
                        mutable=["aux_loss", "aux_metrics"])
      got = float(state["aux_metrics"]["dsa_mse"][0])
      if mask is None:
        projection = np.asarray(core.apply({"params": params},
                                           method=lambda mdl: mdl.projection()))
        xp = x.astype(np.float64) @ projection
        qt = np.einsum("blk,hkj->blhj", xp, np.asarray(params["predictor_query"], np.float64))
        kt = np.einsum("blk,hkj->blhj", xp, np.asarray(params["predictor_key"], np.float64))
        assert got == pytest.approx(np_dsa_mse(q, k, qt, kt, np.ones((B, L), bool),
                                               normalization), rel=1e-4)
      else:
        assert got == 0.0            # no real pair: nothing to fit, and no NaN


def test_dsa_vector_granularity_and_threshold_against_numpy():
  rng = np.random.default_rng(5)
  scores = rng.normal(size=(B, H, L, L)).astype(np.float32)
  mask = _mask()
  keep = np.asarray(dsa_ref.predicted_mask(jnp.asarray(scores), mask=jnp.asarray(mask),
                                           sparsity=0.75, vector=4))
  for b in range(B):
    count = math.ceil(0.25 * mask[b].sum() - 1e-6)
    for h in range(H):
      for g in range(L // 4):
        rows = [r for r in range(4 * g, 4 * g + 4) if mask[b, r]]
        mean = scores[b, h, rows].astype(np.float64).mean(0) if rows else np.zeros(L)
        mean = np.where(mask[b], mean, -np.inf)
        want = np.zeros(L, bool)
        want[np.argsort(-mean, kind="stable")[:count]] = True
        for r in range(4 * g, 4 * g + 4):
          np.testing.assert_array_equal(keep[b, h, r], want)
  keep = np.asarray(dsa_ref.predicted_mask(jnp.asarray(scores), mask=jnp.asarray(mask),
                                           selection="threshold", threshold=0.5))
  np.testing.assert_array_equal(keep, (scores >= 0.5) & mask[:, None, None, :])


@pytest.mark.parametrize("algorithm", ["radix", "top_k"])
def test_dsa_topk_mask_matches_brute_force_with_ties(algorithm):
  rng = np.random.default_rng(11)
  select = jax.jit(functools.partial(dsa_ref.topk_mask, algorithm=algorithm, max_keep=13))
  for length, integers in ((16, True), (13, False), (16, False)):
    scores = rng.normal(size=(2, 3, 5, length)).astype(np.float32)
    if integers:
      scores = np.round(scores * 1.5)                 # many ties
      scores[1, 1, 1, :4] = [0.0, -0.0, 0.0, -0.0]    # -0.0 ties with +0.0
    scores[0, 0, 0, :length // 2] = -np.inf           # padded keys
    counts = np.array([rng.integers(1, length // 2 + 1), rng.integers(1, 14)])
    got = np.asarray(select(scores, counts))
    want = np.zeros(scores.shape, bool)
    for b, h, r in np.ndindex(*scores.shape[:3]):
      order = sorted(range(length), key=lambda i: (-scores[b, h, r, i], i))[:counts[b]]
      want[b, h, r, order] = True
    np.testing.assert_array_equal(got, want)


def test_dsa_fake_quantization():
  x = jnp.asarray(np.random.default_rng(6).normal(size=(64,)), jnp.float32)
  for bits in (2, 4, 8):
    quantized = np.asarray(dsa_ref.fake_quantize(x, bits))
    assert len(np.unique(quantized)) <= 2 ** bits - 1
    np.testing.assert_allclose(quantized, x, atol=float(jnp.max(jnp.abs(x))) / (
        2 ** (bits - 1) - 1) / 2 + 1e-6)
    grad = jax.grad(lambda x: jnp.sum(dsa_ref.fake_quantize(x, bits) * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(grad), 3.0)   # straight-through
  np.testing.assert_array_equal(np.asarray(dsa_ref.fake_quantize(x, 0)), np.asarray(x))


def test_dsa_selection_is_float_topk_where_the_margin_exceeds_its_resolution():
  """The int8 rule against true top-k of the float scores S~ = Q~ K~^T: on every row whose
  gap between the last kept and the first dropped float score exceeds what the rule can
  blur (int8 rounding of both operands, then an 8-bit code per row), the two keep the same
  keys. The bound comes from the float operands alone; most rows qualify."""
  rng = np.random.default_rng(5)
  rank, sparsity = 8, 0.75
  q_pred = rng.normal(size=(B, L, H, rank))
  k_pred = rng.normal(size=(B, L, H, rank))
  mask = _mask()
  ops = dsa_ref.selection_operands(jnp.asarray(q_pred, jnp.float32),
                                   jnp.asarray(k_pred, jnp.float32), jnp.asarray(mask))
  keep = np.asarray(dsa_ref.reference_select(ops, jnp.asarray(mask), sparsity=sparsity))
  scores = np.einsum("bqhk,blhk->bhql", q_pred, k_pred)
  checked = 0
  for b in range(B):
    n_real = int(mask[b].sum())
    need = max(1, math.ceil((1 - sparsity) * n_real - 1e-6))
    k_amax = np.abs(k_pred[b, :n_real]).max(axis=(0, 2))                 # per head
    for h in range(H):
      for r in range(n_real):
        row = scores[b, h, r, :n_real]
        q_amax = np.abs(q_pred[b, r, h]).max()
        dq, dk = q_amax / 254, k_amax[h] / 254                           # half an int8 step
        # |q.k - q8.k8 * scale| per key, from the operands' rounding
        err = (np.abs(q_pred[b, r, h]).sum() * dk + np.abs(k_pred[b, :n_real, h]).sum(-1) * dq
               + rank * dq * dk)
        span = (row + err).max() - (row - err).min()
        step = max(2 * span / 256, q_amax * k_amax[h] / 127 ** 2)      # one code, in S~ units
        order = np.argsort(-row, kind="stable")
        kept, dropped = order[:need], order[need:]
        if (row - err)[kept].min() - (row + err)[dropped].max() <= step:
          continue
        checked += 1
        want = set(kept)
        assert set(np.flatnonzero(keep[b, h, r])) == want, (b, h, r)
      assert not keep[b, h, :, n_real:].any()
  assert checked >= 20, checked         # of the 84 real rows x heads


def np_fake_quantize(x, bits, valid=None):
  """Symmetric per-tensor rounding to 2^(bits-1) - 1 levels, in float64 numpy; the scale
  from the entries ``valid`` marks."""
  x = np.asarray(x, np.float64)
  if bits == 0:
    return x
  levels = 2 ** (bits - 1) - 1
  scale = np.max(np.abs(x) if valid is None else np.where(valid, np.abs(x), 0.0)) / levels
  return np.clip(np.round(x / scale), -levels, levels) * scale


@pytest.mark.parametrize("quant_bits,vector", [(2, 1), (4, 4), (8, 8)])
def test_dsa_quantised_module_follows_the_numpy_chain(quant_bits, vector):
  """The module's prediction path step by step in numpy: quantise X (scale from real tokens)
  and W~, project with the fixed P, select with the rule, attend with the real scores. A
  module that skipped the quantisation, or quantised with another scale, keeps other keys."""
  q, k, v, x = _dsa_inputs(11)
  mask = _mask()
  x = np.where(mask[..., None], x, 3.0 * x)   # padding's largest inputs must not set the scale
  core = build_attention(_config("dsa", quant_bits=quant_bits, vector=vector, sparsity=0.75),
                         _dims())
  params = _init(core, q, k, v, mask=jnp.asarray(mask), inputs=x)["params"]
  projection = np.asarray(core.apply({"params": params}, method=lambda mdl: mdl.projection()))
  xq = np_fake_quantize(x, quant_bits, mask[..., None]) @ projection
  q_pred = np.einsum("blk,hkj->blhj", xq,
                     np_fake_quantize(params["predictor_query"], quant_bits))
  k_pred = np.einsum("blk,hkj->blhj", xq, np_fake_quantize(params["predictor_key"], quant_bits))
  keep = np_select(q_pred.astype(np.float32), k_pred.astype(np.float32), mask, vector=vector,
                   sparsity=0.75)
  out = _apply(core, {"params": params}, q, k, v, mask=jnp.asarray(mask), inputs=x,
               mutable=["aux_loss", "aux_metrics"])[0]
  real = mask[:, :, None, None]
  want = np_dsa_attention(q, k, v, keep, vector)
  np.testing.assert_allclose(np.where(real, np.asarray(out), 0), np.where(real, want, 0),
                             rtol=1e-4, atol=1e-4)
  unquantised = np_select(np.einsum("blk,hkj->blhj", x.astype(np.float64) @ projection,
                                    np.asarray(params["predictor_query"], np.float64)),
                          np.einsum("blk,hkj->blhj", x.astype(np.float64) @ projection,
                                    np.asarray(params["predictor_key"], np.float64)),
                          mask, vector=vector, sparsity=0.75)
  assert np.any(unquantised != keep)      # the check can tell a skipped quantisation


@pytest.mark.parametrize("quant_bits,vector,selection,dropout", [(2, 8, "topk", 0.0),
                                                                 (8, 4, "threshold", 0.1)])
def test_dsa_core_variants_finite(quant_bits, vector, selection, dropout):
  q, k, v, x = _dsa_inputs(7)
  mask = jnp.asarray(_mask(lengths=[29, 0]))
  core = build_attention(_config("dsa", quant_bits=quant_bits, vector=vector,
                                 selection=selection), _dims(dropout=dropout))
  params = _init(core, q, k, v, mask=mask, inputs=x)["params"]

  def loss(params, q):
    out, state = _apply(core, {"params": params}, q, k, v, mask=mask, inputs=x,
                            deterministic=False, rngs={"dropout": jax.random.PRNGKey(2)},
                            mutable=["aux_loss", "aux_metrics"])
    return jnp.sum(out ** 2) + state["aux_loss"]["dsa_mse"][0]

  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, q)
  assert np.isfinite(float(value))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_dsa_config_errors():
  cases = [({"sparsity": 1.0}, r"config.attention.dsa.sparsity=1.0 must be in \[0, 1\)"),
           ({"sparsity": -0.1}, r"config.attention.dsa.sparsity=-0.1"),
           ({"sigma": 0.0}, r"config.attention.dsa.sigma=0.0 must be in \(0, 1\]"),
           ({"sigma": 1.5}, r"config.attention.dsa.sigma=1.5"),
           ({"sigma": 0.01}, r"config.attention.dsa.sigma=0.01 .*predictor rank"),
           ({"quant_bits": 3}, r"config.attention.dsa.quant_bits=3"),
           ({"quant_bits": 16}, r"config.attention.dsa.quant_bits=16"),
           ({"vector": 2}, r"config.attention.dsa.vector=2"),
           ({"selection": "random"}, r"config.attention.dsa.selection='random'"),
           ({"mse_weight": -1.0}, r"config.attention.dsa.mse_weight=-1.0"),
           ({"mse_normalization": "mean"},
            r"config.attention.dsa.mse_normalization='mean' is not one of "
            r"\('eq6', 'scaled_mean'\)$"),
           ({"topk_algorithm": "sort"}, r"config.attention.dsa.topk_algorithm='sort'")]
  for fields, message in cases:
    with pytest.raises(ValueError, match=message):
      build_attention(_config("dsa", **fields), _dims())
  with pytest.raises(ValueError, match="length 36 is not a multiple of "
                                       "config.attention.dsa.vector=8"):
    build_attention(_config("dsa", vector=8), _dims(length=36))


def np_block_keep(xp, wq, wk, mask, block, sparsity, scale):
  """float64 numpy: the block rule. Block means of XP over real positions (a last partial
  block counts its own), block scores (mean XP_q W~q) . (mean XP_k W~k) * scale, top
  ceil((1 - s) * real key blocks) real key blocks per live query block. Returns (bool
  [batch, heads, blocks, blocks], the scores, the margin of each live row's cut)."""
  b, length, _ = xp.shape
  blocks = -(-length // block)
  heads = wq.shape[0]
  keep = np.zeros((b, heads, blocks, blocks), bool)
  scores = np.zeros((b, heads, blocks, blocks))
  margins = []
  for e in range(b):
    real = np.asarray(mask[e], bool)
    pooled, real_block = [], []
    for j in range(blocks):
      sl = slice(j * block, min((j + 1) * block, length))
      r = real[sl]
      pooled.append(xp[e, sl][r].mean(0) if r.any() else xp[e, sl].mean(0))
      real_block.append(r.any())
    pooled, real_block = np.array(pooled), np.array(real_block)
    last = np.nonzero(real)[0].max() + 1 if real.any() else 0
    count = max(1, math.ceil((1 - sparsity) * real_block.sum() - 1e-6))
    for h in range(heads):
      s = (pooled @ wq[h]) @ (pooled @ wk[h]).T * scale
      scores[e, h] = s
      for i in range(blocks):
        if i * block >= last:
          continue                                  # past the last real token: keeps none
        row = np.where(real_block, s[i], -np.inf)
        order = np.argsort(-row, kind="stable")
        keep[e, h, i, order[:count]] = True
        if count < real_block.sum():       # the cut's margin, relative to the row's range
          span = row[real_block].max() - row[real_block].min()
          margins.append((row[order[count - 1]] - row[order[count]]) / span)
  return keep & np.asarray(real_block_all(mask, block, length))[:, None, None, :], scores, margins


def real_block_all(mask, block, length):
  blocks = -(-length // block)
  return np.array([[np.asarray(m, bool)[j * block:(j + 1) * block].any() for j in range(blocks)]
                   for m in mask])


@pytest.mark.parametrize("sparsity", [0.5, 0.7])
def test_dsa_block_granularity_follows_the_numpy_chain(sparsity):
  """granularity="block": the kept (query block, key block) pairs are the top key blocks by
  the mean predicted score over real pairs (numpy, float64, on rows whose cut has a margin
  above the int8 code's resolution), with a partial last block and an example whose padding
  leaves whole blocks empty; the output is the softmax over every real key of the kept blocks;
  gradients reach the attention inputs; evaluation records the kept share and the hit rate."""
  block, length, lengths = 16, 72, [67, 21]           # 5 blocks, the last one 8 long
  rng = np.random.default_rng(10)     # inputs whose cuts all clear 5% of their row's range
  q, k, v = _qkv(12, (B, length, H, D))
  x = rng.normal(size=(B, length, 16)).astype(np.float32)
  mask = _mask(lengths, length)
  core = build_attention(_config("dsa", granularity="block", block_size=block,
                                 sparsity=sparsity, sigma=0.5), _dims(length=length))
  params = _init(core, q, k, v, mask=jnp.asarray(mask), inputs=x)["params"]
  projection = np.asarray(core.apply({"params": params}, method=lambda mdl: mdl.projection()),
                          np.float64)
  xp = x.astype(np.float64) @ projection
  wq, wk = (np.asarray(params[n], np.float64) for n in ("predictor_query", "predictor_key"))
  want_blocks, scores, margins = np_block_keep(xp, wq, wk, mask, block, sparsity, D ** -0.5)
  assert min(margins) > 0.05                # no near-tie: the int8 rule must agree
  got_blocks = dsa_ref.block_select(
      dsa_ref.LowRank(jnp.asarray(xp, jnp.float32), jnp.asarray(wq, jnp.float32)),
      dsa_ref.LowRank(jnp.asarray(xp, jnp.float32), jnp.asarray(wk, jnp.float32)),
      jnp.asarray(mask), block_size=block, sparsity=sparsity, scale=D ** -0.5)
  np.testing.assert_array_equal(np.asarray(got_blocks), want_blocks)
  assert want_blocks[1, :, 2:].sum() == 0 and want_blocks[:, :, :, 2:][1].sum() == 0

  out, state = _apply(core, {"params": params}, q, k, v, mask=jnp.asarray(mask), inputs=x,
                      mutable=["aux_loss", "aux_metrics"])
  keep = np.repeat(np.repeat(want_blocks, block, 2), block, 3)[:, :, :length, :length]
  keep &= mask[:, None, None, :]
  p = np_softmax_where(np_scores(q, k, None), keep)
  want = np.einsum("bhqk,bkhd->bqhd", p, np.asarray(v, np.float64))
  real = mask[:, :, None, None]
  np.testing.assert_allclose(np.where(real, np.asarray(out), 0), np.where(real, want, 0),
                             rtol=1e-4, atol=1e-4)
  pairs = mask[:, None, :, None] & mask[:, None, None, :]
  share = float(state["aux_metrics"]["dsa_kept_share"][0])
  assert share == pytest.approx((keep & pairs).sum() / (pairs.sum() * H), rel=1e-6)
  assert 0.0 < float(state["aux_metrics"]["dsa_hit_rate"][0]) <= 1.0

  def loss(params, q, k, v):
    out, st = _apply(core, {"params": params}, q, k, v, mask=jnp.asarray(mask), inputs=x,
                     deterministic=False, mutable=["aux_loss", "aux_metrics"])
    return jnp.sum(out ** 2) + st["aux_loss"]["dsa_mse"][0]

  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(params, q, k, v)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
  assert all(np.abs(np.asarray(g)).sum() > 0 for g in grads[1:])


def test_dsa_block_granularity_config_errors():
  for fields, message in (
      ({"granularity": "tile"}, r"config.attention.dsa.granularity='tile' is not one of"),
      ({"granularity": "block", "block_size": 48}, r"config.attention.dsa.block_size=48"),
      ({"granularity": "block", "vector": 4}, r"config.attention.dsa.vector=4 is the "
                                              r"fine-grained rule's row grouping"),
      ({"granularity": "block", "selection_rule": "float"},
       r"config.attention.dsa.selection_rule='float' must be 'int8'")):
    with pytest.raises(ValueError, match=message):
      build_attention(_config("dsa", **fields), _dims())


# ------------------------------------------------------------------------------------ Nystrom
def test_nystrom_as_many_landmarks_as_tokens_is_close_to_dense():
  """Landmarks = tokens: F = A = B = softmax(QK^T/sqrt(d)), so O = A pinv(A) A V = A V once the
  iterative pinv has converged (6 iterations leave ~2e-2 on near-uniform A; 20 converge)."""
  q, k, v = _qkv(8, (B, 16, H, D))
  mask = jnp.asarray(_mask(lengths=[16, 11], length=16))
  got = nystrom_attention(q, k, v, num_landmarks=16, pinv_iters=20, mask=mask)
  want = dense_reference(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(got)[0], np.asarray(want)[0], atol=_fp32_tol(1e-3))
  # With padding, Q~/K~ include zeroed padded tokens (official semantics): still close.
  np.testing.assert_allclose(np.asarray(got)[1, :11], np.asarray(want)[1, :11], atol=2e-2)


@pytest.mark.parametrize("num_landmarks", [4, 8])
def test_nystrom_matches_numpy_port_of_official(num_landmarks):
  q, k, v = _qkv(9)
  mask = _mask()
  got = nystrom_attention(q, k, v, num_landmarks=num_landmarks, mask=jnp.asarray(mask))
  want = np_nystrom_official(q, k, v, mask, num_landmarks)
  np.testing.assert_allclose(np.asarray(got), want, rtol=_fp32_tol(1e-4), atol=_fp32_tol(1e-4))


@pytest.mark.parametrize("nm", ["1:2", "2:4"])
def test_nystrom_dfss_matches_numpy(nm):
  q, k, v = _qkv(10)
  mask = _mask()
  parsed = tuple(int(x) for x in nm.split(":"))
  got = nystrom_attention(q, k, v, num_landmarks=8, nm=nm, mask=jnp.asarray(mask))
  want = np_nystrom_official(q, k, v, mask, 8, nm=parsed)
  np.testing.assert_allclose(np.asarray(got), want, rtol=_fp32_tol(1e-4), atol=_fp32_tol(1e-4))
  plain = np_nystrom_official(q, k, v, mask, 8)
  assert not np.allclose(want, plain, atol=1e-3)   # the pruning really changes the result


def test_nystrom_pads_length_to_a_multiple_of_landmarks():
  q, k, v = _qkv(11, (B, 30, H, D))
  mask = _mask(lengths=[30, 17], length=30)
  got = nystrom_attention(q, k, v, num_landmarks=8, mask=jnp.asarray(mask))
  pad = lambda x: np.pad(x, ((0, 0), (0, 2), (0, 0), (0, 0)))
  want = np_nystrom_official(pad(q), pad(k), pad(v), np.pad(mask, ((0, 0), (0, 2))), 8)[:, :30]
  np.testing.assert_allclose(np.asarray(got), want, rtol=_fp32_tol(1e-4), atol=_fp32_tol(1e-4))


@pytest.mark.parametrize("length,nm", [(32, None), (30, None), (30, (2, 4))])
def test_nystrom_gradients_match_float64_finite_differences(length, nm):
  """Gradients w.r.t. q, k, v against central differences of the float64 port along a random
  direction: padded tokens, a length that is not a multiple of the landmarks (30 = 7 full
  segments of 4 and one of 2; the port pads), plain and 2:4. Covers the hand-written
  backward of the segment means (each token gets its segment's gradient / size)."""
  q, k, v = _qkv(13 + length, (B, length, H, D))
  mask = _mask(lengths=[length, 13], length=length)
  padded = -(-length // 8) * 8
  pad = lambda x: np.pad(x, ((0, 0), (0, padded - length)) + ((0, 0),) * (x.ndim - 2))
  rng = np.random.default_rng(length)
  cot = rng.normal(size=q.shape)
  directions = [rng.normal(size=q.shape) for _ in range(3)]

  def port(q, k, v):
    out = np_nystrom_official(pad(q), pad(k), pad(v), pad(mask), 8, nm=nm)[:, :length]
    return float(np.sum(out * cot))

  eps = 1e-5
  plus = port(*[x.astype(np.float64) + eps * d for x, d in zip((q, k, v), directions)])
  minus = port(*[x.astype(np.float64) - eps * d for x, d in zip((q, k, v), directions)])
  want = (plus - minus) / (2 * eps)
  grads = jax.grad(lambda q, k, v: jnp.vdot(nystrom_attention(
      q, k, v, num_landmarks=8, nm=nm, mask=jnp.asarray(mask)), cot.astype(np.float32)),
                   argnums=(0, 1, 2))(q, k, v)
  got = sum(float(np.sum(np.asarray(g, np.float64) * d)) for g, d in zip(grads, directions))
  scale = sum(float(np.abs(np.asarray(g, np.float64) * d).sum())
              for g, d in zip(grads, directions))
  assert abs(got - want) <= _fp32_tol(1e-5) * scale, (got, want, scale)


def test_nystrom_core_with_conv_matches_numpy_and_trains():
  q, k, v = _qkv(12)
  mask = jnp.asarray(_mask())
  core = build_attention(_config("nystrom", num_landmarks=8, conv_kernel=5), _dims(dropout=0.1))
  params = _init(core, q, k, v, mask=mask)["params"]
  assert params["conv_kernel"].shape == (5, H)
  out = _apply(core, {"params": params}, q, k, v, mask=mask)
  want = np_nystrom_official(q, k, v, _mask(), 8,
                             conv=np.asarray(params["conv_kernel"], np.float64))
  np.testing.assert_allclose(np.asarray(out), want, rtol=_fp32_tol(1e-4), atol=_fp32_tol(1e-4))
  # Training path (dropout on F and B); one pinv iteration keeps the compile small.
  train_core = build_attention(_config("nystrom", num_landmarks=8, conv_kernel=5, pinv_iters=1,
                                       nm="1:2", attention_dropout=True), _dims(dropout=0.1))
  grads = jax.jit(jax.grad(lambda p, q: jnp.sum(train_core.apply(
      {"params": p}, q, k, v, mask=mask, deterministic=False,
      rngs={"dropout": jax.random.PRNGKey(1)}) ** 2), argnums=(0, 1)))(params, q)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
  assert np.abs(np.asarray(grads[0]["conv_kernel"])).sum() > 0


def test_nystrom_has_no_attention_dropout_unless_asked(monkeypatch):
  """The official Nystromformer has no attention dropout: with the model's attention dropout
  at 0.1 the core trains without it (said in the log, once per process: ``warn_once``), and
  drops F and B only with config.attention.nystrom.attention_dropout=True."""
  from lra_sparse.attention import common as common_lib  # pylint: disable=import-outside-toplevel
  said = []
  monkeypatch.setattr(common_lib, "warn_once", said.append)
  q, k, v = _qkv(13)
  mask = jnp.asarray(_mask())
  outputs = {}
  for asked in (False, True):
    core = build_attention(_config("nystrom", num_landmarks=8, conv_kernel=0,
                                   attention_dropout=asked), _dims(dropout=0.1))
    variables = _init(core, q, k, v, mask=mask)
    outputs[asked] = [np.asarray(_apply(core, variables, q, k, v, mask=mask,
                                        deterministic=deterministic,
                                        rngs={"dropout": jax.random.PRNGKey(2)}))
                      for deterministic in (True, False)]
  np.testing.assert_array_equal(outputs[False][0], outputs[False][1])
  assert not np.allclose(outputs[True][0], outputs[True][1])
  assert len(said) == 1 and "no attention dropout" in said[0], said
  assert "attention_dropout=True" in said[0], said


def test_nystrom_bad_inputs_and_config_errors():
  q, k, v = _qkv(0)
  with pytest.raises(ValueError, match="num_landmarks=6 must be a multiple of m=4"):
    nystrom_attention(q, k, v, num_landmarks=6, nm="2:4")
  with pytest.raises(ValueError, match="nm='2-4'"):
    nystrom_attention(q, k, v, num_landmarks=8, nm="2-4")
  cases = [({"num_landmarks": 64}, r"config.attention.nystrom.num_landmarks=64"),
           ({"num_landmarks": 0}, r"config.attention.nystrom.num_landmarks=0"),
           ({"pinv_iters": 0}, r"config.attention.nystrom.pinv_iters=0"),
           ({"conv_kernel": 4}, r"config.attention.nystrom.conv_kernel=4"),
           ({"nm": "5:4"}, r"config.attention.nystrom.nm='5:4'.*need 0 < n <= m"),
           ({"nm": "two:four"}, r"config.attention.nystrom.nm='two:four'"),
           ({"num_landmarks": 6, "nm": "1:4"}, r"num_landmarks=6 must be a multiple of m=4")]
  for fields, message in cases:
    with pytest.raises(ValueError, match=message):
      build_attention(_config("nystrom", **fields), _dims())


def test_dsa_topk_algorithm_config_gives_the_same_attention():
  """config.attention.dsa.topk_algorithm='radix' (sort-free) selects exactly what lax.top_k does."""
  q, k, v, x = _dsa_inputs(7)
  mask = jnp.asarray(_mask())
  outs = []
  for algorithm in ("top_k", "radix"):
    core = build_attention(_config("dsa", sparsity=0.7, topk_algorithm=algorithm), _dims())
    assert core.config.topk_algorithm == algorithm
    variables = _init(core, q, k, v, mask=mask, inputs=x)
    out, _ = _apply(core, {"params": variables["params"]}, q, k, v, mask=mask, inputs=x,
                    mutable=["aux_loss", "aux_metrics"])
    outs.append(np.asarray(out))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_dfss_auto_fallback_on_a_gpu_is_warned_once(monkeypatch, caplog):
  """On a GPU, backend='auto' leaves the kernel for shapes it cannot run: one warning per
  reason, and the pure-JAX result."""
  from lra_sparse.attention import common as common_lib  # pylint: disable=import-outside-toplevel
  from lra_sparse.attention import dfss as dfss_lib  # pylint: disable=import-outside-toplevel

  class FakeKernel:
    @staticmethod
    def unsupported_reason(q, v, n, m, k=None):
      return f"head_dim {q.shape[-1]} not in [1, 128]"

    @staticmethod
    def dfss_attention_triton(*args, **kwargs):
      raise AssertionError("the kernel must not run")

  monkeypatch.setattr(dfss_lib.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(dfss_lib, "_triton_module", lambda required: FakeKernel)
  monkeypatch.setattr(common_lib, "_WARNED_ONCE", set())
  q, k, v = _qkv(11, (1, 16, 2, 160))
  with caplog.at_level("WARNING"):
    outs = [dfss_lib.dfss_attention(q, k, v, n=2, m=4) for _ in range(2)]
  warnings = [r.getMessage() for r in caplog.records if "backend='auto'" in r.getMessage()]
  assert len(warnings) == 1 and "head_dim 160 not in [1, 128]" in warnings[0]
  np.testing.assert_allclose(np.asarray(outs[0]), np_dfss(q, k, v, 2, 4), rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- dense: cuDNN path
def test_cudnn_path_pads_small_head_dims_exactly(monkeypatch):
  """Head dim 4 (LRA Pathfinder-32) reaches cuDNN zero-padded to 8 with the softmax scale of
  the true head dim; cuDNN is stood in for by XLA with the same arguments (CPU), and the
  result must equal the float64 reference. On a GPU, 'auto' never crashes on refusal."""
  from lra_sparse.attention import dense as dense_lib  # pylint: disable=import-outside-toplevel
  seen = []
  real_dpa = jax.nn.dot_product_attention

  def stand_in(q, k, v, *, key_value_seq_lengths, scale, implementation):
    assert implementation == "cudnn"
    seen.append((q.shape[-1], k.shape[-1], v.shape[-1], scale))
    mask = np.arange(q.shape[1])[None, :] < np.asarray(key_value_seq_lengths)[:, None]
    return real_dpa(q, k, v, mask=jnp.asarray(mask)[:, None, None, :], scale=scale,
                    implementation="xla")

  monkeypatch.setattr(dense_lib.jax.nn, "dot_product_attention", stand_in)
  q, k, v = _qkv(21, (B, L, H, 4))
  mask = _mask()
  got = dense_lib.dense_attention(q, k, v, jnp.asarray(mask), implementation="cudnn")
  assert seen == [(8, 8, 8, 0.5)] and got.shape == (B, L, H, 4)
  np.testing.assert_allclose(np.asarray(got), np_dfss(q, k, v, 1, 1, mask),
                             rtol=_fp32_tol(1e-5), atol=_fp32_tol(1e-5))

  def refuse(*args, **kwargs):
    raise ValueError("cuDNN refuses this shape")

  monkeypatch.setattr(dense_lib.jax.nn, "dot_product_attention",
                      lambda *a, **kw: refuse() if kw["implementation"] == "cudnn"
                      else real_dpa(*a, **kw))
  monkeypatch.setattr(dense_lib, "_on_gpu", lambda: True)
  qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  out = dense_lib.dense_attention(qb, kb, vb, jnp.asarray(mask), implementation="auto")
  want = np_dfss(*(np.asarray(x, np.float32) for x in (qb, kb, vb)), 1, 1, mask)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=3e-2, atol=3e-2)


def test_cudnn_bias_path_takes_masks_with_holes(monkeypatch):
  """'cudnn_bias' gives cuDNN the key mask (holes, a fully masked row) as a full
  [batch, 1, L, L] bias without gradient; cuDNN is stood in for by XLA with the same
  arguments (CPU): the result equals the float64 reference on the rows with a real key and
  XLA's masked path on the fully masked one."""
  from lra_sparse.attention import dense as dense_lib  # pylint: disable=import-outside-toplevel
  seen = []
  real_dpa = jax.nn.dot_product_attention

  def stand_in(q, k, v, **kw):
    if kw["implementation"] != "cudnn":
      return real_dpa(q, k, v, **kw)
    assert sorted(kw) == ["bias", "implementation", "scale"]
    seen.append((kw["bias"].shape, kw["bias"].dtype, q.shape[-1], kw["scale"]))
    return real_dpa(q, k, v, bias=kw["bias"], scale=kw["scale"], implementation="xla")

  rng = np.random.default_rng(5)
  mask = rng.random((B, L)) < 0.6
  mask[0, :7] = False                      # a masked run before the first real key
  mask[-1] = False                         # no real key at all
  q, k, v = _qkv(23, (B, L, H, 4))
  xla = dense_lib.dense_attention(q, k, v, jnp.asarray(mask), implementation="xla")
  monkeypatch.setattr(dense_lib.jax.nn, "dot_product_attention", stand_in)
  got = dense_lib.dense_attention(q, k, v, jnp.asarray(mask), implementation="cudnn_bias")
  assert seen == [((B, 1, L, L), jnp.float32, 8, 0.5)]
  want = np_dfss(q, k, v, 1, 1, mask)
  np.testing.assert_allclose(np.asarray(got)[:-1], want[:-1], rtol=_fp32_tol(1e-5),
                             atol=_fp32_tol(1e-5))
  np.testing.assert_allclose(np.asarray(got)[-1], np.asarray(xla)[-1], rtol=1e-5, atol=1e-5)
  grads = jax.grad(lambda q: jnp.sum(dense_lib.dense_attention(
      q, k, v, jnp.asarray(mask), implementation="cudnn_bias")[:-1]))(q)
  assert np.all(np.isfinite(np.asarray(grads)))


def _cudnn_stand_in(calls):
  """jax.nn.dot_product_attention with cuDNN stood in for by XLA on the same arguments (bias or
  sequence lengths) in float32; records which form of the mask each call got."""
  real_dpa = jax.nn.dot_product_attention

  def stand_in(q, k, v, *, scale, implementation, bias=None, key_value_seq_lengths=None):
    assert implementation == "cudnn" and q.dtype == k.dtype == v.dtype
    assert bias is None or key_value_seq_lengths is None
    calls.append("bias" if bias is not None else "lengths")
    mask = None
    if key_value_seq_lengths is not None:
      mask = (jnp.arange(k.shape[1])[None, :] < key_value_seq_lengths[:, None])[:, None, None]
    f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
    out = real_dpa(f32(q), f32(k), f32(v), bias=f32(bias), mask=mask, scale=scale,
                   implementation="xla")
    return out.astype(q.dtype)
  return stand_in


def test_auto_gives_cudnn_masks_with_holes_as_a_bias(monkeypatch):
  """With mask_holes (the model builder sets it for pixel tasks) "auto" on a GPU other than a
  Hopper gives cuDNN
  the key mask as a bias, dense and the Nystromformer's B V alike, else as sequence lengths;
  cuDNN stood in for by XLA (CPU). The Nystromformer's result equals its explicit form on the
  real rows, and a fully masked example still gives zeros."""
  from lra_sparse.attention import dense as dense_lib  # pylint: disable=import-outside-toplevel
  calls = []
  monkeypatch.setattr(dense_lib.jax.nn, "dot_product_attention", _cudnn_stand_in(calls))
  monkeypatch.setattr(dense_lib, "_on_gpu", lambda: True)
  monkeypatch.setattr(dense_lib, "_mosaic_runs", lambda q, k, v: False)   # not a Hopper
  rng = np.random.default_rng(8)
  mask = rng.random((3, 30)) < 0.6
  mask[2] = False
  mask = jnp.asarray(mask)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(25, (3, 30, H, 16)))
  for holes, form in ((True, "bias"), (False, "lengths")):
    dense_attention(q, k, v, mask, implementation="auto", mask_holes=holes)
    assert calls[-1] == form
  calls.clear()
  got = nystrom_attention(q, k, v, num_landmarks=8, mask=mask, implementation="cudnn",
                          mask_holes=True)
  assert calls == ["bias", "lengths"]       # B V with the mask; F (no key mask) without
  want = nystrom_attention(q, k, v, num_landmarks=8, mask=mask, implementation="xla")
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  real = np.asarray(mask)[:, :, None, None]
  assert np.all(np.isfinite(got)) and np.all(got[2] == 0)
  np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=3e-2,
                             atol=3e-2)


def test_dense_auto_routes_dropout_and_holes_to_the_mosaic_kernels(monkeypatch):
  """On a Hopper in half precision, "auto" runs the Mosaic GPU kernels while training with
  attention dropout (with the rate and rng it was given) and for masks with holes, cuDNN
  otherwise; in float32 on a GPU it runs the Triton kernels (dropout or not: training and
  evaluation on one implementation), XLA where they cannot run; 'mosaic' and 'triton' where
  their kernels are not available are one clear error each."""
  from lra_sparse.attention import dense as dense_lib  # pylint: disable=import-outside-toplevel
  calls = []
  monkeypatch.setattr(dense_lib.jax.nn, "dot_product_attention", _cudnn_stand_in(calls))
  monkeypatch.setattr(dense_lib, "_on_gpu", lambda: True)
  monkeypatch.setattr(dense_lib, "_mosaic_runs", lambda q, k, v: True)
  triton_runs = [True]
  monkeypatch.setattr(dense_lib, "_triton_runs", lambda q, k, v: triton_runs[0])

  def stand_in(name):
    def kernel(q, k, v, mask=None, *, dropout_rate=0.0, dropout_rng=None, **options):
      calls.append((name, q.dtype.name, dropout_rate, dropout_rng is not None))
      determinism.append(options.get("deterministic"))
      return dense_lib.dense_attention_reference(q, k, v, mask, dropout_rate=dropout_rate,
                                                 dropout_rng=dropout_rng)
    return kernel

  determinism = []

  monkeypatch.setattr(dense_lib, "mosaic_attention", stand_in("mosaic"))
  monkeypatch.setattr(dense_lib, "triton_attention", stand_in("triton"))
  mask = jnp.asarray(np.random.default_rng(2).random((3, 30)) < 0.6)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(26, (3, 30, H, 16)))
  rng = jax.random.PRNGKey(0)
  dense_attention(q, k, v, mask, dropout_rate=0.1, dropout_rng=rng)
  assert calls[-1] == ("mosaic", "bfloat16", 0.1, True)
  dense_attention(q, k, v, mask, mask_holes=True)
  assert calls[-1] == ("mosaic", "bfloat16", 0.0, False)
  dense_attention(q, k, v, mask)
  assert calls[-1] == "lengths"
  with monkeypatch.context() as patch:    # the Triton kernels by name, as on a GPU
    patch.setattr(dense_lib, "triton_kernels", types.SimpleNamespace(
        is_available=lambda: True, unsupported_reason=lambda *args, **kwargs: None))
    dense_attention(q, k, v, mask, implementation="triton", dropout_rate=0.1, dropout_rng=rng)
  assert calls[-1] == ("triton", "bfloat16", 0.1, True)
  calls.clear()
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  dense_attention(q32, k32, v32, mask, dropout_rate=0.1, dropout_rng=rng)
  assert calls[-1] == ("triton", "float32", 0.1, True)
  dense_attention(q32, k32, v32, mask)
  assert calls[-1] == ("triton", "float32", 0.0, False) and determinism[-1] is False
  # config.attention.dense.deterministic_kernels reaches the Triton call (float32's path)
  core = dense_lib.DenseAttention(dims=AttentionDims(num_heads=H, head_dim=16, model_dim=H * 16,
                                                     length=30),
                                  config=dense_lib.DenseConfig(deterministic_kernels=True))
  core.apply({}, q32, k32, v32, mask=mask)
  assert calls[-1] == ("triton", "float32", 0.0, False) and determinism[-1] is True
  calls.clear()
  triton_runs[0] = False
  dense_attention(q32, k32, v32, mask, dropout_rate=0.1, dropout_rng=rng)
  assert calls == []                        # XLA's explicit attention, no kernel
  monkeypatch.undo()
  with pytest.raises(ValueError, match="backend='mosaic' but the dense Mosaic GPU kernel is "
                                       "not available here"):
    dense_attention(q, k, v, mask, implementation="mosaic")
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="backend='triton' but the dense Triton kernel is "
                                         "not available here"):
      dense_attention(q32, k32, v32, mask, implementation="triton")


def test_dense_dropout_on_xla_is_the_kernels_mask_in_float64():
  """Dense attention with dropout on XLA equals float64 numpy attention with the counter-based
  mask every kernel draws for the seed ``seed_words(rng)`` (conftest.np_dense):
  values and gradients, padded keys and a fully padded example included."""
  from lra_sparse.attention import dense as dense_lib  # pylint: disable=import-outside-toplevel
  from lra_sparse.ops import dropout as dd  # pylint: disable=import-outside-toplevel
  b, l, h, d, rate = 2, 21, 2, 8, 0.3
  q, k, v, ct = (np.asarray(x, np.float64) for x in list(_qkv(27, (b, l, h, d))) + [
      np.random.default_rng(3).normal(size=(b, l, h, d))])
  mask = np.random.default_rng(4).random((b, l)) < 0.7
  mask[1] = False
  rng = jax.random.PRNGKey(6)
  f = lambda q, k, v: dense_lib.dense_attention(  # noqa: E731
      q, k, v, jnp.asarray(mask), implementation="xla", dropout_rate=rate, dropout_rng=rng)
  with jax.default_matmul_precision("highest"):
    out, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    grads = vjp(jnp.asarray(ct, jnp.float32))
  want = np_dense(q, k, v, mask, ct, np.asarray(dd.seed_words(rng)), rate)
  np.testing.assert_allclose(out, want[0], atol=2e-5)
  for got, w in zip(grads, want[1:]):
    np.testing.assert_allclose(got, w, atol=5e-5)
  assert not np.asarray(out)[1].any()


def _check_value_and_grads(got, want, what=""):
  """(value, grads) against a float32 reference's: finite, within 3% in norm (half inputs)."""
  for a, w in zip([got[0]] + list(got[1]), [want[0]] + list(want[1])):
    a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(a)), what
    assert np.linalg.norm(a - w) <= 3e-2 * np.linalg.norm(w), what


@pytest.mark.gpu
def test_nystrom_cudnn_bias_matches_explicit_on_gpu():
  """The Nystromformer with a black-pixel-like mask on cuDNN (B V with the mask as a bias):
  outputs and q/k/v gradients on the real rows against the explicit float32 form."""
  rng = np.random.default_rng(9)
  mask = rng.random((B, 256)) < 0.5
  mask[0, :130] = False
  mask = jnp.asarray(mask)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(26, (B, 256, H, 32)))
  ct = jnp.asarray(rng.normal(size=q.shape) * np.asarray(mask)[:, :, None, None], jnp.bfloat16)

  def loss(q, k, v, **kw):
    out = nystrom_attention(q, k, v, num_landmarks=32, mask=mask, **kw)
    return jnp.sum((out * ct).astype(jnp.float32))

  got = jax.jit(jax.value_and_grad(functools.partial(
      loss, implementation="cudnn", mask_holes=True), argnums=(0, 1, 2)))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want = jax.value_and_grad(functools.partial(loss, implementation="xla"),
                            argnums=(0, 1, 2))(*f32)
  _check_value_and_grads(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_bias_matches_reference_on_gpu(dtype):
  """cuDNN with a black-pixel-like mask as a bias: outputs and q/k/v gradients against the
  float32 reference (rows with a real key), head dims 4 (padded to 8), 8 and 64."""
  rng = np.random.default_rng(6)
  for head_dim in (4, 8, 64):
    mask = rng.random((B, 256)) < 0.5
    mask[0, :130] = False
    q, k, v = (jnp.asarray(x, dtype) for x in _qkv(24, (B, 256, H, head_dim)))
    ct = jnp.asarray(rng.normal(size=q.shape), dtype)

    def loss(q, k, v, implementation):
      out = dense_attention(q, k, v, jnp.asarray(mask), implementation=implementation)
      return jnp.sum((out * ct).astype(jnp.float32))

    got = jax.jit(jax.value_and_grad(functools.partial(loss, implementation="cudnn_bias"),
                                     argnums=(0, 1, 2)))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.value_and_grad(functools.partial(loss, implementation="reference"),
                              argnums=(0, 1, 2))(*f32)
    _check_value_and_grads(got, want, head_dim)


@pytest.mark.gpu
def test_cudnn_small_head_dims_match_reference_on_gpu():
  for head_dim in (4, 8, 12):
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(22, (B, 128, H, head_dim)))
    mask = _mask(length=128, lengths=[128, 77])
    got = dense_attention(q, k, v, jnp.asarray(mask), implementation="cudnn")
    want = np_dfss(*(np.asarray(x, np.float32) for x in (q, k, v)), 1, 1, mask)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- Nystrom speed forms
def np_length_conv(values, taps):
  """float64 loops: out[l] = sum_t taps[t, h] values[l + t - K//2] (zero outside)."""
  values, taps = np.asarray(values, np.float64), np.asarray(taps, np.float64)
  out = np.zeros(values.shape)
  size, length = taps.shape[0], values.shape[1]
  for t in range(size):
    shift = t - size // 2
    for i in range(max(0, -shift), min(length, length - shift)):
      out[:, i] += taps[t][None, :, None] * values[:, i + shift]
  return out


@pytest.mark.parametrize("length,size,block", [(130, 35, 64), (7, 5, 64), (64, 129, 64),
                                               (200, 1, 16), (33, 33, 16)])
def test_conv_skip_forms_match_numpy(length, size, block):
  from lra_sparse.attention import nystrom as nys  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(length + size)
  values = rng.normal(size=(2, length, 3, 8)).astype(np.float32)
  taps = rng.normal(size=(size, 3)).astype(np.float32)
  want = np_length_conv(values, taps)
  from lra_sparse.kernels.nystrom.length_conv import length_conv
  kernel = functools.partial(length_conv, interpret=jax.default_backend() != "gpu")
  for fn in (functools.partial(nys.banded_length_conv, block=block), nys.grouped_length_conv,
             nys.depthwise_length_conv, kernel):
    got = np.asarray(jax.jit(fn)(values, taps))
    np.testing.assert_allclose(got, want, rtol=_fp32_tol(1e-5),
                               atol=_fp32_tol(1e-5) * np.abs(want).max())
  # gradients w.r.t. the values and the taps: the conv is linear in each, so the exact
  # gradient of <out, c> is the adjoint conv (values) and a correlation (taps)
  cot = rng.normal(size=want.shape).astype(np.float32)
  want_v = np_length_conv(cot, taps[::-1])
  padded = np.pad(values.astype(np.float64), ((0, 0), (size // 2, size // 2), (0, 0), (0, 0)))
  want_w = np.stack([np.einsum("blhd,blhd->h", cot, padded[:, t:t + length])
                     for t in range(size)])
  for fn in (functools.partial(nys.banded_length_conv, block=block), kernel):
    grad_v, grad_w = jax.grad(lambda x, w, fn=fn: jnp.vdot(fn(x, w), cot),
                              argnums=(0, 1))(values, taps)
    np.testing.assert_allclose(np.asarray(grad_v), want_v, rtol=_fp32_tol(1e-4),
                               atol=_fp32_tol(1e-4) * np.abs(want_v).max())
    np.testing.assert_allclose(np.asarray(grad_w), want_w, rtol=_fp32_tol(1e-4),
                               atol=_fp32_tol(1e-4) * np.abs(want_w).max())
  with pytest.raises(ValueError, match="K//2 <= block"):
    nys.banded_length_conv(values, np.ones((2 * block + 3, 3), np.float32), block=block)
  with pytest.raises(ValueError, match="taps must be odd"):
    length_conv(values, np.ones((4, 3), np.float32))
  with pytest.raises(ValueError, match=r"taps \[K, heads\]"):
    length_conv(values, np.ones((5, 2), np.float32))


@pytest.mark.parametrize("length,size,dim,dtype", [
    (130, 35, 8, "bfloat16"), (7, 5, 64, "bfloat16"), (64, 129, 16, "float16"),
    (200, 1, 12, "bfloat16"), (300, 35, 64, "bfloat16")])
def test_banded_conv_kernel_matches_numpy(length, size, dim, dtype):
  """The tensor-core conv for half-precision V (block-banded products, taps and float32
  cotangents split into hi + lo parts, rows past the ends masked): value and tap gradient at
  float32-like accuracy, the values' gradient within its own rounding to the input dtype; odd
  lengths (a partial last block), head dims below 16 and not powers of two (zero columns), taps
  longer than a block's half (K = 129: 64 per side) and a single tap. Then with the residual
  added in the kernel: the sum rounded once to the residual's dtype, the residual's gradient
  the cotangent itself, and a half-precision cotangent (one part) for the other gradients.
  Outputs are not pre-zeroed by Pallas, so a row the kernel skipped would be garbage.
  Interpreter on the CPU, the kernels on a GPU."""
  from lra_sparse.kernels.nystrom.length_conv import banded_length_conv
  rng = np.random.default_rng(length + size + dim)
  values = jnp.asarray(rng.normal(size=(2, length, 3, dim)), dtype)
  taps = rng.normal(size=(size, 3)).astype(np.float32)
  fn = functools.partial(banded_length_conv, interpret=jax.default_backend() != "gpu")
  want = np_length_conv(np.asarray(values, np.float32), taps)
  got = np.asarray(jax.jit(fn)(values, taps))
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=0, atol=3e-5 * np.abs(want).max())
  padded = np.pad(np.asarray(values, np.float64), ((0, 0), (size // 2, size // 2), (0, 0), (0, 0)))
  eps = float(jnp.finfo(values.dtype).eps)

  def check_grads(grad_v, grad_w, cot):
    want_v = np_length_conv(cot, taps[::-1])
    want_w = np.stack([np.einsum("blhd,blhd->h", cot, padded[:, t:t + length])
                       for t in range(size)])
    assert grad_v.dtype == values.dtype
    np.testing.assert_allclose(np.asarray(grad_v, np.float64), want_v, rtol=eps,
                               atol=1e-4 * np.abs(want_v).max())
    np.testing.assert_allclose(np.asarray(grad_w), want_w, rtol=0,
                               atol=5e-5 * np.abs(want_w).max())

  cot = rng.normal(size=want.shape).astype(np.float32)
  check_grads(*jax.grad(lambda x, w: jnp.vdot(fn(x, w), cot), argnums=(0, 1))(values, taps),
              cot)
  # the residual added in the kernel's epilogue, in the residual's (half) dtype
  residual = jnp.asarray(rng.normal(size=want.shape) * 4.0, dtype)
  got = jax.jit(fn)(values, taps, residual)
  assert got.dtype == residual.dtype
  summed = np.asarray(residual, np.float64) + want
  np.testing.assert_allclose(np.asarray(got, np.float64), summed, rtol=eps,
                             atol=3e-5 * np.abs(summed).max())
  half_cot = jnp.asarray(cot, dtype)
  grads = jax.grad(lambda x, w, r: jnp.vdot(fn(x, w, r).astype(jnp.float32),
                                            half_cot.astype(jnp.float32)),
                   argnums=(0, 1, 2))(values, taps, residual)
  assert grads[2].dtype == residual.dtype
  np.testing.assert_array_equal(np.asarray(grads[2]), np.asarray(half_cot))
  check_grads(grads[0], grads[1], np.asarray(half_cot, np.float64))
  with pytest.raises(ValueError, match="residual must have the values' shape"):
    fn(values, taps, residual[:, 1:])


def np_landmark_attention(q, k, v, scale, nm=None, mask=None):
  """float64 softmax(q k^T * scale) v over the kept keys (N:M of ``nm`` on groups of M keys
  from key 0, keys past the length and masked keys -inf; a row with no key gives 0) and its
  VJP for cotangent c; q [b, rows, h, d], k, v [b, keys, h, d]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("blhd,bmhd->bhlm", q, k) * scale
  if mask is not None:
    s = np.where(np.asarray(mask)[:, None, None, :], s, -np.inf)
  keep = np.ones(s.shape, bool)
  if nm is not None:
    keys = s.shape[-1]
    padded = np.pad(s, [(0, 0)] * 3 + [(0, -keys % nm[1])], constant_values=-np.inf)
    keep = np_nm_mask(padded, *nm)[..., :keys]
  p = np_softmax_where(s, keep)
  out = np.einsum("bhlm,bmhd->blhd", p, v)

  def vjp(c):
    c = np.asarray(c, np.float64)
    dp = np.einsum("blhd,bmhd->bhlm", c, v)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * scale
    return (np.einsum("bhlm,bmhd->blhd", ds, k), np.einsum("bhlm,blhd->bmhd", ds, q),
            np.einsum("bhlm,blhd->bmhd", p, c))
  return out, vjp


def _check_kernel_against_float64(fn, q, k, v, want, vjp, rng):
  """Output and the q, k, v gradients of ``fn`` (jitted) against float64, within the
  half-precision rounding of the probabilities and operands (flash attention's)."""
  cot = rng.normal(size=want.shape)
  got, got_vjp = jax.vjp(jax.jit(fn), q, k, v)
  grads = got_vjp(jnp.asarray(cot, q.dtype))
  assert got.dtype == q.dtype
  tol = 2 * float(jnp.finfo(q.dtype).eps)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                             atol=tol * np.abs(want).max())
  for name, g, w in zip("qkv", grads, vjp(np.asarray(jnp.asarray(cot, q.dtype), np.float64))):
    assert g.dtype == q.dtype and g.shape == w.shape, name
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=0,
                               atol=4 * tol * np.abs(w).max(), err_msg=name)
  return got, grads


@pytest.mark.parametrize("length,keys,dim,dtype,nm", [
    (300, 32, 16, "bfloat16", None), (128, 64, 64, "bfloat16", None),
    (1, 16, 32, "float16", None), (1100, 64, 16, "float16", None),
    (300, 64, 16, "bfloat16", (2, 4)), (130, 32, 32, "float16", (1, 2)),
    (70, 64, 16, "bfloat16", (3, 4)), (100, 64, 4, "bfloat16", (2, 4)),
    (65, 32, 24, "float16", None)])
def test_few_keys_attention_kernel_matches_float64(length, keys, dim, dtype, nm):
  """F (.)'s kernel (all keys in one tile; query rows past the length masked), plain and N:M
  along the keys: output and the gradients of q, k, v against float64 numpy; lengths with a
  partial last row block, a single row, and more row blocks than one backward program takes
  (1100 = 18 blocks of 64: two programs of 16 blocks, the second with 14 past the end). Pallas'
  interpreter fills outputs with NaN before the kernels run, so a row they fail to write, or
  a read of the log-sum-exp blocks past the end, shows on the CPU; head dims 4 and 24 run
  zero-padded to 16 and 32. Interpreter on the CPU, the kernels on a GPU."""
  from lra_sparse.kernels.nystrom import landmark as la  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(length + keys + dim)
  q, k, v = (jnp.asarray(rng.normal(size=(3, n, 2, dim)), dtype)
             for n in (length, keys, keys))
  fn = functools.partial(la.few_keys_attention, nm=nm, interpret=jax.default_backend() != "gpu")
  want, vjp = np_landmark_attention(q, k, v, dim ** -0.5, nm=nm)
  _check_kernel_against_float64(fn, q, k, v, want, vjp, rng)


@pytest.mark.parametrize("keys,queries,dim,dtype,nm", [
    (530, 16, 16, "bfloat16", None), (530, 64, 32, "bfloat16", (2, 4)),
    (1030, 32, 16, "float16", (1, 2)), (131, 16, 64, "bfloat16", (2, 8)),
    (200, 16, 16, "float16", (3, 4)), (300, 16, 8, "bfloat16", (2, 4))])
def test_few_queries_attention_kernel_matches_float64(keys, queries, dim, dtype, nm):
  """B V's kernel (the m landmark queries over all keys), plain and N:M along the keys: output
  and gradients against float64 numpy, with a key mask that has holes, an example with no
  real key (zeros, no NaN, zero gradients), lengths that are not a multiple of M (the last
  group's missing members count as masked), more than one span of keys (530 and 1030: the
  spans' partial softmaxes combined) and head dim 8 (zero-padded to 16). Interpreter on the
  CPU, the kernels on a GPU."""
  from lra_sparse.kernels.nystrom import landmark as la  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(keys + queries + dim)
  q, k, v = (jnp.asarray(rng.normal(size=(3, n, 2, dim)), dtype)
             for n in (queries, keys, keys))
  mask = rng.random((3, keys)) < 0.7
  mask[1] = False
  mask[2, keys // 2:] = False
  fn = functools.partial(la.few_queries_attention, mask=jnp.asarray(mask), nm=nm,
                         interpret=jax.default_backend() != "gpu")
  want, vjp = np_landmark_attention(q, k, v, dim ** -0.5, nm=nm, mask=mask)
  got, grads = _check_kernel_against_float64(fn, q, k, v, want, vjp, rng)
  assert np.all(np.asarray(got[1]) == 0)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  for g in grads[1:]:                  # masked keys get no gradient (all of example 1's)
    assert np.all(np.asarray(g, np.float32)[~mask] == 0)


def test_landmark_attention_kernels_reject_bad_input():
  from lra_sparse.kernels.nystrom import landmark as la  # pylint: disable=import-outside-toplevel
  q = jnp.ones((2, 40, 2, 16), jnp.bfloat16)
  k = jnp.ones((2, 16, 2, 16), jnp.bfloat16)
  wide_q = jnp.ones((2, 40, 2, 160), jnp.bfloat16)     # head dim over 128
  wide_k = jnp.ones((2, 16, 2, 160), jnp.bfloat16)
  for args, kwargs, match in [
      ((q, k[:, :, :1], k[:, :, :1]), {}, r"k, v of one shape with q's batch, heads"),
      ((q, k, k[:, :8]), {}, "k, v of one shape"),
      ((q, k[:, :12], k[:, :12]), {}, "12 keys"),
      ((wide_q, wide_k, wide_k), {}, "head dim 160"),
      ((q.astype(jnp.float32), k.astype(jnp.float32), k.astype(jnp.float32)), {}, "float32"),
      ((q, k.astype(jnp.float16), k), {}, "one dtype"),
      ((q, k, k), {"nm": (2, 4)}, r"16 keys, nm=\(2, 4\)"),
      ((q, k, k), {"nm": (3, 2)}, "0 < n <= m")]:
    with pytest.raises(ValueError, match=match):
      la.few_keys_attention(*args, interpret=True, **kwargs)
  for args, kwargs, match in [
      ((k, q, q[:, :, :1]), {}, "k, v of one shape"),
      ((k[:, :12], q, q), {}, "12 queries"),
      ((k, q, q), {"nm": (2, 3)}, r"nm=\(2, 3\)"),
      ((wide_k, wide_q, wide_q), {}, "head dim 160"),
      ((k, q, q), {"mask": jnp.ones((2, 39), bool)}, r"mask must be bool \[b, L\]"),
      ((k.astype(jnp.float32),) + (q.astype(jnp.float32),) * 2, {}, "float32")]:
    with pytest.raises(ValueError, match=match):
      la.few_queries_attention(*args, interpret=True, **kwargs)


@pytest.mark.parametrize("length,landmarks,nm", [(70, 16, None), (70, 32, (1, 2)),
                                                  (130, 64, (2, 4))])
def test_nystrom_pallas_formulation_equals_explicit(length, landmarks, nm):
  """implementation='pallas' (F (.) and B V on the Pallas kernels, plain or N:M-pruned inside
  their tiles; the interpreter on the CPU) computes the explicit formulation's function, values
  and q, k, v gradients on the real rows, with padding, a length that is not a multiple of the
  landmarks (nor, at 130, of M = 4), a mask with a hole and a fully padded
  example (zeros). One clear error where the kernels do not apply."""
  rng = np.random.default_rng(length + landmarks)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(27, (3, length, H, 16)))
  mask = np.arange(length)[None, :] < np.array([[length], [length // 3], [0]])
  mask[0, 5] = False
  mask = jnp.asarray(mask)
  real = np.asarray(mask)[:, :, None, None]
  cot = jnp.asarray(rng.normal(size=q.shape) * real, jnp.float32)

  def loss(q, k, v, implementation):
    out = nystrom_attention(q, k, v, num_landmarks=landmarks, nm=nm, mask=mask,
                            implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * cot), out

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  (_, got), got_grads = grad(q, k, v, "pallas")
  (_, want), want_grads = grad(*(x.astype(jnp.float32) for x in (q, k, v)), "xla")
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.all(np.isfinite(got)) and np.all(got[2] == 0)
  assert np.linalg.norm(np.where(real, got - want, 0)) <= 3e-2 * np.linalg.norm(want)
  for g, w in zip(got_grads, want_grads):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g))
    assert np.linalg.norm(np.where(real, g - w, 0)) <= 5e-2 * np.linalg.norm(w)
  with pytest.raises(ValueError, match=r"implementation='pallas'.*float32"):
    nystrom_attention(*(x.astype(jnp.float32) for x in (q, k, v)), num_landmarks=landmarks,
                      nm=nm, implementation="pallas")
  with pytest.raises(ValueError, match=r"implementation='pallas'.*12 landmarks"):
    nystrom_attention(q, k, v, num_landmarks=12, implementation="pallas")


def test_nystrom_auto_plan_on_a_gpu(monkeypatch):
  """Where 'auto' runs F (.) and B V on a GPU (the backend stood in for): both on the Pallas
  kernels where they apply, plain or N:M (head dim 4 too, zero-padded); cuDNN for a plain
  part they cannot take (head dim 160, or 12 landmarks); the XLA formulation for N:M they
  cannot take, float32 or dropout."""
  from lra_sparse.attention import nystrom as nystrom_lib  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(nystrom_lib.jax, "default_backend", lambda: "gpu")
  plan = functools.partial(nystrom_lib._flash_plan, "auto")  # pylint: disable=protected-access
  bf16 = jnp.bfloat16
  assert plan(bf16, 64, 64, None, False) == ("pallas", "pallas")
  assert plan(bf16, 64, 64, (2, 4), False) == ("pallas", "pallas")
  assert plan(jnp.float16, 32, 16, (1, 2), False) is None        # 8 landmarks per member
  assert plan(bf16, 4, 64, (2, 4), False) == ("pallas", "pallas")  # head dim 4 widened
  assert plan(bf16, 160, 64, None, False) == ("cudnn", "cudnn")
  assert plan(bf16, 64, 12, None, False) == ("cudnn", "cudnn")
  assert plan(bf16, 160, 64, (2, 4), False) is None
  assert plan(jnp.float32, 64, 64, None, False) is None
  assert plan(bf16, 64, 64, None, True) is None


@pytest.mark.parametrize("m,iters", [(16, 1), (64, 6), (32, 3)])
def test_fused_pinv_matches_the_iteration_and_its_autodiff(m, iters):
  """The pseudo-inverse in one Pallas program per matrix (``kernels/nystrom/pinv.py``): Z and the
  gradient of <Z, C> for A against XLA's iteration and its autodiff (float32: bit for bit in
  the interpreter, where products are exact; TF32 on a GPU). A is a batch of row softmaxes,
  as the Nystromformer's; the interpreter fills outputs with NaN first, so an unwritten
  entry shows. Where the kernel does not apply (m = 12) the iteration runs on XLA."""
  from lra_sparse.attention import nystrom as nystrom_lib  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(m + iters)
  a = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, 3, m, m)) * 2, jnp.float32), axis=-1)
  c = jnp.asarray(rng.normal(size=a.shape), jnp.float32)

  def value_and_grad(fused):
    fn = lambda a: jnp.sum(nystrom_lib.iterative_pinv(a, iters, fused=fused) * c)  # noqa: E731
    return (jax.jit(lambda a: nystrom_lib.iterative_pinv(a, iters, fused=fused))(a),
            jax.jit(jax.grad(fn))(a))

  (got, got_grad), (want, want_grad) = value_and_grad(True), value_and_grad(False)
  tol = 1e-6 if jax.default_backend() != "gpu" else 3e-3
  assert np.all(np.isfinite(np.asarray(got))) and np.all(np.isfinite(np.asarray(got_grad)))
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * float(jnp.max(jnp.abs(want))))
  np.testing.assert_allclose(got_grad, want_grad, rtol=0,
                             atol=tol * float(jnp.max(jnp.abs(want_grad))))
  small = a[..., :12, :12]
  np.testing.assert_array_equal(nystrom_lib.iterative_pinv(small, iters, fused=True),
                                nystrom_lib.iterative_pinv(small, iters))


def _np_pinv_iteration(a, iters):
  """The Nystromformer's pseudo-inverse iteration in float64 numpy, written from the paper:
  Z_0 = A^T / (max column sum * max row sum) over the whole batch, then
  Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4."""
  a = np.asarray(a, np.float64)
  eye = np.eye(a.shape[-1])
  z = np.swapaxes(a, -1, -2) / (np.abs(a).sum(-2).max() * np.abs(a).sum(-1).max())
  for _ in range(iters):
    az = a @ z
    z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
  return z


def _jax_pinv_iteration(a, iters):
  """The same iteration in JAX (float64 under ``jax.enable_x64``): its autodiff is the
  gradient reference of the fused kernel's hand-written backward."""
  eye = jnp.eye(a.shape[-1], dtype=a.dtype)
  z = jnp.swapaxes(a, -1, -2) / (jnp.max(jnp.sum(jnp.abs(a), -2))
                                 * jnp.max(jnp.sum(jnp.abs(a), -1)))
  for _ in range(iters):
    az = a @ z
    z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
  return z


@pytest.mark.parametrize("m,iters", [(16, 3), (32, 6)])
def test_fused_pinv_against_float64_references(m, iters):
  """The fused pseudo-inverse (the Pallas program and its hand-written backward; the
  interpreter on a CPU) against independent float64 references: its value against the
  iteration in numpy, its gradient against float64 autodiff of the iteration (itself checked
  by central differences). The matrices are row softmaxes scaled per row and per matrix, so
  the maxima over the batch of the row and column sums that set Z_0 are unique (softmax rows
  alone all sum to 1: a tie whose gradient depends on rounding)."""
  from lra_sparse.attention import nystrom as nystrom_lib  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(10 * m + iters)
  rows = 1.0 + 0.05 * np.arange(m)[None, :, None] + 0.4 * np.arange(2)[:, None, None]
  a = (jax.nn.softmax(jnp.asarray(rng.normal(size=(2, m, m)) * 3, jnp.float32), axis=-1)
       * jnp.asarray(rows, jnp.float32))
  c = rng.normal(size=a.shape)
  got = np.asarray(jax.jit(lambda a: nystrom_lib.iterative_pinv(a, iters, fused=True))(a))
  want = _np_pinv_iteration(a, iters)
  tol = 1e-5 if jax.default_backend() != "gpu" else 3e-3
  assert np.max(np.abs(got - want)) < tol * np.max(np.abs(want))
  grad = np.asarray(jax.jit(jax.grad(lambda a: jnp.sum(
      nystrom_lib.iterative_pinv(a, iters, fused=True) * jnp.asarray(c, jnp.float32))))(a))
  with jax.enable_x64(True):
    a64, c64 = jnp.asarray(np.asarray(a), jnp.float64), jnp.asarray(c, jnp.float64)
    loss = lambda a: jnp.sum(_jax_pinv_iteration(a, iters) * c64)  # noqa: E731
    grad64 = np.asarray(jax.grad(loss)(a64))
    u = rng.normal(size=a.shape)
    fd = float(loss(a64 + 1e-6 * u) - loss(a64 - 1e-6 * u)) / 2e-6
  assert abs(fd - np.sum(grad64 * u)) < 1e-4 * np.linalg.norm(grad64) * np.linalg.norm(u)
  assert np.linalg.norm(grad - grad64) < 10 * tol * np.linalg.norm(grad64)


def test_fused_pinv_rejects_bad_input():
  from lra_sparse.kernels.nystrom import pinv as pinv_pallas
  a = jnp.ones((2, 16, 16), jnp.float32)
  for args, match in [((a.astype(jnp.bfloat16), a.astype(jnp.bfloat16), 6), "bfloat16"),
                      ((a[:, :, :12], a[:, :, :12], 6), r"\[2, 16, 12\]"),
                      ((a[..., :12, :12], a[..., :12, :12], 6), r"m in 16, 32 or 64"),
                      ((a, a[:1], 6), r"Z_0 of the same shape"),
                      ((a, a, 0), "iters=0")]:
    with pytest.raises(ValueError, match=match):
      pinv_pallas.iterate(*args, interpret=True)


def test_nystrom_half_precision_stays_close_to_float64():
  """bf16 inputs: half-precision product operands, float32 softmax and pinv; the error against
  the float64 port is that of rounding the inputs and the probabilities to bf16."""
  q, k, v = _qkv(23, (B, L, H, 16))
  mask = _mask()
  to_bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
  got = nystrom_attention(to_bf16(q), to_bf16(k), to_bf16(v), num_landmarks=8,
                          mask=jnp.asarray(mask))
  assert got.dtype == jnp.bfloat16
  rounded = [np.asarray(to_bf16(x), np.float64) for x in (q, k, v)]
  want = np_nystrom_official(*rounded, mask, 8)
  real = mask[:, :, None, None]
  err = np.linalg.norm(np.where(real, np.asarray(got, np.float64) - want, 0))
  assert err / np.linalg.norm(np.where(real, want, 0)) < 2e-2


def test_nystrom_cudnn_formulation_equals_explicit(monkeypatch):
  """The cuDNN path (F and B V as flash attentions of other lengths) computes the same function
  as the explicit one; cuDNN is stood in for by XLA with the same arguments (CPU). Also: one
  clear error where cuDNN does not apply, and a fully padded example gives zeros."""
  from lra_sparse.attention import dense as dense_lib  # pylint: disable=import-outside-toplevel
  real_dpa = jax.nn.dot_product_attention
  calls = []

  def stand_in(q, k, v, *, key_value_seq_lengths, scale, implementation):
    assert implementation == "cudnn" and q.dtype == k.dtype == v.dtype
    calls.append((q.shape, k.shape))
    mask = None
    if key_value_seq_lengths is not None:
      mask = (jnp.arange(k.shape[1])[None, :] < key_value_seq_lengths[:, None])[:, None, None]
    out = real_dpa(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                   mask=mask, scale=scale, implementation="xla")
    return out.astype(q.dtype)

  monkeypatch.setattr(dense_lib.jax.nn, "dot_product_attention", stand_in)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(24, (3, 30, H, 16)))
  mask = jnp.asarray(_mask(lengths=[30, 11, 0], length=30))
  got = nystrom_attention(q, k, v, num_landmarks=8, mask=mask, implementation="cudnn")
  # The length (30, segments of 4 for 8 landmarks) is not padded to 32 in memory.
  assert calls == [((3, 8, H, 16), (3, 30, H, 16)), ((3, 30, H, 16), (3, 8, H, 16))]
  want = nystrom_attention(q, k, v, num_landmarks=8, mask=mask, implementation="xla")
  real = np.asarray(mask)[:, :, None, None]
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.all(np.isfinite(got)) and np.all(got[2] == 0)
  np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=3e-2,
                             atol=3e-2)
  for kwargs, problem in (({"nm": "2:4"}, "nm=(2, 4)"),
                          ({"dropout_rate": 0.1, "dropout_rng": jax.random.PRNGKey(0)},
                           "dropout_rate > 0")):
    with pytest.raises(ValueError, match=rf"implementation='cudnn'.*{re.escape(problem)}"):
      nystrom_attention(q, k, v, num_landmarks=8, mask=mask, implementation="cudnn", **kwargs)
  with pytest.raises(ValueError, match="implementation='cudnn'.*float32"):
    nystrom_attention(*(x.astype(jnp.float32) for x in (q, k, v)), num_landmarks=8,
                      implementation="cudnn")
  with pytest.raises(ValueError, match="config.attention.nystrom.implementation='fast'"):
    build_attention(_config("nystrom", implementation="fast"), _dims())
