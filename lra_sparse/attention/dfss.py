"""DFSS: dynamic N:M fine-grained structured sparse attention (DFSS paper, Sec. 3).

    S = Q K^T / sqrt(d), padded keys -> -inf
    keep = the n largest (signed) of every m consecutive keys of each row   (nm_mask)
    A = softmax over the kept entries only;  O = A V

Gradients are those of the masked softmax: pruned and padded entries get zero gradient (the
mask is piecewise constant; there is no straight-through estimator). A group or a row with no
real key gives zeros, never NaN, in values and gradients.

Backends: "reference" is pure JAX and runs everywhere; "mosaic" calls the Pallas Mosaic GPU
kernels in ``lra_sparse/kernels/dfss/mosaic.py`` (Hopper only: bf16/fp16, head dims up to 128,
run at 16, 32, 64 or 128 with zero padding, M in 2/4/8, attention dropout; the fastest there);
"triton" calls the fused Triton kernels in ``lra_sparse/kernels/dfss/triton.py`` (any recent
NVIDIA GPU; every dtype, head dims up to 128, attention dropout). Kernel modules are imported
lazily, so CPU installs never import Pallas GPU, jax_triton or triton. "auto" on a GPU picks
Mosaic GPU when it can run the call (small head dims, Pathfinder's 4 too, zero-padded to 16),
else Triton, else the pure-JAX path, and logs once why it fell back.

Attention dropout (training, rate > 0) acts on the kept probabilities, A <- A * Z / (1 - rate).
Every backend draws Z by the counter-based rule of ``lra_sparse/ops/dropout.py`` from
one seed per call, so the fused kernels (which never store A and redraw Z in the backward) and
the pure-JAX path drop exactly the same entries.

The pure-JAX path is one dense score pass: S is computed once, the N:M keep mask comes from m
elementwise comparisons per entry that XLA fuses into the softmax passes (no sort, no gather,
no [.., L, L, m] tensor), and a custom VJP reuses the stored probabilities so the backward
pass costs what dense attention's does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from lra_sparse.attention import common
from lra_sparse.attention.registry import AttentionDims, KindConfig, register_attention
from lra_sparse.kernels.dfss import mosaic as dfss_mosaic
from lra_sparse.kernels.dfss import reference as dfss_reference
from lra_sparse.kernels.dfss import triton as dfss_triton
from lra_sparse.ops import dropout, sharding
from lra_sparse.ops.nm import check_nm, parse_nm

BACKENDS = ("auto", "mosaic", "triton", "reference")


@dataclasses.dataclass(frozen=True)
class DFSSConfig(KindConfig):
  """``config.attention.dfss``."""
  KIND = "dfss"
  nm: str = "2:4"                    # keep the n largest of every m consecutive keys: "n:m"
  backend: str = "auto"              # auto | mosaic | triton | reference
  # Triton and Mosaic GPU backward: False = dQ summed with fp32 atomics (fastest, last bits of
  # dQ vary run to run; Mosaic: head dims up to 64); True = separate dK/dV and dQ kernels
  # (bit-reproducible; Triton ~15% slower, Mosaic up to 1.35x slower forward+backward).
  deterministic_kernels: bool = False

  def __post_init__(self):
    parse_nm(self.nm, what="config.attention.dfss.nm")
    self.check_choice("backend", BACKENDS)
    self.check_bool("deterministic_kernels")

  @property
  def n_m(self) -> tuple[int, int]:
    return parse_nm(self.nm)


def _triton_module(required: bool) -> Optional[Any]:
  """``lra_sparse.kernels.dfss.triton`` when usable; else None, or one ValueError if required."""
  return common.usable_kernel(dfss_triton, "DFSS", required)


def _mosaic_module(required: bool) -> Optional[Any]:
  """``lra_sparse.kernels.dfss.mosaic`` when usable; else None, or one ValueError if required."""
  return common.usable_kernel(dfss_mosaic, "DFSS", required, backend="mosaic")


def _pick_kernel(backend: str, q, k, v, n: int, m: int):
  """(kernel module or None, its kind 'mosaic' | 'triton'); one ValueError when the named
  backend cannot run the call; 'auto' falls back Mosaic GPU -> Triton -> pure JAX, logging once
  why."""
  if backend in ("mosaic", "triton"):
    module = (_mosaic_module if backend == "mosaic" else _triton_module)(required=True)
    reason = module.unsupported_reason(q, v, n, m, k=k)
    if reason:
      raise ValueError(f"dfss_attention: backend={backend!r} cannot run this call: {reason}; "
                       "use backend='reference' or 'auto'")
    return module, backend
  if backend != "auto" or jax.default_backend() != "gpu":
    return None, "reference"
  module = _mosaic_module(required=False)
  if module is not None:
    reason = module.unsupported_reason(q, v, n, m, k=k)
    if not reason:
      return module, "mosaic"
    common.warn_once(f"DFSS backend='auto': the Mosaic GPU kernel cannot run this call "
                     f"({reason}); trying the Triton kernel")
  module = _triton_module(required=False)
  reason = module.unsupported_reason(q, v, n, m, k=k) if module is not None else None
  if reason:
    common.warn_once(f"DFSS backend='auto': the Triton kernel cannot run this call "
                     f"({reason}); using the pure-JAX path, which holds [L, L] scores in "
                     "memory")
    module = None
  return module, "triton" if module is not None else "reference"


def dfss_attention(q, k, v, *, n: int = 2, m: int = 4, mask=None, backend: str = "auto",
                   dropout_rate: float = 0.0, dropout_rng=None,
                   deterministic_kernels: bool = False):
  """DFSS N:M attention. q, k, v: [batch, length, heads, head_dim]; mask: bool [batch, length]
  key padding (True = real token). Requires 0 < n <= m (n == m keeps every key: dense
  attention) and length % m == 0. Attention dropout (rate > 0 with an rng): every backend
  drops the same entries for the same rng (``ops.dropout``). deterministic_kernels: the Triton
  and Mosaic GPU backwards without atomics (bit-reproducible gradients); the pure-JAX paths
  are deterministic either way. backend: see the module docstring.
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
    dropout.threshold(dropout_rate)  # one clear error for a rate outside [0, 1)
  seed = dropout.seed_words(dropout_rng) if use_dropout else None
  kernel, kind = _pick_kernel(backend, q, k, v, n, m)
  if kind in ("mosaic", "triton"):
    def kernel_call(q, k, v, mask, seed):
      drop = dict(dropout_rate=dropout_rate if use_dropout else 0.0,
                  dropout_seed=sharding.shard_dropout_seed(seed))
      if kind == "mosaic":
        return kernel.dfss_attention_mgpu(q, k, v, n=n, m=m, mask=mask,
                                          deterministic=deterministic_kernels, **drop)
      return kernel.dfss_attention_triton(q, k, v, n=n, m=m, mask=mask,
                                          deterministic=deterministic_kernels, **drop)
    return sharding.per_data_shard(kernel_call, q, k, v, mask, seed, replicated=(4,))
  if use_dropout:  # plain autodiff through the kernels' reference, with their mask
    return dfss_reference.dfss_attention_reference(q, k, v, n=n, m=m, mask=mask,
                                                   dropout_rate=dropout_rate, dropout_seed=seed)
  if mask is None:
    mask = jnp.ones(k.shape[:2], bool)
  return dfss_reference.dfss_attention_xla(q, k, v, mask, n, m)


class DFSSAttention(nn.Module):
  """Attention core for ``config.attention.kind = "dfss"``."""
  dims: AttentionDims
  config: DFSSConfig = DFSSConfig()

  @nn.compact
  def __call__(self, q, k, v, *, mask, inputs=None, deterministic=True):
    del inputs
    n, m = self.config.n_m
    use_dropout = self.dims.dropout_rate > 0.0 and not deterministic
    return dfss_attention(q, k, v, n=n, m=m, mask=mask, backend=self.config.backend,
                          dropout_rate=self.dims.dropout_rate if use_dropout else 0.0,
                          dropout_rng=self.make_rng("dropout") if use_dropout else None,
                          deterministic_kernels=self.config.deterministic_kernels)


@register_attention("dfss", DFSSConfig)
def _build_dfss(config: DFSSConfig, dims: AttentionDims) -> nn.Module:
  """Checks config.attention.dfss against the model's sizes."""
  _, m = config.n_m
  if dims.length % m:
    raise ValueError(f"sequence length {dims.length} (after CLS and padding) is not a multiple "
                     f"of m={m} from config.attention.dfss.nm={config.nm!r}; set "
                     f"config.model.pad_multiple to a multiple of {m}")
  if config.backend == "triton":
    _triton_module(required=True)
  elif config.backend == "mosaic":
    _mosaic_module(required=True)
  return DFSSAttention(dims=dims, config=config)
