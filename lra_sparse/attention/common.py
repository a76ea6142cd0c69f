"""Attention math every kind shares: scores, the safe masked softmax, probability dropout.

    S = Q K^T / sqrt(d)                    (float32; padded keys -> -inf)
    A = softmax(S) over the entries a kind keeps; a row that keeps nothing gives zeros
    A <- A * Bernoulli(1 - rate) / (1 - rate)     (attention dropout, training only)
    O = A V

q, k, v are ``[batch, length, heads, head_dim]``; scores and probabilities are
``[batch, heads, q_len, k_len]``; ``mask`` is the bool ``[batch, length]`` key padding mask
(True = real token). Used by the dense reference, DFSS, DSA, Nystromformer, the kernels'
references and the analysis tools. ``per_data_shard`` runs a kernel call once per shard of
a data-parallel batch.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

_WARNED_ONCE: set[str] = set()
DATA_AXIS = "data"     # the trainer's mesh axis: the batch is split along it


def data_shards() -> int:
  """How many shards ``per_data_shard`` splits a batch into here (1: no data-parallel mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA_AXIS not in mesh.axis_names:
    return 1
  return mesh.shape[DATA_AXIS]


def per_data_shard(fn, *args, replicated: tuple[int, ...] = ()):
  """``fn(*args)``, on a data-parallel mesh once per device on its part of the batch.

  XLA cannot split a custom call (a Triton, Pallas or Mosaic GPU kernel) along the batch: on
  a mesh it gathers the whole batch onto every device and runs the kernel there, once per
  device (the same result, devices times the work). Under a mesh set by ``jax.set_mesh``
  whose ``"data"`` axis has more than one device, ``fn`` runs inside ``jax.shard_map`` instead:
  every argument and result split along axis 0 (the batch), except the arguments at the
  positions ``replicated`` (e.g. a conv's weights), which every shard gets whole (their
  gradients are summed over the shards). Without such a mesh: ``fn(*args)``. ``fn`` must act
  on each example independently; when ``data_shards() > 1``, ``jax.lax.axis_index(DATA_AXIS)``
  inside it names the shard.
  """
  if data_shards() == 1:
    return fn(*args)
  specs = tuple(PartitionSpec() if i in replicated else PartitionSpec(DATA_AXIS)
                for i in range(len(args)))
  return jax.shard_map(fn, in_specs=specs, out_specs=PartitionSpec(DATA_AXIS),
                       check_vma=False)(*args)


def shard_dropout_seed(seed):
  """Inside ``per_data_shard``: the Philox key (int32 [2] or None) of this shard's part of the
  batch. The fused kernels draw by (example, head, row, key) within their call, so each shard
  of a data-parallel batch gets its own key and no two shards share masks."""
  if seed is None or data_shards() == 1:
    return seed
  return seed.at[1].add(jax.lax.axis_index(DATA_AXIS))


def warn_once(message: str) -> None:
  """Logs ``message`` as a warning the first time it is seen in this process (fallbacks that
  would otherwise repeat at every trace)."""
  if message not in _WARNED_ONCE:
    _WARNED_ONCE.add(message)
    logging.warning(message)


def kernel_module(name: str, kind: str, required: bool, backend: str = "triton"):
  """``lra_sparse.kernels.<name>`` when it imports and reports a usable GPU; else None (logged
  once), or one ValueError naming the problem when ``required`` (backend=<backend>)."""
  import importlib  # pylint: disable=import-outside-toplevel
  label = {"triton": "Triton", "mosaic": "Mosaic GPU"}[backend]
  needs = {"triton": "a GPU with jax-triton",
           "mosaic": "a Hopper GPU (sm_90) with Pallas Mosaic GPU"}[backend]
  try:
    module = importlib.import_module(f"lra_sparse.kernels.{name}")
  except Exception as error:  # pylint: disable=broad-except  (jax_triton may fail in many ways)
    if required:
      raise ValueError(
          f"backend={backend!r} but lra_sparse/kernels/{name}.py cannot be imported "
          f"({type(error).__name__}: {error}); use backend='reference' or 'auto'") from error
    warn_once(f"{kind} {label} kernel unavailable ({type(error).__name__}: {error}); using "
              "another path.")
    return None
  if not module.is_available():
    if required:
      raise ValueError(
          f"backend={backend!r} but the {kind} {label} kernel is not available here "
          f"(jax backend {jax.default_backend()!r}; it needs {needs}); use "
          "backend='reference' or 'auto'")
    return None
  return module


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
  1 / (1 - rate). ``rate <= 0`` or ``rng=None`` returns ``probs`` unchanged."""
  if rate <= 0.0 or rng is None:
    return probs
  if not rate < 1.0:
    raise ValueError(f"attention dropout rate {rate} must be in [0, 1)")
  keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
  return jnp.where(keep, probs / (1.0 - rate), 0.0)


def attend(probs, v, out_dtype=None):
  """O = A V: probs [batch, heads, q_len, k_len], v [batch, k_len, heads, d] ->
  [batch, q_len, heads, d] in ``out_dtype`` (default v's dtype), accumulated in float32."""
  accumulate = jnp.promote_types(v.dtype, jnp.float32)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                   preferred_element_type=accumulate)
  return out.astype(out_dtype or v.dtype)
