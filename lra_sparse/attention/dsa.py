"""DSA: dynamic sparse attention with a trained low-rank prediction path (DSA paper, Sec. 3).

    P      in sqrt(3/k) * {-1, 0, +1}^{d x k}   (+-1 with prob 1/6 each, 0 with prob 2/3)
    Q~_h = X P W~q_h,  K~_h = X P W~k_h          (W~q_h, W~k_h in R^{k x k}, trainable)
    S~_h = Q~_h K~_h^T / sqrt(head_dim)          (scaled like S; see below)
    M    = top-k of S~ per row (keep ceil((1 - sparsity) * n_real) keys) or S~ >= threshold,
           decided on int8-rounded Q~, K~ (the selection rule of kernels/dsa/reference.py)
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
  (W~) and the main q/k projections through S, as the paper's joint update intends
  (``mse_gradient="joint"``). With ``"predictor"`` S is a fixed target: only W~ learns from
  L_MSE, so X (the block input) must enter the predictor without gradient
  (``mse_input_gradient=False``); with True, autodiff of the joint loss, L_MSE also trains
  every layer and embedding below the predictor through X P W~ (it did in both modes in runs
  recorded before the field existed). Adam scales each parameter's step by its own
  gradient's size, and W~'s gradient comes from L_MSE alone, so W~'s steps hardly depend on
  mse_weight; what the weight sets is how hard L_MSE pulls the model's q/k (and, with
  ``mse_input_gradient``, the layers below) towards the predictor ("joint" only). Eq. 6 sums ~10^6
  squared unscaled scores per head, so at the start of a fine-tune even a weight of 1e-6 makes
  it ~10^6 x the cross-entropy (``experiments/results/dsa_listops_notes.md``).
- L_MSE is computed from d x d, d x k and k x k Gram matrices (no [L, L] array, forward or
  backward; ``kernels.dsa.reference.prediction_mse``), with Q~, K~ in factored form (XP) W~. On the
  kernel path the Grams and the gradients' length-sized products are Triton kernels with an
  explicit backward (``kernels/dsa/gram.py``), which read Q, K and XP once each way.
- top-k keeps ceil((1 - sparsity) * n_real) keys of each row, where n_real is the number of real
  keys of that example (sparsity 0 is dense). Padded keys are never selected, and query rows
  past the example's last real token (trailing padding, whole row groups) keep no key: their
  outputs are zero. They reach no loss, so the kernels skip their selection and attention.
  The ranking is exact on integers: Q~ rounded to int8 per row, K~ per (example, head),
  their int32 dot products mapped to an 8-bit code per row, ties to the lower key index (why,
  and the threshold rule: ``lra_sparse.kernels.dsa.reference``). Kernel and pure-JAX paths
  choose the same keys bit for bit.
- ``selection_scores="oracle"`` (an ablation, not in the paper): M ranks the real Q, K by the
  same int8 rule instead of Q~, K~: the keys a perfect predictor would keep, so a run or an
  evaluation shows what the sparsity itself costs, apart from the predictor's misses.
- Column-vector granularity V in {1, 4, 8}: V consecutive query rows share the kept columns,
  chosen from the mean of Q~ (hence of S~) over the real rows of the group.
- Block granularity (``granularity="block"``, not in the paper): each query block of
  ``block_size`` rows keeps whole key blocks, the top ceil((1 - sparsity) * real key blocks)
  by the block pair's mean predicted score, mean(Q~ over the block's real rows) . mean(K~ over
  the key block's real keys) (S~ is bilinear), ranked by the same int8 rule; every real key of
  a kept block is attended. This is the structure that lets kernels skip whole tiles: on the
  kernels, tiles are cut to the blocks and empty ones skipped (the selection itself is
  O((L / block)^2) in XLA). Evaluation logs "dsa_kept_share" (real pairs kept) beside the hit
  rate against the per-row oracle.
- Backends (``backend``): "triton" runs ``kernels/dsa/triton.py`` (selection as bits, then a
  flash-style softmax over the kept keys, forward and backward; no [L, L] float array;
  with vector 4 or 8 the forward can compute only each 64-row block's union of kept keys,
  ``forward``);
  "reference" the pure-JAX path; "auto" the kernels on a GPU when they can run the call
  (head_dim <= 128, the int8 selection rule), else the pure-JAX path, logged once.
- Attention dropout (training, rate > 0) acts on the kept probabilities, A <- A * Z / (1 -
  rate), Z drawn per (example, head, query row, key) by the counter-based rule of
  ``kernels/dropout.py`` from one seed per call: the kernels (which redraw Z in the
  backward) and the pure-JAX path drop exactly the same entries.
- Fake quantisation (quant_bits 2/4/8) of X and of W~: symmetric, per tensor (X's scale from
  its real tokens only), straight-through gradient.
- S~ (float) is also sown into "intermediates", computed only when a caller makes that
  collection mutable, as lra_sparse.analysis does (its tickets rank the float S~).
- Metrics: "dsa_mse" always; "dsa_hit_rate" (share of predicted keys that the same rule on the
  real Q, K would keep, with the same per-row count) only when ``deterministic`` (eval), since
  its extra selection pass would slow training.
"""
from __future__ import annotations

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn

from lra_sparse.attention import common
from lra_sparse.attention.registry import (AUX_LOSS, AUX_METRICS, AttentionDims, KindConfig,
                                           register_attention)
from lra_sparse.kernels.dsa import gram as dsa_gram
from lra_sparse.kernels.dsa import reference as dsa_reference
from lra_sparse.kernels.dsa import tiles as dsa_tiles
from lra_sparse.kernels.dsa import triton as dsa_triton
from lra_sparse.ops import dropout, sharding, softmax

SELECTIONS = ("topk", "threshold")
QUANT_BITS = (0, 2, 4, 8)
VECTORS = (1, 4, 8)
TOPK_ALGORITHMS = dsa_reference.TOPK_ALGORITHMS
BACKENDS = ("auto", "triton", "reference")
FORWARDS = ("auto", "tiles", "gather")   # the kernels' (dsa_triton.FORWARDS), and "auto"
GATHER_UNION = 0.7   # forward="auto": gather below this expected share of keys per row block
SELECTION_RULES = ("int8", "float")
GRANULARITIES = ("fine", "block")
BLOCK_SIZES = (16, 32, 64, 128)
MSE_NORMALIZATIONS = ("eq6", "scaled_mean")
MSE_GRADIENTS = ("joint", "predictor")
SELECTION_SCORES = ("predictor", "oracle")
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
  # "joint": L_MSE's gradient reaches the predictor and, through S, the model's query and key
  # projections (the paper's joint update) | "predictor": S is a fixed target (Q and K enter
  # L_MSE without gradient), so the model trains on the task loss alone and only W~ fits S.
  mse_gradient: str = "joint"
  # Whether L_MSE's gradient also reaches the block input X through the predictor's path
  # Q~ = X P W~q, K~ = X P W~k, and from X every layer and embedding below: True is plain
  # autodiff of the paper's joint loss (the paper detaches nothing) | False: X enters the
  # predictor without gradient, so L_MSE trains W~ and, "joint", q/k through S. "predictor"
  # needs False (it means W~ alone). Runs recorded before this field existed ran with True in
  # both modes, so their "predictor" runs were not predictor-only: L_MSE (under Eq. 6 about
  # 10^6 x the cross-entropy) trained every layer below the predictor too.
  mse_input_gradient: bool = True
  vector: int = 1                  # column-vector granularity: 1 | 4 | 8
  selection: str = "topk"          # "topk" | "threshold"
  threshold: float = 0.0           # selection="threshold": keep S~ >= threshold
  # Pure-JAX top-k: "top_k" (lax.top_k) | "radix" (sort-free select); radix was 1.5x slower
  # per train step on an H100 (experiments/reports/train_step/listops_h100.md). The kernels need
  # neither.
  topk_algorithm: str = "top_k"
  backend: str = "auto"            # auto | triton | reference (see the module docstring)
  # "int8": rank int8-rounded Q~, K~ (dsa_reference; kernels and pure JAX agree bit for bit) |
  # "float": rank the float S~ (pure JAX only; the rule of runs made before the kernels, which
  # also ranks keys for the trailing padding's rows, as those runs did).
  selection_rule: str = "int8"
  # Triton backward: False = one pass with fp32 atomics for dQ (fastest; the last bits of dQ
  # vary run to run); True = separate dK/dV and dQ kernels (bit-reproducible).
  deterministic_kernels: bool = False
  # Triton forward: "tiles" = every key tile below the key extent, masked by the bits (the
  # work of dense attention at any sparsity) | "gather" = each 64-row block's kept keys listed
  # first, then those keys only (the work of the block's union of kept keys; vector 4 or 8) |
  # "auto" = gather where the union is expected small (``kernel_forward``), else tiles. Same
  # outputs (up to fp32 summation order) and the same backward.
  forward: str = "auto"
  # L_MSE on the Gram kernels (kernels/dsa/gram.py: padding skipped) when the attention runs
  # on the kernels | False: the same Gram form in XLA (runs recorded before the kernels).
  mse_kernels: bool = True
  # "fine": the paper's rule (each row, or row group of ``vector``, keeps its own keys) |
  # "block": each query block of ``block_size`` rows keeps whole key blocks, ranked by the mean
  # predicted score of the block pair (``kernels.dsa.reference.block_select``): the structure
  # that lets the kernels visit only the kept tiles (``kernels.dsa.reference.tile_lists``).
  granularity: str = "fine"
  block_size: int = 64             # granularity="block": rows and keys per block
  # What M ranks: "predictor" (the paper: S~) | "oracle": the real scores S = Q K^T under the
  # same int8 rule, the keys a perfect predictor would keep (an ablation: the upper bound of
  # any predictor at this sparsity; L_MSE still fits the predictor, though it selects
  # nothing). Fine-grained selection with the int8 rule only.
  selection_scores: str = "predictor"

  def __post_init__(self):
    self.check_float("sigma", low=0.0, high=1.0, low_open=True)
    self.check_float("sparsity", low=0.0, high=1.0, high_open=True)
    self.check_choice("quant_bits", QUANT_BITS)
    self.check_float("mse_weight", low=0.0)
    self.check_choice("mse_normalization", MSE_NORMALIZATIONS)
    self.check_choice("mse_gradient", MSE_GRADIENTS)
    self.check_bool("mse_input_gradient")
    if self.mse_gradient == "predictor" and self.mse_input_gradient:
      raise self.error("mse_input_gradient", "must be False with mse_gradient='predictor' "
                       "(W~ alone learns from L_MSE; True would let it train every layer below "
                       "the predictor through X, as runs recorded before this field did)")
    self.check_choice("vector", VECTORS)
    self.check_choice("selection", SELECTIONS)
    self.check_float("threshold")
    self.check_choice("topk_algorithm", TOPK_ALGORITHMS)
    self.check_choice("backend", BACKENDS)
    self.check_bool("deterministic_kernels")
    self.check_choice("forward", FORWARDS)
    if self.forward == "gather" and self.vector < 4:   # "auto" picks tiles there
      raise self.error("forward", f"needs vector 4 or 8 (the kept keys of 64 query rows are "
                       f"listed together; vector={self.vector})")
    self.check_bool("mse_kernels")
    self.check_choice("selection_rule", SELECTION_RULES)
    self.check_choice("granularity", GRANULARITIES)
    self.check_choice("block_size", BLOCK_SIZES)
    if self.granularity == "block" and self.vector != 1:
      raise self.error("vector", f"is the fine-grained rule's row grouping; with "
                       f"granularity='block' the rows of a block share its keys (use vector=1, "
                       f"got {self.vector})")
    self.check_choice("selection_scores", SELECTION_SCORES)
    if self.selection_scores == "oracle" and (self.granularity, self.selection_rule) != (
        "fine", "int8"):
      raise self.error("selection_scores", f"'oracle' needs granularity='fine' and "
                       f"selection_rule='int8' (got {self.granularity!r}, "
                       f"{self.selection_rule!r})")
    if self.granularity == "block" and self.selection_rule != "int8":
      raise self.error("selection_rule", "must be 'int8' with granularity='block' (block "
                       "scores are ranked by the int8 rule)")

  def kernel_forward(self) -> str:
    """The Triton forward this config runs: ``forward``, with "auto" resolved.

    "auto" gathers when a 64-row block's 64 / vector row groups, choosing independently, would
    keep under GATHER_UNION of the keys between them: 1 - sparsity^(64 / vector) for top-k;
    threshold selection (no fixed share) gathers at vector 8 only.  H100
    (experiments/reports/dsa/README.md): the gathered forward was 8% slower than the tiles at
    V=4 DSA-90 (union 81%), within 2% to 1.6x faster at V=8 DSA-90..99 (57-8%) and V=4 DSA-95
    and DSA-99 (56%, 15%), 2.3x faster at V=8 with a threshold keeping 1%."""
    if self.forward != "auto":
      return self.forward
    if self.vector < 4:
      return "tiles"
    if self.selection == "threshold":
      return "gather" if self.vector == 8 else "tiles"
    union = 1.0 - self.sparsity ** (64 // self.vector)
    return "gather" if union < GATHER_UNION else "tiles"


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


def _kernels(config: DSAConfig, q, k, v):
  """``lra_sparse.kernels.dsa.triton`` when this call runs on the kernels, else None
  (backend='auto' logs once why it falls back on a GPU; 'triton' raises instead)."""
  if config.backend == "reference":
    return None
  required = config.backend == "triton"
  if not required and jax.default_backend() != "gpu":
    return None
  reason = None
  if config.selection_rule != "int8":
    reason = f"selection_rule={config.selection_rule!r} (the kernels rank int8 operands)"
  kernel = common.usable_kernel(dsa_triton, "DSA", required)
  if kernel is not None and reason is None:
    reason = kernel.unsupported_reason(q, v, k=k, vector=config.vector,
                                       forward=config.kernel_forward())
  if reason is None:
    return kernel
  if required:
    raise ValueError(f"config.attention.dsa.backend='triton' cannot run this call: {reason}; "
                     "use backend='reference' or 'auto'")
  if kernel is not None:
    common.warn_once(f"DSA backend='auto': the Triton kernels cannot run this call ({reason});"
                     " using the pure-JAX path, which holds [L, L] scores in memory")
  return None


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

    # Q~ = X P W~q, K~ = X P W~k (fake-quantised operands when quant_bits > 0).
    real_tokens = None if mask is None else mask[..., None]
    x = inputs.astype(jnp.float32)
    if not config.mse_input_gradient:     # the predictor's path gives X no gradient
      x = jax.lax.stop_gradient(x)
    x = dsa_reference.fake_quantize(x, config.quant_bits, real_tokens)
    xp = jnp.einsum("bld,dk->blk", x, self.projection())
    w_query = dsa_reference.fake_quantize(w_query, config.quant_bits)
    w_key = dsa_reference.fake_quantize(w_key, config.quant_bits)
    q_pred = dsa_reference.LowRank(xp, w_query)      # Q~, K~ in factored form: only the
    k_pred = dsa_reference.LowRank(xp, w_key)        # selection operands expand them
    scale = q.shape[-1] ** -0.5

    use_dropout = dims.dropout_rate > 0.0 and not deterministic
    kernel = _kernels(config, q, k, v)
    seed = dropout.seed_words(self.make_rng("dropout")) if use_dropout else None
    rate = dims.dropout_rate if use_dropout else 0.0
    # lambda * L_MSE(S, S~), from Gram matrices of Q, K and the factors XP, W~: no [L, L]
    # array, and Q~, K~ themselves are not read.
    target_q, target_k = ((q, k) if config.mse_gradient == "joint"
                          else (jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)))
    mse = prediction_mse(target_q, target_k, q_pred, k_pred, mask,
                         normalization=config.mse_normalization,
                         kernels=kernel is not None and config.mse_kernels)
    self.sow(AUX_LOSS, "dsa_mse", config.mse_weight * mse)
    self.sow(AUX_METRICS, "dsa_mse", mse)
    float_rule = config.selection_rule == "float"
    if float_rule or self.is_mutable_collection("intermediates"):   # S~ is [L, L]
      expand = lambda f: jnp.einsum("blk,hkj->blhj", f.x, f.w).astype(q.dtype)  # noqa: E731
      predicted = jnp.einsum("bqhj,bkhj->bhqk", expand(q_pred), expand(k_pred),
                             preferred_element_type=jnp.float32) * jnp.float32(scale)
      self.sow("intermediates", "predicted_scores", predicted)

    select = dict(sparsity=config.sparsity, selection=config.selection,
                  threshold=config.threshold)
    if config.granularity == "block":
      return self._block_attention(q, k, v, q_pred, k_pred, mask, select, scale, rate, seed,
                                   deterministic, kernel)

    # M: the selection rule (dsa_reference) on the predictor's int8-rounded operands.
    if config.selection_scores == "oracle":   # M from the real Q, K (no gradient flows)
      ops = dsa_reference.selection_operands(q, k, mask, vector=config.vector, scale=scale)
    else:
      ops = None if float_rule else dsa_reference.selection_operands(
          q_pred, k_pred, mask, vector=config.vector, scale=scale)
    if kernel is not None:
      bits = sharding.per_data_shard(
          lambda ops, mask: kernel.select_bits(ops, mask, **select), ops, mask)
      if deterministic:
        oracle = sharding.per_data_shard(
            lambda ops, mask: kernel.select_bits(ops, mask, sparsity=config.sparsity),
            _oracle_operands(q, k, mask), mask)
        self.sow(AUX_METRICS, "dsa_hit_rate", dsa_reference.hit_rate(bits, oracle, mask=mask,
                                                       vector=config.vector))
      # A = softmax(S restricted to M) with the real S; O = A V.
      def attend(q, k, v, bits, mask, seed):
        return kernel.dsa_attention_triton(q, k, v, bits, mask=mask, vector=config.vector,
                                           deterministic=config.deterministic_kernels,
                                           forward=config.kernel_forward(),
                                           dropout_rate=rate,
                                           dropout_seed=sharding.shard_dropout_seed(seed))
      return sharding.per_data_shard(attend, q, k, v, bits, mask, seed, replicated=(5,))
    if float_rule:
      keep = dsa_reference.predicted_mask(predicted, mask=mask,
                                          topk_algorithm=config.topk_algorithm,
                                          vector=config.vector, **select)[:, :, ::config.vector]
    else:
      keep = dsa_reference.reference_select(ops, mask, topk_algorithm=config.topk_algorithm,
                                            **select)
    if deterministic:
      if float_rule:
        oracle = dsa_reference.oracle_topk_mask(softmax.attention_scores(q, k), mask=mask,
                                  sparsity=config.sparsity)
      else:
        oracle = dsa_reference.reference_select(_oracle_operands(q, k, mask), mask,
                                                sparsity=config.sparsity,
                                                topk_algorithm=config.topk_algorithm)
      self.sow(AUX_METRICS, "dsa_hit_rate", dsa_reference.hit_rate(
          dsa_reference.pack_bits(keep), dsa_reference.pack_bits(oracle), mask=mask,
          vector=config.vector))
    return dsa_reference.attention_under_keep(
        q, k, v, dsa_reference.expand_groups(keep, config.vector),
        dropout_rate=rate, dropout_seed=seed)


  def _block_attention(self, q, k, v, q_pred, k_pred, mask, select, scale, rate, seed,
                       deterministic, kernel):
    """granularity="block": M = every (query, key) of the kept (query block, key block) pairs
    (``dsa_reference.block_select``), then A = softmax(S restricted to M) V as in the fine
    rule: on the kernels, with tiles cut to the blocks, each kernel visiting only the tiles of
    kept block pairs (``dsa_tiles.block_overrides``, ``dsa_reference.tile_lists``), else on
    the pure-JAX path. Evaluation also records the
    hit rate against the fine-grained oracle (the same rule on the real Q, K, per row) and
    the share of real (row, key) pairs kept."""
    config = self.config
    length, heads = q.shape[1], q.shape[2]
    keep_blocks = dsa_reference.block_select(
        q_pred, k_pred, mask, block_size=config.block_size, scale=scale,
        topk_algorithm=config.topk_algorithm, **select)
    if deterministic:
      bits = dsa_reference.block_bits(keep_blocks, config.block_size, length, mask)
      oracle_ops = _oracle_operands(q, k, mask)
      if kernel is not None:
        oracle = sharding.per_data_shard(
            lambda ops, mask: kernel.select_bits(ops, mask, sparsity=config.sparsity),
            oracle_ops, mask)
      else:
        oracle = dsa_reference.pack_bits(dsa_reference.reference_select(
            oracle_ops, mask, sparsity=config.sparsity, topk_algorithm=config.topk_algorithm))
      self.sow(AUX_METRICS, "dsa_hit_rate", dsa_reference.hit_rate(bits, oracle, mask=mask))
      rows = jnp.ones(q.shape[:2], bool) if mask is None else mask.astype(bool)
      kept = jnp.sum(jax.lax.population_count(jnp.where(rows[:, None, :, None], bits, 0)),
                     dtype=jnp.float32)
      real = jnp.sum(rows, axis=1, dtype=jnp.float32)
      self.sow(AUX_METRICS, "dsa_kept_share",
               kept / jnp.maximum(jnp.sum(real * real) * heads, 1.0))
    if kernel is not None:
      vector = dsa_reference.block_vector(length)
      bits = dsa_reference.block_bits(keep_blocks, config.block_size, length, mask,
                                      vector=vector)
      tiles = dsa_tiles.block_overrides(config.block_size, jnp.dtype(q.dtype).name)

      def attend(q, k, v, bits, keep_blocks, mask, seed):
        return kernel.dsa_attention_triton(q, k, v, bits, mask=mask, vector=vector,
                                           deterministic=config.deterministic_kernels,
                                           forward="tiles", dropout_rate=rate,
                                           dropout_seed=sharding.shard_dropout_seed(seed),
                                           tiles=tiles, blocks=keep_blocks,
                                           block_size=config.block_size)
      return sharding.per_data_shard(attend, q, k, v, bits, keep_blocks, mask, seed,
                                     replicated=(6,))
    keep = dsa_reference.expand_blocks(keep_blocks, config.block_size, length, mask)
    return dsa_reference.attention_under_keep(q, k, v, keep, dropout_rate=rate,
                                              dropout_seed=seed)


def prediction_mse(q, k, q_pred, k_pred, mask, *, normalization: str, kernels: bool):
  """L_MSE(S, S~) with Q~, K~ as ``kernels.dsa.reference.LowRank`` factors (XP) W~ sharing XP: on
  the
  Gram kernels (``kernels/dsa/gram.py``: one pass over Q, K, XP each way, real rows only)
  when the attention runs on the kernels and they take the rank, else the same Gram form in
  XLA (``kernels.dsa.reference.prediction_mse``)."""
  rank = q_pred.x.shape[-1]
  if kernels and rank <= dsa_gram.MAX_RANK:
    return dsa_gram.prediction_mse(q, k, q_pred.x, q_pred.w, k_pred.w, mask,
                                   normalization=normalization)
  if kernels:
    common.warn_once(f"DSA: predictor rank {rank} is above the Gram kernels' "
                     f"{dsa_gram.MAX_RANK}; L_MSE runs its Gram form in XLA")
  return dsa_reference.prediction_mse(q, k, q_pred, k_pred, mask, normalization=normalization)


def _oracle_operands(q, k, mask):
  """The selection rule applied to the real Q, K: the oracle the predictor is scored against."""
  return dsa_reference.selection_operands(q, k, mask, vector=1)


@register_attention("dsa", DSAConfig)
def _build_dsa(config: DSAConfig, dims: AttentionDims) -> nn.Module:
  """Checks config.attention.dsa against the model's sizes."""
  if predictor_rank(config.sigma, dims.model_dim) < 1:
    raise config.error("sigma", f"gives a predictor rank round(sigma * {dims.model_dim}) = 0; "
                                f"use sigma >= {0.5 / dims.model_dim:.3g}")
  if dims.length % config.vector:
    raise ValueError(f"sequence length {dims.length} is not a multiple of "
                     f"config.attention.dsa.vector={config.vector}")
  if predictor_rank(config.sigma, dims.model_dim) > dsa_reference.MAX_RANK:
    raise config.error("sigma", f"gives a predictor rank above {dsa_reference.MAX_RANK}")
  if config.backend == "triton":
    common.usable_kernel(dsa_triton, "DSA", required=True)
  return DSAAttention(dims=dims, config=config)
