"""DFSS: dynamic N:M fine-grained structured sparse attention (DFSS paper, Sec. 3).

    S = Q K^T / sqrt(d), padded keys -> -inf
    keep = the n largest (signed) of every m consecutive keys of each row   (nm_mask)
    A = softmax over the kept entries only;  O = A V

Gradients are those of the masked softmax: pruned and padded entries get zero gradient (the
mask is piecewise constant; there is no straight-through estimator). A group or a row with no
real key gives zeros, never NaN, in values and gradients.

Backends: "reference" is pure JAX and runs everywhere; "triton" calls the fused kernel in
``kernels/dfss_triton.py`` (GPU only, imported lazily so CPU installs never import
jax_triton/triton); "auto" picks Triton on a GPU when that module reports itself available.

The pure-JAX path is one dense score pass: S is computed once, the N:M keep mask comes from m
elementwise comparisons per entry that XLA fuses into the softmax passes (no sort, no gather,
no [.., L, L, m] tensor), and a custom VJP reuses the stored probabilities so the backward
pass costs what dense attention's does.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from lra_sparse.attention.nm import check_nm, nm_mask
from lra_sparse.attention.registry import AttentionDims, register_attention

BACKENDS = ("auto", "triton", "reference")


def _triton_module(required: bool) -> Optional[Any]:
  """Returns ``kernels.dfss_triton`` when usable; else None, or one ValueError if required."""
  try:
    from kernels import dfss_triton  # pylint: disable=import-outside-toplevel
  except Exception as error:  # pylint: disable=broad-except  (jax_triton may fail in many ways)
    if required:
      raise ValueError(
          "config.attention.backend='triton' but kernels/dfss_triton.py cannot be imported "
          f"({type(error).__name__}: {error}); use backend='reference' or 'auto'") from error
    logging.warning("DFSS Triton kernel unavailable (%s: %s); using the pure-JAX path.",
                    type(error).__name__, error)
    return None
  if not dfss_triton.is_available():
    if required:
      raise ValueError(
          "config.attention.backend='triton' but the DFSS Triton kernel is not available here "
          f"(jax backend {jax.default_backend()!r}; it needs a GPU with jax-triton); use "
          "backend='reference' or 'auto'")
    return None
  return dfss_triton


def _kernel_supports(q, v, n: int, m: int) -> bool:
  """What kernels/dfss_triton.py accepts; "auto" uses the pure-JAX path for anything else."""
  return (n < m <= 32 and m & (m - 1) == 0 and q.shape[-1] in (16, 32, 64, 128)
          and q.shape == v.shape
          and jnp.dtype(q.dtype) in (jnp.float32, jnp.bfloat16, jnp.float16))


def _masked_scores(q, k, mask):
  """S = Q K^T / sqrt(d) in float32 as [batch, heads, q_len, k_len]; padded keys -> -inf."""
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  scores = scores * jnp.float32(q.shape[-1] ** -0.5)
  if mask is not None:
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  return scores


def masked_softmax(scores, keep):
  """Softmax of ``scores`` over the entries where ``keep``; rows with nothing finite -> 0."""
  # The row max over ALL entries equals the max over the kept ones for N:M masks (the largest
  # entry is rank 0 in its group) and is only a stabiliser otherwise: no mask is needed here.
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnorm = jnp.where(keep, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(unnorm, axis=-1, keepdims=True)
  return unnorm / jnp.where(denom > 0, denom, 1.0)


def dfss_probabilities(q, k, *, n: int, m: int, mask=None):
  """The DFSS attention matrix A [batch, heads, q_len, k_len] (float32), for analysis."""
  scores = _masked_scores(q, k, mask)
  return masked_softmax(scores, nm_mask(scores, n, m))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dfss_reference(q, k, v, mask, n, m):
  out, _ = _dfss_reference_fwd(q, k, v, mask, n, m)
  return out


def _dfss_reference_fwd(q, k, v, mask, n, m):
  probs = dfss_probabilities(q, k, n=n, m=m, mask=mask)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32).astype(q.dtype)
  return out, (q, k, v, mask, probs)


def _dfss_reference_bwd(n, m, residuals, d_out):
  """Masked-softmax backward: probs are 0 at pruned/padded keys, so dS is 0 there too."""
  del n, m
  q, k, v, mask, probs = residuals
  d_out = d_out.astype(jnp.float32)
  d_v = jnp.einsum("bhqk,bqhd->bkhd", probs, d_out)
  d_probs = jnp.einsum("bqhd,bkhd->bhqk", d_out, v.astype(jnp.float32))
  d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
  d_scores = d_scores * jnp.float32(q.shape[-1] ** -0.5)
  d_q = jnp.einsum("bhqk,bkhd->bqhd", d_scores, k.astype(jnp.float32))
  d_k = jnp.einsum("bhqk,bqhd->bkhd", d_scores, q.astype(jnp.float32))
  return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


_dfss_reference.defvjp(_dfss_reference_fwd, _dfss_reference_bwd)


def _dfss_reference_dropout(q, k, v, mask, n, m, dropout_rate, dropout_rng):
  """Plain (autodiff) formulation with dropout on the kept probabilities."""
  probs = dfss_probabilities(q, k, n=n, m=m, mask=mask)
  keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
  probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(q.dtype)


def dfss_attention(q, k, v, *, n: int = 2, m: int = 4, mask=None, backend: str = "auto",
                   dropout_rate: float = 0.0, dropout_rng=None, deterministic_kernels: bool = False):
  """DFSS N:M attention. q, k, v: [batch, length, heads, head_dim]; mask: bool [batch, length]
  key padding (True = real token). Requires 0 < n <= m (n == m is dense attention) and
  length % m == 0. Attention dropout (rate > 0 with an rng) always runs the pure-JAX path.
  deterministic_kernels: the Triton backward without atomics (bit-reproducible gradients);
  the pure-JAX path is deterministic either way.
  """
  check_nm(n, m, what="dfss_attention")
  if backend not in BACKENDS:
    raise ValueError(f"dfss_attention: unknown backend {backend!r}; choose one of {BACKENDS}")
  if q.ndim != 4 or k.shape != q.shape or v.shape[:-1] != k.shape[:-1]:
    raise ValueError(f"dfss_attention: q, k, v must be [batch, length, heads, head_dim] with "
                     f"equal q/k shapes; got {q.shape}, {k.shape}, {v.shape}")
  length = k.shape[1]
  if length % m:
    raise ValueError(f"dfss_attention: sequence length {length} is not a multiple of m={m} "
                     f"(pad the sequence, e.g. config.model.pad_multiple, to a multiple of m)")
  if mask is not None:
    if mask.shape != k.shape[:2]:
      raise ValueError(f"dfss_attention: mask must be bool [batch, length] = {k.shape[:2]}, "
                       f"got {mask.shape}")
    mask = mask.astype(bool)
  use_dropout = dropout_rate > 0.0 and dropout_rng is not None
  if use_dropout:
    if backend == "triton":
      raise ValueError("dfss_attention: the Triton kernel has no attention dropout; use "
                       "backend='reference' or 'auto', or dropout_rate=0")
    return _dfss_reference_dropout(q, k, v, mask, n, m, dropout_rate, dropout_rng)
  kernel = None
  if backend == "triton":
    kernel = _triton_module(required=True)
  elif (backend == "auto" and jax.default_backend() == "gpu"
        and _kernel_supports(q, v, n, m)):
    kernel = _triton_module(required=False)
  if kernel is not None:
    return kernel.dfss_attention_triton(q, k, v, n=n, m=m, mask=mask,
                                        deterministic=deterministic_kernels)
  if mask is None:
    mask = jnp.ones(k.shape[:2], bool)
  return _dfss_reference(q, k, v, mask, n, m)


class DFSSAttention(nn.Module):
  """Attention core for ``config.attention.kind = "dfss"``."""
  dims: AttentionDims
  n: int = 2
  m: int = 4
  backend: str = "auto"
  deterministic_kernels: bool = False

  @nn.compact
  def __call__(self, q, k, v, *, mask, inputs=None, deterministic=True):
    del inputs
    if self.dims.dropout_rate > 0.0 and not deterministic:
      return dfss_attention(q, k, v, n=self.n, m=self.m, mask=mask, backend=self.backend,
                            dropout_rate=self.dims.dropout_rate,
                            dropout_rng=self.make_rng("dropout"))
    return dfss_attention(q, k, v, n=self.n, m=self.m, mask=mask, backend=self.backend,
                          deterministic_kernels=self.deterministic_kernels)


@register_attention("dfss")
def _build_dfss(config, dims: AttentionDims) -> nn.Module:
  """Validates config.attention.{n, m, backend, deterministic_kernels} against ``dims``.

  The config requires n < m: n == m keeps every key (use kind="dense" for that; the functional
  ``dfss_attention`` accepts it as a sanity check).
  """
  n, m, backend = config.get("n", 2), config.get("m", 4), config.get("backend", "auto")
  deterministic_kernels = config.get("deterministic_kernels", False)
  if not isinstance(deterministic_kernels, bool):
    raise ValueError(f"config.attention.deterministic_kernels={deterministic_kernels!r} must be "
                     f"True or False")
  for name, value in (("n", n), ("m", m)):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"config.attention.{name}={value!r} must be a positive integer")
  if n >= m:
    raise ValueError(f"config.attention.n={n} must be < config.attention.m={m} "
                     f"(n == m is dense attention: use config.attention.kind='dense')")
  if dims.length % m:
    raise ValueError(f"sequence length {dims.length} (after CLS and padding) is not a multiple "
                     f"of config.attention.m={m}; set config.model.pad_multiple to a multiple "
                     f"of {m}")
  if backend not in BACKENDS:
    raise ValueError(f"config.attention.backend={backend!r}; choose one of {BACKENDS}")
  if backend == "triton":
    _triton_module(required=True)
    if dims.dropout_rate > 0.0:
      raise ValueError("config.attention.backend='triton' has no attention dropout; set "
                       "config.model.attention_dropout_rate=0 or backend='auto'")
  return DFSSAttention(dims=dims, n=n, m=m, backend=backend,
                       deterministic_kernels=deterministic_kernels)
