"""DSA: dynamic sparse attention with a trained low-rank prediction path (DSA paper, Sec. 3).

    P      in sqrt(3/k) * {-1, 0, +1}^{d x k}   (+-1 with prob 1/6 each, 0 with prob 2/3)
    Q~_h = X P W~q_h,  K~_h = X P W~k_h          (W~q_h, W~k_h in R^{k x k}, trainable)
    S~_h = Q~_h K~_h^T / sqrt(head_dim)          (scaled like S; see below)
    M    = top-k of S~ per row (keep ceil((1 - sparsity) * n_real) keys) or S~ >= threshold
    A    = softmax(S restricted to M) with the REAL scores S = Q K^T / sqrt(head_dim);  O = A V
    loss += mse_weight * L_MSE(S, S~)           (sown as aux_loss "dsa_mse")

Choices (the papers leave these open):
- P is not a parameter: it is a pure function of the module's path and (d, k), drawn with
  numpy's PCG64 from a fixed seed (config.seed does not change it). It is identical across
  runs, restarts and ``init_from`` loads without being stored in checkpoints, and the
  optimizer (and decoupled weight decay) can never touch it. The same P serves the query and
  the key predictor, as in the paper; each layer draws its own.
- d is the model width (the block input ``inputs`` is X), k = round(sigma * d).
- S~ carries the same 1/sqrt(head_dim) as S, so top-k and thresholds see the logits the
  softmax sees (scaling both by one constant does not change a top-k).
- L_MSE (``mse_normalization``):
  "eq6" (default) is the paper's Eq. 6, L_MSE = ||Q K^T - Q~ K~^T||^2 / B: the UNSCALED scores
  (the paper "omits the scaling factor"), squared differences summed over heads and pairs,
  divided by the batch size B (so with k gradient-accumulation micro-batches the averaged
  update is that of the whole batch). "scaled_mean" (this repository's form before the paper's
  became the default) compares the scaled scores and takes the mean over heads and pairs:
  eq6 = scaled_mean x head_dim x heads x (real pairs per example, about L^2), so an
  mse_weight tuned for one form does not carry over to the other.
  Both count only pairs of two real tokens: a padded key is masked out of every softmax and
  a padded query's output is never pooled, so their scores never reach the model's output;
  fitting them would spend the predictor (and, through S, the main q/k projections) on
  padding, and weight each example by its padded length. Gradients reach both the predictor
  (W~) and the main q/k projections through S, as the paper's joint update intends.
- top-k keeps ceil((1 - sparsity) * n_real) keys of each row, where n_real is the number of real
  keys of that example (sparsity 0 is dense). Padded keys are never selected.
- Column-vector granularity V in {1, 4, 8}: V consecutive query rows share the kept columns,
  chosen from the mean of S~ over the real rows of the group.
- Fake quantisation (quant_bits 2/4/8) of X and of W~: symmetric, per tensor (X's scale from
  its real tokens only), straight-through gradient.
- S~ is also sown into "intermediates" (stored only when a caller makes that collection
  mutable, as lra_sparse.analysis does; Flax's init never stores it).
- Metrics: "dsa_mse" always; "dsa_hit_rate" (share of predicted keys that are in the exact
  top-k of S with the same per-row count) only when ``deterministic`` (eval), since its extra
  top-k over S would slow training.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn

from lra_sparse.attention import common
from lra_sparse.attention.registry import (AUX_LOSS, AUX_METRICS, AttentionDims, KindConfig,
                                           register_attention)

SELECTIONS = ("topk", "threshold")
QUANT_BITS = (0, 2, 4, 8)
VECTORS = (1, 4, 8)
TOPK_ALGORITHMS = ("radix", "top_k")
MSE_NORMALIZATIONS = ("eq6", "scaled_mean")
PROJECTION_SEED = 20220601  # fixed: P must be reproducible without being stored


@dataclasses.dataclass(frozen=True)
class DSAConfig(KindConfig):
  """``config.attention.dsa``."""
  KIND = "dsa"
  sigma: float = 0.25              # predictor size k / d, in (0, 1]
  sparsity: float = 0.9            # share of each row's real keys dropped, in [0, 1)
  quant_bits: int = 0              # 0 = float predictor; 2 | 4 | 8 = fake-quantised
  mse_weight: float = 1.0          # lambda of Eq. 7: weight of L_MSE(S, S~) in the training loss
  # "eq6": the paper's ||QK^T - Q~K~^T||^2 / batch (unscaled scores, summed over heads and
  # real pairs) | "scaled_mean": mean over heads and real pairs of the 1/sqrt(d)-scaled
  # scores' squared difference (the earlier default; configs written without this field).
  mse_normalization: str = "eq6"
  vector: int = 1                  # column-vector granularity: 1 | 4 | 8
  selection: str = "topk"          # "topk" | "threshold"
  threshold: float = 0.0           # selection="threshold": keep S~ >= threshold
  # "top_k" (lax.top_k) | "radix" (sort-free select); radix was 1.5x slower per train step on
  # an H100 (experiments/train_step_h100.md)
  topk_algorithm: str = "top_k"

  def __post_init__(self):
    self.check_float("sigma", low=0.0, high=1.0, low_open=True)
    self.check_float("sparsity", low=0.0, high=1.0, high_open=True)
    self.check_choice("quant_bits", QUANT_BITS)
    self.check_float("mse_weight", low=0.0)
    self.check_choice("mse_normalization", MSE_NORMALIZATIONS)
    self.check_choice("vector", VECTORS)
    self.check_choice("selection", SELECTIONS)
    self.check_float("threshold")
    self.check_choice("topk_algorithm", TOPK_ALGORITHMS)


def predictor_rank(sigma: float, model_dim: int) -> int:
  """k = round(sigma * d)."""
  return int(round(sigma * model_dim))


def random_projection(seed: int, model_dim: int, rank: int) -> np.ndarray:
  """P in sqrt(3/k) * {-1, 0, +1}^{d x k}: -1 / +1 with probability 1/6 each, 0 with 2/3.

  Drawn with numpy (PCG64) outside any trace: P is a compile-time constant, so it costs no
  random-number compilation and no per-step work.
  """
  u = np.random.Generator(np.random.PCG64(seed)).random((model_dim, rank))
  signs = np.where(u < 1.0 / 6.0, -1.0, np.where(u < 1.0 / 3.0, 1.0, 0.0))
  return (signs * math.sqrt(3.0 / rank)).astype(np.float32)


def projection_seed(module_path) -> int:
  """Deterministic seed of the module at ``module_path`` (a tuple of names)."""
  digest = zlib.crc32("/".join(str(p) for p in module_path).encode())
  return PROJECTION_SEED * 2**32 + digest


def fake_quantize(x, bits: int, valid=None):
  """Symmetric per-tensor fake quantisation to ``bits`` (0 = identity), straight-through.

  ``valid`` (broadcastable bool) restricts the entries that set the scale (real tokens).
  """
  if bits == 0:
    return x
  levels = 2 ** (bits - 1) - 1          # INT2 -> {-1, 0, 1}, INT4 -> [-7, 7], INT8 -> [-127, 127]
  magnitude = jnp.abs(x) if valid is None else jnp.where(valid, jnp.abs(x), 0.0)
  scale = jax.lax.stop_gradient(jnp.max(magnitude)) / levels
  scale = jnp.where(scale > 0, scale, 1.0)
  quantized = jnp.clip(jnp.round(x / scale), -levels, levels) * scale
  return x + jax.lax.stop_gradient(quantized - x)


def keep_counts(mask, sparsity: float, length: int):
  """Per-example number of kept keys ceil((1 - sparsity) * n_real), at least 1: int32 [batch]."""
  n_real = (jnp.full((1,), length, jnp.float32) if mask is None
            else jnp.sum(mask, axis=-1).astype(jnp.float32))
  # - 1e-6 so that e.g. 0.1 * 30 = 3.0000000000000004 keeps 3, not 4.
  return jnp.maximum(jnp.ceil((1.0 - sparsity) * n_real - 1e-6), 1.0).astype(jnp.int32)


def static_keep(sparsity: float, length: int) -> int:
  """The largest per-row keep count."""
  return max(1, min(length, math.ceil((1.0 - sparsity) * length - 1e-6)))


_RADIX_BITS = 4


def _order_keys(x):
  """float32 -> uint32 keys with the same order (-0.0 and +0.0 share a key)."""
  x = x.astype(jnp.float32)
  x = jnp.where(x == 0, jnp.float32(0), x)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _digit_search(count_fn, total_bits: int, need):
  """Largest v < 2**total_bits with count_fn(v) >= need, found MSB first, _RADIX_BITS per pass
  (count_fn is non-increasing in v and count_fn(0) >= need). count_fn maps candidates
  [..., 1, D] to counts [..., D]; each pass is one fused compare-and-count over the rows."""
  prefix = jnp.zeros(need.shape, jnp.uint32)
  digits = jnp.arange(1, 2 ** _RADIX_BITS, dtype=jnp.uint32)
  top = -(-total_bits // _RADIX_BITS) * _RADIX_BITS
  for shift in range(top - _RADIX_BITS, -1, -_RADIX_BITS):
    counts = count_fn(prefix | (digits << shift))
    digit = jnp.sum(counts >= need, axis=-1, keepdims=True, dtype=jnp.uint32)
    prefix = prefix | (digit << shift)
  return prefix


def _topk_mask_radix(scores, need):
  """Radix select of each row's need-th largest value t (8 passes of 15 compares per entry),
  then keep s > t and the lowest-index entries equal to t (index passes only if ties demand)."""
  keys = _order_keys(scores)
  count_ge = lambda c: jnp.sum(keys[..., :, None] >= c[..., None, :], axis=-2, dtype=jnp.int32)
  threshold = _digit_search(count_ge, 32, need)
  greater, equal = keys > threshold, keys == threshold
  n_greater = jnp.sum(greater, axis=-1, keepdims=True, dtype=jnp.int32)
  n_equal = jnp.sum(equal, axis=-1, keepdims=True, dtype=jnp.int32)
  length = scores.shape[-1]
  position = jnp.arange(length, dtype=jnp.uint32)

  def cut_ties(_):
    want = need - n_greater       # equal entries to keep, lowest index first
    # want - #(equal entries before v) is >= 1 exactly for v <= the want-th equal position.
    remaining = lambda c: want - jnp.sum(
        equal[..., :, None] & (position[:, None] < c[..., None, :]), axis=-2, dtype=jnp.int32)
    last = _digit_search(remaining, max(1, (length - 1).bit_length()), jnp.ones_like(want))
    return greater | (equal & (position <= last))

  return jax.lax.cond(jnp.any(n_greater + n_equal > need), cut_ties,
                      lambda _: keys >= threshold, None)


def _topk_mask_lax(scores, need, max_keep: int):
  """lax.top_k (a sort on GPU for large k) gives t; the mask is one elementwise pass."""
  values, indices = jax.lax.top_k(scores, max_keep)
  chosen = jnp.arange(max_keep) < need
  last = jnp.take_along_axis(values, jnp.minimum(need - 1, max_keep - 1), axis=-1)
  tied = chosen & (values == last)
  last_tied_index = jnp.max(jnp.where(tied, indices, -1), axis=-1, keepdims=True)
  position = jnp.arange(scores.shape[-1])
  return (scores > last) | ((scores == last) & (position <= last_tied_index))


TOPK_ALGORITHM = DSAConfig.topk_algorithm


def topk_mask(scores, counts, *, algorithm: Optional[str] = None,
              max_keep: Optional[int] = None):
  """bool, same shape as ``scores`` [batch, ..., L]: the ``counts[b]`` largest of every row,
  ties to the lower index.

  Entries that must never be chosen should be -inf and counts (int [batch] or [1]) must lie
  in [1, number of finite entries]. ``algorithm`` (default TOPK_ALGORITHM): "top_k" uses
  lax.top_k with the static ``max_keep`` (>= every count; default: the row length) and no
  scatter; "radix" selects each row's threshold with fused compare-and-count passes, no sort.
  """
  algorithm = algorithm or TOPK_ALGORITHM
  need = counts.reshape(counts.shape + (1,) * (scores.ndim - 1)).astype(jnp.int32)
  need = jnp.broadcast_to(need, scores.shape[:-1] + (1,))
  if algorithm == "radix":
    return _topk_mask_radix(scores, need)
  if algorithm == "top_k":
    return _topk_mask_lax(scores, need, max_keep or scores.shape[-1])
  raise ValueError(f"unknown top-k algorithm {algorithm!r}; choose one of {TOPK_ALGORITHMS}")


def predicted_mask(predicted_scores, *, mask=None, sparsity: float = 0.9, vector: int = 1,
                   selection: str = "topk", threshold: float = 0.0,
                   topk_algorithm: Optional[str] = None):
  """The DSA mask from S~ [batch, heads, L, L]: bool, same shape; padded keys never kept."""
  batch, heads, length, _ = predicted_scores.shape
  scores = jax.lax.stop_gradient(predicted_scores.astype(jnp.float32))
  if vector > 1:
    if length % vector:
      raise ValueError(f"sequence length {length} is not a multiple of the column-vector "
                       f"size {vector}")
    rows = (jnp.ones((batch, length), jnp.float32) if mask is None
            else mask.astype(jnp.float32))
    rows = rows.reshape(batch, 1, length // vector, vector, 1)
    grouped = scores.reshape(batch, heads, length // vector, vector, length)
    scores = (jnp.sum(grouped * rows, axis=3)
              / jnp.maximum(jnp.sum(rows, axis=3), 1.0))          # [b, h, L/V, L]
  if mask is not None:
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  if selection == "topk":
    keep = topk_mask(scores, keep_counts(mask, sparsity, length), algorithm=topk_algorithm,
                     max_keep=static_keep(sparsity, length))
  elif selection == "threshold":
    keep = scores >= threshold
  else:
    raise ValueError(f"unknown DSA selection {selection!r}; choose one of {SELECTIONS}")
  if vector > 1:
    keep = jnp.repeat(keep, vector, axis=2)
  if mask is not None:
    keep = keep & mask[:, None, None, :]
  return keep


def attention_under_mask(q, k, v, keep, *, mask=None, dropout_rate: float = 0.0,
                         dropout_rng=None, scores=None):
  """softmax(S restricted to ``keep``) V with the real S = Q K^T / sqrt(d); empty rows -> 0."""
  if scores is None:
    scores = common.attention_scores(q, k)
  if mask is not None:
    keep = keep & mask[:, None, None, :]
  probs = common.masked_softmax(jnp.where(keep, scores, -jnp.inf), keep)
  probs = common.dropout_probabilities(probs, dropout_rate, dropout_rng)
  return common.attend(probs, v, q.dtype)


class DSAAttention(nn.Module):
  """Attention core for ``config.attention.kind = "dsa"``."""
  dims: AttentionDims
  config: DSAConfig = DSAConfig()

  def projection(self) -> jax.Array:
    """This layer's fixed P [model_dim, k]."""
    rank = predictor_rank(self.config.sigma, self.dims.model_dim)
    return jnp.asarray(random_projection(projection_seed(self.scope.path), self.dims.model_dim,
                                         rank))

  @nn.compact
  def __call__(self, q, k, v, *, mask, inputs=None, deterministic=True):
    dims, config = self.dims, self.config
    if inputs is None or inputs.shape != q.shape[:2] + (dims.model_dim,):
      raise ValueError(f"DSA needs the block input [batch, length, {dims.model_dim}] as "
                       f"inputs=, got {None if inputs is None else inputs.shape}")
    rank = predictor_rank(config.sigma, dims.model_dim)
    init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    w_query = self.param("predictor_query", init, (dims.num_heads, rank, rank), jnp.float32)
    w_key = self.param("predictor_key", init, (dims.num_heads, rank, rank), jnp.float32)

    real_tokens = None if mask is None else mask[..., None]
    x = fake_quantize(inputs.astype(jnp.float32), config.quant_bits, real_tokens)
    xp = jnp.einsum("bld,dk->blk", x, self.projection())
    compute = q.dtype
    q_pred = jnp.einsum("blk,hkj->blhj", xp, fake_quantize(w_query, config.quant_bits))
    k_pred = jnp.einsum("blk,hkj->blhj", xp, fake_quantize(w_key, config.quant_bits))
    scale = jnp.float32(q.shape[-1] ** -0.5)
    predicted = jnp.einsum("bqhj,bkhj->bhqk", q_pred.astype(compute), k_pred.astype(compute),
                           preferred_element_type=jnp.float32) * scale
    scores = common.attention_scores(q, k)

    mse = prediction_mse(scores, predicted, mask, head_dim=q.shape[-1],
                         normalization=config.mse_normalization)
    self.sow(AUX_LOSS, "dsa_mse", config.mse_weight * mse)
    self.sow(AUX_METRICS, "dsa_mse", mse)

    # Stored only when a caller asks for "intermediates" (lra_sparse.analysis does).
    self.sow("intermediates", "predicted_scores", predicted)
    keep = predicted_mask(predicted, mask=mask, sparsity=config.sparsity, vector=config.vector,
                          selection=config.selection, threshold=config.threshold,
                          topk_algorithm=config.topk_algorithm)
    if deterministic:
      self.sow(AUX_METRICS, "dsa_hit_rate", hit_rate(keep, scores, mask=mask,
                                                     sparsity=config.sparsity))
    use_dropout = dims.dropout_rate > 0.0 and not deterministic
    return attention_under_mask(
        q, k, v, keep, mask=mask, scores=scores,
        dropout_rate=dims.dropout_rate if use_dropout else 0.0,
        dropout_rng=self.make_rng("dropout") if use_dropout else None)


def prediction_mse(scores, predicted, mask, *, head_dim: int, normalization: str):
  """L_MSE between the scaled scores S = QK^T / sqrt(head_dim) and S~ [batch, heads, L, L],
  over (real query, real key) pairs; ``mask`` (bool [batch, L] or None = all real).

  "eq6": sum over heads and real pairs of the UNSCALED squared difference
  ((S - S~) * sqrt(head_dim))^2, divided by the batch size; "scaled_mean": the mean of
  (S - S~)^2 over heads and real pairs (0 when there is none).
  """
  squared = jnp.square(scores.astype(jnp.float32) - predicted.astype(jnp.float32))
  if mask is not None:
    pairs = mask[:, None, :, None] & mask[:, None, None, :]
    squared = jnp.where(pairs, squared, 0.0)
  total = jnp.sum(squared)
  if normalization == "eq6":
    return total * head_dim / scores.shape[0]
  if normalization == "scaled_mean":
    # Real pairs of example b: n_b^2 (n_b real tokens), in each head.
    count = (jnp.float32(squared.size) if mask is None else
             jnp.sum(jnp.sum(mask, axis=-1, dtype=jnp.float32) ** 2) * scores.shape[1])
    return total / jnp.maximum(count, 1.0)
  raise ValueError(f"unknown DSA MSE normalization {normalization!r}; choose one of "
                   f"{MSE_NORMALIZATIONS}")


def oracle_topk_mask(scores, *, mask=None, sparsity: float):
  """Exact top-k of the real scores S per row (the DSA oracle), same counts as the predictor."""
  length = scores.shape[-1]
  scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
  if mask is not None:
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  keep = topk_mask(scores, keep_counts(mask, sparsity, length),
                   max_keep=static_keep(sparsity, length))
  return keep if mask is None else keep & mask[:, None, None, :]


def hit_rate(keep, scores, *, mask=None, sparsity: float):
  """Share of predicted keys (over real query rows) that are in the exact top-k of S."""
  oracle = oracle_topk_mask(scores, mask=mask, sparsity=sparsity)
  rows = (jnp.ones(keep.shape[:1] + (1, keep.shape[2], 1), bool) if mask is None
          else mask[:, None, :, None])
  predicted = keep & rows
  hits = jnp.sum(predicted & oracle, dtype=jnp.float32)
  return hits / jnp.maximum(jnp.sum(predicted, dtype=jnp.float32), 1.0)


@register_attention("dsa", DSAConfig)
def _build_dsa(config: DSAConfig, dims: AttentionDims) -> nn.Module:
  """Checks config.attention.dsa against the model's sizes."""
  if predictor_rank(config.sigma, dims.model_dim) < 1:
    raise config.error("sigma", f"gives a predictor rank round(sigma * {dims.model_dim}) = 0; "
                                f"use sigma >= {0.5 / dims.model_dim:.3g}")
  if dims.length % config.vector:
    raise ValueError(f"sequence length {dims.length} is not a multiple of "
                     f"config.attention.dsa.vector={config.vector}")
  return DSAAttention(dims=dims, config=config)
