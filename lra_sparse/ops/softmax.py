"""Attention math every kind and every kernel reference shares: scores, the safe masked
softmax, probability dropout, A V.

    S = Q K^T / sqrt(d)                    (float32; padded keys -> -inf)
    A = softmax(S) over the entries a kind keeps; a row that keeps nothing gives zeros
    A <- A * Z / (1 - rate), Z ~ Bernoulli(1 - rate)   (attention dropout, training only;
                                             Z: the counter-based mask of ops.dropout)
    O = A V

q, k, v are ``[batch, length, heads, head_dim]``; scores and probabilities are
``[batch, heads, q_len, k_len]``; ``mask`` is the bool ``[batch, length]`` key padding mask
(True = real token).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lra_sparse.ops import dropout


def attention_scores(q, k, mask=None, *, precision=None):
  """S = Q K^T / sqrt(d) as [batch, heads, q_len, k_len]; padded keys -> -inf.

  Accumulates in float32 (float64 for float64 inputs, as the tests' references use).
  """
  accumulate = jnp.promote_types(q.dtype, jnp.float32)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=accumulate,
                      precision=precision)
  scores = scores * jnp.asarray(q.shape[-1] ** -0.5, accumulate)
  if mask is not None:
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  return scores


def masked_softmax(scores, keep=None):
  """Softmax of ``scores`` over the last axis, over the entries where ``keep`` only.

  ``keep=None`` keeps every finite entry (-inf entries, e.g. padded keys, get 0). A row with
  nothing kept gives zeros, never NaN, in values and gradients.
  """
  if keep is None:
    keep = jnp.isfinite(scores)
  # The row max over ALL entries is only a stabiliser (for N:M masks it is also the max over
  # the kept entries: the largest entry is rank 0 in its group); it carries no gradient.
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnorm = jnp.where(keep, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(unnorm, axis=-1, keepdims=True)
  return unnorm / jnp.where(denom > 0, denom, 1.0)


def dropout_probabilities(probs, rate: float, rng):
  """Attention dropout: zero each probability with prob ``rate``, scale the rest by
  1 / (1 - rate), by the counter-based mask of ``ops.dropout`` (the one the fused kernels draw
  for the seed ``ops.dropout.seed_words(rng)``; probs [..., rows, keys], the leading axes
  flattened as batch*heads). ``rate <= 0`` or ``rng=None`` returns ``probs`` unchanged."""
  if rate <= 0.0 or rng is None:
    return probs
  rows, keys = probs.shape[-2:]
  lead = probs.shape[:-2]
  mult = dropout.key_multiplier(dropout.seed_words(rng), 1, int(np.prod(lead, dtype=int)),
                                rows, keys, rate).reshape(probs.shape)
  return probs * mult.astype(probs.dtype)


def attend(probs, v, out_dtype=None):
  """O = A V: probs [batch, heads, q_len, k_len], v [batch, k_len, heads, d] ->
  [batch, q_len, heads, d] in ``out_dtype`` (default v's dtype), accumulated in float32."""
  accumulate = jnp.promote_types(v.dtype, jnp.float32)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                   preferred_element_type=accumulate)
  return out.astype(out_dtype or v.dtype)
