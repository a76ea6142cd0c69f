"""DFSS (dynamic N:M sparse attention) Triton kernels, called from JAX through jax-triton.

Nothing here imports triton or jax_triton at module import time (CPU installs import this
module fine); the kernels are generated and compiled on first use.

Two implementations share one N:M selection scheme:

* ``impl="fused"`` (the default, used by ``dfss_attention_triton``): a flash-style forward
  that computes each QK^T tile on the tensor cores, prunes it N:M in registers and runs an
  online softmax over the kept entries only (S and A are never written; only O and a per-row
  log-sum-exp), and a flash-style backward that recomputes the tile, re-applies the same
  in-register pruning and forms dS = P * (dP - rowsum(dO*O)) on the kept entries only.  The
  default backward is one pass per key block (dK, dV in registers, dQ added into an fp32
  buffer with atomics: S, the pruning and the exponentials once per tile, five products);
  ``deterministic=True`` runs a dK/dV kernel and a separate dQ kernel instead (seven
  products, no atomics, bit-reproducible).
* ``impl="compressed"``: the paper's 3-kernel pipeline (App. A.1).  SDDMM + N:M-prune epilogue
  writes only the compressed scores ``[B*H, L, L*N/M]`` (fp32) + a keep bitmask (int32 words,
  one bit per key = M bits per group: 2 bits for 1:2, 4 bits for 2:4); a compressed
  mask-aware softmax writes compressed probabilities A (input dtype); SpMM multiplies them with
  V.  Its backward works on the compressed form: dV = A^T dO (transposed SpMM), dS through the
  softmax on the compressed values (sampled dO V^T at the kept positions, fused with
  A * (dA - rowsum(dO*O))), dQ = dS K and dK = dS^T Q (SpMM / transposed SpMM).

N:M selection without layout shuffles: a key tile of BN keys is loaded as M sub-tiles, sub-tile
i holding keys ``g*M + i`` (g = 0..BN/M-1) -- the Triton analogue of the paper's column
interleaving (Fig. 9).  Each sub-tile is its own tensor-core product, so all members of a group
sit at the same position of the M register tiles and the rank of every element (how many
group members beat it: greater, or equal with a lower index) is M-1 elementwise compares.  The
kernel source is generated per M (2, 4, 8, ...) because the M tiles are separate variables.

Lengths that are not a multiple of the tiles (or of M) are padded internally: rows past L are
not stored, keys past L are padded keys (-inf, never beat a real key).  A fully padded row gives
zeros, never NaN.  Layout is jax.nn.dot_product_attention's [batch, length, heads, head_dim],
read in place (no transposes); batch*heads run in one launch (grid axis 1).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import math
import os
import sys
import tempfile

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from lra_sparse.attention.nm import check_nm

__all__ = [
    "is_available",
    "unsupported_reason",
    "dfss_attention_triton",
    "sddmm_prune",
    "compressed_softmax",
    "spmm",
    "poison_outputs",
    "set_config",
]

LOG2E = 1.4426950408889634
META_BITS = 32
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
_MAX_M = 32  # one keep bit per key in int32 metadata words: a group never straddles two words


# ----------------------------------------------------------------------------- availability
def is_available() -> bool:
  """True when a GPU backend is present and jax_triton (and triton) import."""
  try:
    if not any(d.platform == "gpu" for d in jax.devices()):
      return False
    import triton  # noqa: F401
    import jax_triton  # noqa: F401
    return True
  except Exception:  # pragma: no cover - any import / backend failure means "no"
    return False


def unsupported_reason(q, v, n: int, m: int, *, k=None) -> Optional[str]:
  """None when the kernels can run DFSS n:m on these operands; else a short reason.

  The one statement of what the kernels accept (``dfss_attention_triton`` raises
  ``ValueError(reason)``; callers with a pure-JAX fallback use it to choose): 0 < n < m
  (n == m keeps every key, which the kernels do not handle), m a power of two <= 32,
  q [batch, length, heads, head_dim] with head_dim in (16, 32, 64, 128), v (and k when
  given) of q's shape and dtype, dtype float32 / bfloat16 / float16.  Only shapes and dtypes
  are read, so q, v, k may be arrays or ``jax.ShapeDtypeStruct``s.
  """
  try:
    check_nm(n, m, what="dfss_triton")
  except ValueError as error:
    return str(error)
  if n == m:
    return f"the Triton kernel needs n < m, got n={n}, m={m}"
  if m & (m - 1) or m > _MAX_M:
    return f"the Triton kernel needs m a power of two <= {_MAX_M}, got m={m}"
  if len(q.shape) != 4:
    return f"q must be [batch, length, heads, head_dim], got shape {tuple(q.shape)}"
  for name, x in (("k", k), ("v", v)):
    if x is None:
      continue
    if tuple(x.shape) != tuple(q.shape):
      return (f"the Triton kernel needs {name}.shape == q.shape, "
              f"got {tuple(x.shape)} vs {tuple(q.shape)}")
    if jnp.dtype(x.dtype) != jnp.dtype(q.dtype):
      return f"the Triton kernel needs {name}.dtype == q.dtype, got {x.dtype} vs {q.dtype}"
  if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
    return f"dtype {q.dtype} not in (float32, bfloat16, float16)"
  if q.shape[-1] not in _SUPPORTED_HEAD_DIMS:
    return f"head_dim {q.shape[-1]} not in {_SUPPORTED_HEAD_DIMS}"
  return None


_POISON = [False]


@contextlib.contextmanager
def poison_outputs(enabled: bool = True):
  """While active (at trace time), every kernel output buffer is pre-filled with NaN
  (int outputs with -1) and aliased into the kernel, so unwritten elements show up."""
  old = _POISON[0]
  _POISON[0] = enabled
  try:
    yield
  finally:
    _POISON[0] = old


# ----------------------------------------------------------------------------- configs
# (kind, dtype-class, head_dim) -> dict(BM, BN, num_warps, num_stages); BN is raised to at
# least 16*M so that every sub-tile product has >= 16 columns.
_DEFAULT_CFG = {
    ("fwd", "half", 32): dict(BM=128, BN=64, num_warps=4, num_stages=3),
    ("fwd", "half", 64): dict(BM=128, BN=64, num_warps=4, num_stages=3),
    ("fwd", "half", 128): dict(BM=128, BN=64, num_warps=8, num_stages=2),
    ("fwd", "f32", 32): dict(BM=128, BN=64, num_warps=4, num_stages=2),
    ("fwd", "f32", 64): dict(BM=128, BN=64, num_warps=4, num_stages=2),
    ("fwd", "f32", 128): dict(BM=64, BN=32, num_warps=4, num_stages=2),
    # one pass (dQ by atomics) measured faster than dK/dV + dQ kernels on the H100 for both
    # dtypes (experiments/kernels_tuning_h100.md); onepass=False is the deterministic path
    ("bwd", "half", 32): dict(BM=64, BN=64, num_warps=4, num_stages=2, onepass=True),
    ("bwd", "half", 64): dict(BM=64, BN=128, num_warps=8, num_stages=2, onepass=True),
    ("bwd", "half", 128): dict(BM=64, BN=64, num_warps=8, num_stages=2, onepass=True),
    ("bwd", "f32", 32): dict(BM=32, BN=64, num_warps=4, num_stages=2, onepass=True),
    ("bwd", "f32", 64): dict(BM=32, BN=64, num_warps=4, num_stages=2, onepass=True),
    ("bwd", "f32", 128): dict(BM=32, BN=32, num_warps=4, num_stages=1, onepass=True),
    ("dq", "half", 32): dict(BM=128, BN=128, num_warps=8, num_stages=3),
    ("dq", "half", 64): dict(BM=128, BN=128, num_warps=8, num_stages=3),
    ("dq", "half", 128): dict(BM=128, BN=64, num_warps=8, num_stages=2),
    ("dq", "f32", 32): dict(BM=64, BN=64, num_warps=4, num_stages=2),
    ("dq", "f32", 64): dict(BM=64, BN=64, num_warps=4, num_stages=2),
    ("dq", "f32", 128): dict(BM=64, BN=32, num_warps=4, num_stages=2),
    ("cmp", "half", 32): dict(BM=64, BN=128, num_warps=4, num_stages=2),
    ("cmp", "half", 64): dict(BM=64, BN=128, num_warps=4, num_stages=2),
    ("cmp", "half", 128): dict(BM=64, BN=64, num_warps=4, num_stages=2),
    ("cmp", "f32", 32): dict(BM=64, BN=64, num_warps=4, num_stages=2),
    ("cmp", "f32", 64): dict(BM=64, BN=64, num_warps=4, num_stages=2),
    ("cmp", "f32", 128): dict(BM=32, BN=32, num_warps=4, num_stages=1),
}
_CFG_OVERRIDE: dict = {}
# Code-generation switches (kept so the previous formulation can be timed against the new one
# in one process: benchmarks/tune_dfss_kernels.py --codegen).  logic_rank: boolean N:M keep
# for M=4; fold_scale: rank the raw QK^T (a positive scale keeps the order) and fold the
# softmax scale into the exp2 argument (one FFMA instead of FMUL + FADD per score).
# row_once: the forward's row max and row sum take one cross-lane reduction per key block
# (elementwise over the M sub-tiles first) instead of one per sub-tile.
_GEN_OPTIONS = {"logic_rank": True, "fold_scale": True, "row_once": True}


def set_config(kind: str, dtype, head_dim: int, **cfg) -> None:
  """Override the tile config of a kernel family ('fwd', 'bwd', 'dq', 'cmp'); no cfg resets.
  'bwd' also takes onepass=True: one backward kernel (dQ by fp32 atomics) instead of two."""
  key = (kind, _dclass(jnp.dtype(dtype)), head_dim)
  if not cfg:
    _CFG_OVERRIDE.pop(key, None)
  else:
    _CFG_OVERRIDE[key] = dict(cfg)


def _dclass(dt) -> str:
  return "f32" if jnp.dtype(dt) == jnp.float32 else "half"


# per-M refinements: M=8 raises BN to 128 (16 keys per sub-tile), which needs other warps /
# stages; chosen from ptxas register / spill / shared-memory reports for sm_90a (no spills
# over ~200 bytes, shared memory under the 227 KiB limit)
_M_CFG = {
    # 2:4 bf16/fp16 at d=64 (the paper's bf16 setting): 64x128 beat 128x64 by 7-8% at
    # L = 1024/2048/4096 on the H100 (experiments/kernels_tuning_h100.md, third session)
    ("fwd", "half", 64, 4): dict(BM=64, BN=128, num_warps=4, num_stages=2),
    ("fwd", "half", 32, 8): dict(BM=128, BN=128, num_warps=8, num_stages=3),
    ("fwd", "half", 64, 8): dict(BM=128, BN=128, num_warps=8, num_stages=3),
    ("fwd", "half", 128, 8): dict(BM=64, BN=128, num_warps=8, num_stages=2),
    ("fwd", "f32", 32, 8): dict(BM=64, BN=128, num_warps=8, num_stages=2),
    ("fwd", "f32", 64, 8): dict(BM=64, BN=128, num_warps=8, num_stages=2),
    ("fwd", "f32", 128, 8): dict(BM=64, BN=128, num_warps=4, num_stages=1),
    ("bwd", "half", 32, 2): dict(BM=32, BN=128, num_warps=8, num_stages=2),
    ("bwd", "half", 64, 2): dict(BM=32, BN=128, num_warps=8, num_stages=2),
    ("bwd", "half", 64, 8): dict(BM=16, BN=128, num_warps=8, num_stages=2),
    ("bwd", "half", 128, 8): dict(BM=16, BN=128, num_warps=8, num_stages=1),
    ("bwd", "f32", 32, 4): dict(BM=64, BN=64, num_warps=4, num_stages=2),
    ("bwd", "f32", 32, 8): dict(BM=16, BN=128, num_warps=8, num_stages=2),
    ("bwd", "f32", 64, 8): dict(BM=16, BN=128, num_warps=8, num_stages=2),
    ("bwd", "f32", 128, 4): dict(BM=16, BN=64, num_warps=8, num_stages=1),
    ("bwd", "f32", 128, 8): dict(BM=16, BN=128, num_warps=8, num_stages=1),
    ("dq", "f32", 128, 8): dict(BM=64, BN=128, num_warps=4, num_stages=1),
}


def _cfg(kind, dt, d, m):
  key = (kind, _dclass(dt), d)
  c = dict(_DEFAULT_CFG.get(key) or _DEFAULT_CFG[(kind, _dclass(dt), 64)])
  c.update(_M_CFG.get(key + (m,), {}))
  c.update(_CFG_OVERRIDE.get(key, {}))
  c["BN"] = max(c["BN"], 16 * m, META_BITS if kind == "cmp" else 0)
  return c


# ----------------------------------------------------------------------------- code generation
def _ind(lines, k):
  pad = " " * k
  flat = "\n".join(lines).split("\n")
  return "\n".join(pad + ln if ln else ln for ln in flat)


def _rank_keep(M, s, keep, shape, N=None):
  """Lines computing bool tiles keep{i} from score tiles s{i}: rank = # members that beat
  it (greater, or equal and lower index); keep = rank < NKEEP.  For N == 1 the kept
  element is the first arg-max, and ``gmax`` (the kept value of each group) is also set.
  For M == 4 (N = 2, 3) the six pairwise "i beats j" predicates are combined with boolean
  logic (majority / or of three bits: one LOP3 each) instead of integer rank counters."""
  if M == 4 and N in (2, 3) and _GEN_OPTIONS["logic_rank"]:
    out = [f"b{i}{j} = {s}{i} >= {s}{j}" for i in range(4) for j in range(i + 1, 4)]
    # beaters of member k: j < k with b_jk, j > k with ~b_kj
    beat = {k: [f"b{j}{k}" for j in range(k)] + [f"~b{k}{j}" for j in range(k + 1, 4)]
            for k in range(4)}
    for k in range(4):
      x, y, z = beat[k]
      if N == 2:  # at most one beater: not majority(x, y, z)
        out.append(f"{keep}{k} = ~(({x} & {y}) | ({z} & ({x} | {y})))")
      else:  # N == 3: not all three beat it
        out.append(f"{keep}{k} = ~({x} & {y} & {z})")
    return out
  if N == 1:
    mx = f"{s}0"
    for i in range(1, M):
      mx = f"tl.maximum({mx}, {s}{i})"
    out = [f"gmax = {mx}", f"{keep}0 = {s}0 == gmax", "taken = " + f"{keep}0"]
    for i in range(1, M):
      out.append(f"{keep}{i} = ({s}{i} == gmax) & (taken == 0)")
      if i < M - 1:
        out.append(f"taken = taken | {keep}{i}")
    return out
  out = [f"r{i} = tl.zeros({shape}, tl.int32)" for i in range(M)]
  for i in range(M):
    for j in range(i + 1, M):
      out.append(f"c = ({s}{i} >= {s}{j}).to(tl.int32)")
      out.append(f"r{j} += c")
      out.append(f"r{i} += 1 - c")
  out += [f"{keep}{i} = r{i} < NKEEP" for i in range(M)]
  return out


def _key_idx(M, start, with_mask=True):
  """kp{i}: key index of sub-tile i; kin{i}: inside length; kv{i}: real (not padded)."""
  out = []
  for i in range(M):
    out.append(f"kp{i} = {start} + offs_g * {M} + {i}")
    out.append(f"kin{i} = kp{i} < L")
    if with_mask:
      out.append(f"kv{i} = kin{i}")
      out.append("if HAS_MASK:")
      out.append(f"    kv{i} = kv{i} & (tl.load(KM + b * L + kp{i}, mask=kin{i}, other=0) != 0)")
  return out


_HEADER = '''
import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
'''


def _gen_source(M: int, N: int, poison: bool) -> str:
  P = lambda names: "".join(f"{n}_POISON, " for n in names) if poison else ""  # noqa: E731
  # fold_scale: s{i} hold raw QK^T (same N:M choice), the scale goes into the exp2 argument
  raw, sc = ("", " * qk_scale") if _GEN_OPTIONS["fold_scale"] else (" * qk_scale", "")
  src = [_HEADER]

  # ---------------------------------------------------------------- fused forward
  body = [
      "G: tl.constexpr = BN // %d" % M,
      "pid_m = tl.program_id(0)",
      "bh = tl.program_id(1)",
      "b = bh // H",
      "h = bh % H",
      "RS = H * D",
      "base = b.to(tl.int64) * L * RS + h * D",
      "offs_m = pid_m * BM + tl.arange(0, BM)",
      "offs_d = tl.arange(0, D)",
      "offs_g = tl.arange(0, G)",
      "rin = offs_m < L",
      "q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], "
      "other=0.0)",
      "qk_scale = sm_scale * 1.4426950408889634",
      "m_i = tl.full([BM], NEG_INF, tl.float32)",
      "l_i = tl.zeros([BM], tl.float32)",
      "acc = tl.zeros([BM, D], tl.float32)",
      "for start in range(0, L, BN):",
  ]
  loop = _key_idx(M, "start")
  for i in range(M):
    loop += [
        f"kt{i} = tl.load(K + base + kp{i}[None, :] * RS + offs_d[:, None], mask=kin{i}[None, :], "
        "other=0.0)",
        f"s{i} = tl.dot(q, kt{i}){raw}",
        f"s{i} = tl.where(kv{i}[None, :], s{i}, NEG_INF)",
    ]
  loop += _rank_keep(M, "s", "keep", "[BM, G]", N)
  row_once = _GEN_OPTIONS["row_once"]
  if N == 1:  # one exp per group: the kept value is the group max
    mx = "tl.max(gmax, 1)"
  else:
    loop += [f"t{i} = tl.where(keep{i}, s{i}, NEG_INF)" for i in range(M)]
    if row_once:
      tmax = "t0"
      for i in range(1, M):
        tmax = f"tl.maximum({tmax}, t{i})"
      mx = f"tl.max({tmax}, 1)"
    else:
      mx = "tl.max(t0, 1)"
      for i in range(1, M):
        mx = f"tl.maximum({mx}, tl.max(t{i}, 1))"
  loop += [
      f"m_new = tl.maximum(m_i, {mx}{sc})",
      "m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)",
      "alpha = tl.math.exp2(m_i - m_safe)",
      "acc = acc * alpha[:, None]",
      "l_i = l_i * alpha",
  ]
  if N == 1:
    loop += [f"pg = tl.math.exp2(gmax{sc} - m_safe[:, None])", "l_i += tl.sum(pg, 1)"]
  for i in range(M):
    if N == 1:
      loop.append(f"p{i} = tl.where(keep{i}, pg, 0.0)")
    else:
      loop.append(f"p{i} = tl.math.exp2(t{i}{sc} - m_safe[:, None])")
      if not row_once:
        loop.append(f"l_i += tl.sum(p{i}, 1)")
      else:
        loop.append(f"psum = p{i}" if i == 0 else f"psum += p{i}")
    loop += [
        f"v{i} = tl.load(V + base + kp{i}[:, None] * RS + offs_d[None, :], mask=kin{i}[:, None], "
        "other=0.0)",
        f"acc = tl.dot(p{i}.to(V.dtype.element_ty), v{i}, acc)",
    ]
  if N > 1 and row_once:
    loop.append("l_i += tl.sum(psum, 1)")
  loop += ["m_i = m_new"]
  body.append(_ind(loop, 4))
  body += [
      "l_safe = tl.where(l_i == 0.0, 1.0, l_i)",
      "out = acc / l_safe[:, None]",
      "tl.store(O + base + offs_m[:, None] * RS + offs_d[None, :], out.to(O.dtype.element_ty), "
      "mask=rin[:, None])",
      "lse = tl.where(l_i == 0.0, POS_INF, m_i + tl.math.log2(l_safe))",
      "tl.store(LSE + bh * LP + offs_m, lse)",
  ]
  src.append(
      "@triton.jit\n"
      f"def dfss_fwd(Q, K, V, KM, sm_scale, L, LP, H, {P(['O', 'LSE'])}O, LSE,\n"
      "             D: tl.constexpr,\n"
      "             NKEEP: tl.constexpr, HAS_MASK: tl.constexpr, BM: tl.constexpr, "
      "BN: tl.constexpr):\n"
      + _ind(body, 4) + "\n"
  )

  # ---------------------------------------------------------------- fused backward dK, dV
  # One program per key block (M sub-tiles of G keys), looping over query blocks.  The
  # two-kernel backward runs dfss_bwd_dkdv + dfss_bwd_dq; the one-pass kernel also adds
  # dQ = dS K into an fp32 buffer with atomics, so each tile's S, rank/keep and exp are
  # computed once instead of twice (5 products per tile instead of 7).
  for onepass in (False, True):
    body = [
        "G: tl.constexpr = BN // %d" % M,
        "pid_n = tl.program_id(0)",
        "bh = tl.program_id(1)",
        "b = bh // H",
        "h = bh % H",
        "RS = H * D",
        "base = b.to(tl.int64) * L * RS + h * D",
        "offs_d = tl.arange(0, D)",
        "offs_g = tl.arange(0, G)",
        "qk_scale = sm_scale * 1.4426950408889634",
    ]
    body += _key_idx(M, "pid_n * BN")
    for i in range(M):
      body += [
          f"k{i} = tl.load(K + base + kp{i}[:, None] * RS + offs_d[None, :], mask=kin{i}[:, None], "
          "other=0.0)",
          f"v{i} = tl.load(V + base + kp{i}[:, None] * RS + offs_d[None, :], mask=kin{i}[:, None], "
          "other=0.0)",
          f"dk{i} = tl.zeros([G, D], tl.float32)",
          f"dv{i} = tl.zeros([G, D], tl.float32)",
      ]
    body.append("for start in range(0, L, BM):")
    loop = ["offs_m = start + tl.arange(0, BM)", "rin = offs_m < L"]
    if onepass:
      loop.append("q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], "
                  "mask=rin[:, None], other=0.0)")
      q_t, q_rows = "tl.trans(q)", "q"
    else:
      loop.append("qT = tl.load(Q + base + offs_m[None, :] * RS + offs_d[:, None], "
                  "mask=rin[None, :], other=0.0)")
      q_t, q_rows = "qT", "tl.trans(qT)"
    loop += [
        "do = tl.load(DO + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], "
        "other=0.0)",
        "lse = tl.load(LSE + bh * LP + offs_m, mask=rin, other=POS_INF)",
        "dlt = tl.load(DELTA + bh * LP + offs_m, mask=rin, other=0.0)",
    ]
    if onepass:
      loop.append("dq = tl.zeros([BM, D], tl.float32)")
    for i in range(M):
      loop += [
          f"s{i} = tl.dot(k{i}, {q_t}){raw}",
          f"s{i} = tl.where(kv{i}[:, None], s{i}, NEG_INF)",
      ]
    loop += _rank_keep(M, "s", "keep", "[G, BM]", N)
    if N == 1:
      loop.append(f"pg = tl.math.exp2(gmax{sc} - lse[None, :])")
    for i in range(M):
      loop += [
          f"p{i} = tl.where(keep{i}, pg, 0.0)" if N == 1 else
          f"p{i} = tl.where(keep{i}, tl.math.exp2(s{i}{sc} - lse[None, :]), 0.0)",
          f"dv{i} = tl.dot(p{i}.to(DO.dtype.element_ty), do, dv{i})",
          f"dp{i} = tl.dot(v{i}, tl.trans(do))",
          f"ds{i} = (p{i} * (dp{i} - dlt[None, :])).to(Q.dtype.element_ty)",
          f"dk{i} = tl.dot(ds{i}, {q_rows}, dk{i})",
      ]
      if onepass:
        loop.append(f"dq = tl.dot(tl.trans(ds{i}), k{i}, dq)")
    if onepass:
      loop.append("tl.atomic_add(DQ + base + offs_m[:, None] * RS + offs_d[None, :], dq, "
                  "mask=rin[:, None], sem='relaxed')")
    body.append(_ind(loop, 4))
    for i in range(M):
      body += [
          f"tl.store(DK + base + kp{i}[:, None] * RS + offs_d[None, :], "
          f"(dk{i} * sm_scale).to(DK.dtype.element_ty), mask=kin{i}[:, None])",
          f"tl.store(DV + base + kp{i}[:, None] * RS + offs_d[None, :], "
          f"dv{i}.to(DV.dtype.element_ty), mask=kin{i}[:, None])",
      ]
    name, outs = (("dfss_bwd_onepass", "DQ_ZERO, DK, DV, DQ") if onepass
                  else ("dfss_bwd_dkdv", "DK, DV"))
    src.append(
        "@triton.jit\n"
        f"def {name}(Q, K, V, KM, DO, LSE, DELTA, sm_scale, L, LP, H, {P(['DK', 'DV'])}{outs},\n"
        "        D: tl.constexpr,\n"
        "        NKEEP: tl.constexpr, HAS_MASK: tl.constexpr, BM: tl.constexpr, "
        "BN: tl.constexpr):\n"
        + _ind(body, 4) + "\n"
    )

  # ---------------------------------------------------------------- fused backward dQ
  body = [
      "G: tl.constexpr = BN // %d" % M,
      "pid_m = tl.program_id(0)",
      "bh = tl.program_id(1)",
      "b = bh // H",
      "h = bh % H",
      "RS = H * D",
      "base = b.to(tl.int64) * L * RS + h * D",
      "offs_m = pid_m * BM + tl.arange(0, BM)",
      "offs_d = tl.arange(0, D)",
      "offs_g = tl.arange(0, G)",
      "rin = offs_m < L",
      "qk_scale = sm_scale * 1.4426950408889634",
      "q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], "
      "other=0.0)",
      "do = tl.load(DO + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], "
      "other=0.0)",
      "lse = tl.load(LSE + bh * LP + offs_m, mask=rin, other=POS_INF)",
      "dlt = tl.load(DELTA + bh * LP + offs_m, mask=rin, other=0.0)",
      "dq = tl.zeros([BM, D], tl.float32)",
      "for start in range(0, L, BN):",
  ]
  loop = _key_idx(M, "start")
  for i in range(M):
    loop += [
        f"kt{i} = tl.load(K + base + kp{i}[None, :] * RS + offs_d[:, None], mask=kin{i}[None, :], "
        "other=0.0)",
        f"s{i} = tl.dot(q, kt{i}){raw}",
        f"s{i} = tl.where(kv{i}[None, :], s{i}, NEG_INF)",
    ]
  loop += _rank_keep(M, "s", "keep", "[BM, G]", N)
  if N == 1:
    loop.append(f"pg = tl.math.exp2(gmax{sc} - lse[:, None])")
  for i in range(M):
    loop += [
        f"p{i} = tl.where(keep{i}, pg, 0.0)" if N == 1 else
        f"p{i} = tl.where(keep{i}, tl.math.exp2(s{i}{sc} - lse[:, None]), 0.0)",
        f"vt{i} = tl.load(V + base + kp{i}[None, :] * RS + offs_d[:, None], mask=kin{i}[None, :], "
        "other=0.0)",
        f"dp{i} = tl.dot(do, vt{i})",
        f"ds{i} = p{i} * (dp{i} - dlt[:, None])",
        f"dq = tl.dot(ds{i}.to(K.dtype.element_ty), tl.trans(kt{i}), dq)",
    ]
  body.append(_ind(loop, 4))
  body.append(
      "tl.store(DQ + base + offs_m[:, None] * RS + offs_d[None, :], "
      "(dq * sm_scale).to(DQ.dtype.element_ty), mask=rin[:, None])")
  src.append(
      "@triton.jit\n"
      f"def dfss_bwd_dq(Q, K, V, KM, DO, LSE, DELTA, sm_scale, L, LP, H, {P(['DQ'])}DQ,\n"
      "                D: tl.constexpr,\n"
      "                NKEEP: tl.constexpr, HAS_MASK: tl.constexpr, BM: tl.constexpr, "
      "BN: tl.constexpr):\n"
      + _ind(body, 4) + "\n"
  )

  # ---------------------------------------------------------------- compressed: SDDMM + prune
  # SC: fp32 [BH, LP, CW] (CW = KP*N/M), META: int32 [BH, LP, KP/32]
  body = [
      "G: tl.constexpr = BN // %d" % M,
      "pid_m = tl.program_id(0)",
      "pid_n = tl.program_id(1)",
      "bh = tl.program_id(2)",
      "b = bh // H",
      "h = bh % H",
      "RS = H * D",
      "base = b.to(tl.int64) * L * RS + h * D",
      "offs_m = pid_m * BM + tl.arange(0, BM)",
      "offs_d = tl.arange(0, D)",
      "offs_g = tl.arange(0, G)",
      "rin = offs_m < L",
      "q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], "
      "other=0.0)",
  ]
  body += _key_idx(M, "pid_n * BN")
  for i in range(M):
    body += [
        f"kt{i} = tl.load(K + base + kp{i}[None, :] * RS + offs_d[:, None], mask=kin{i}[None, :], "
        "other=0.0)",
        f"s{i} = tl.dot(q, kt{i}) * sm_scale",
        f"s{i} = tl.where(kv{i}[None, :], s{i}, NEG_INF)",
    ]
  body += _rank_keep(M, "s", "keep", "[BM, G]", N)
  # slot of each kept element (exclusive prefix count inside the group)
  body.append("sl0 = tl.zeros([BM, G], tl.int32)")
  for i in range(1, M):
    body.append(f"sl{i} = sl{i-1} + keep{i-1}.to(tl.int32)")
  body += [
      "CW = KP // %d * NKEEP" % M,
      "NW = KP // 32",
      "row = bh.to(tl.int64) * LP + offs_m",
      "col0 = (pid_n * G + offs_g) * NKEEP",
      "for t in tl.static_range(NKEEP):",
  ]
  sel = "NEG_INF"
  for i in reversed(range(M)):
    sel = f"tl.where(keep{i} & (sl{i} == t), s{i}, {sel})"
  body.append(_ind([
      f"val = {sel}",
      "tl.store(SC + row[:, None] * CW + (col0 + t)[None, :], val)",
  ], 4))
  body.append("w = keep0.to(tl.int32) << ((offs_g * %d) %% 32)[None, :]" % M)
  for i in range(1, M):
    body.append("w = w | (keep%d.to(tl.int32) << ((offs_g * %d + %d) %% 32)[None, :])" % (i, M, i))
  body += [
      "WPB: tl.constexpr = BN // 32",
      "w3 = tl.reshape(w, [BM, WPB, 32 // %d])" % M,
      "words = tl.xor_sum(w3, 2)",
      "offs_w = pid_n * WPB + tl.arange(0, WPB)",
      "tl.store(META + row[:, None] * NW + offs_w[None, :], words)",
  ]
  src.append(
      "@triton.jit\n"
      f"def dfss_sddmm_prune(Q, K, KM, sm_scale, L, LP, KP, H, {P(['SC', 'META'])}SC, META,\n"
      "                     D: tl.constexpr, NKEEP: tl.constexpr, HAS_MASK: tl.constexpr,\n"
      "                     BM: tl.constexpr, BN: tl.constexpr):\n"
      + _ind(body, 4) + "\n"
  )

  # ---------------------------------------------------------------- compressed softmax
  src.append(
      "@triton.jit\n"
      f"def dfss_csoftmax(SC, CW, {P(['A'])}A, BLOCK: tl.constexpr):\n"
      "    r = tl.program_id(0).to(tl.int64)\n"
      "    offs = tl.arange(0, BLOCK)\n"
      "    x = tl.load(SC + r * CW + offs, mask=offs < CW, other=NEG_INF)\n"
      "    mx = tl.max(x, 0)\n"
      "    mx = tl.where(mx == NEG_INF, 0.0, mx)\n"
      "    e = tl.exp(x - mx)\n"
      "    z = tl.sum(e, 0)\n"
      "    z = tl.where(z == 0.0, 1.0, z)\n"
      "    tl.store(A + r * CW + offs, (e / z).to(A.dtype.element_ty), mask=offs < CW)\n"
  )

  # ---------------------------------------------------------------- decompression snippet
  def decomp(ptr, rowv, keyv, start_key, shape, transposed):
    """Lines building dense tiles a{i} ([BM,G], or [G,BM] when transposed) from the
    compressed rows ``ptr`` and META for keys start_key + g*M + i; kb{i} = kept bits."""
    del keyv
    if transposed:
      r2, gsl = f"{rowv}[None, :]", "[:, None]"
    else:
      r2, gsl = f"{rowv}[:, None]", "[None, :]"
    out = [
        f"wd = tl.load(META + {r2} * NW + ({start_key} // 32 + (offs_g * {M}) // 32){gsl})",
        f"bit0 = ((offs_g * {M}) % 32){gsl}",
        f"slot = tl.zeros({shape}, tl.int32)",
    ]
    for i in range(M):
      out += [
          f"kb{i} = ((wd >> (bit0 + {i})) & 1) != 0",
          f"a{i} = tl.load({ptr} + {r2} * CW + ({start_key} // {M} + offs_g){gsl} * NKEEP + slot, "
          f"mask=kb{i}, other=0.0)",
          f"slot = slot + kb{i}.to(tl.int32)",
      ]
    return out

  # ---------------------------------------------------------------- SpMM: OUT = dense(AC) @ X
  body = [
      "G: tl.constexpr = BN // %d" % M,
      "CW = KP // %d * NKEEP" % M,
      "NW = KP // 32",
      "pid_m = tl.program_id(0)",
      "bh = tl.program_id(1)",
      "b = bh // H",
      "h = bh % H",
      "RS = H * D",
      "base = b.to(tl.int64) * L * RS + h * D",
      "offs_m = pid_m * BM + tl.arange(0, BM)",
      "offs_d = tl.arange(0, D)",
      "offs_g = tl.arange(0, G)",
      "rin = offs_m < L",
      "row = bh.to(tl.int64) * LP + offs_m",
      "acc = tl.zeros([BM, D], tl.float32)",
      "for start in range(0, L, BN):",
  ]
  loop = decomp("AC", "row", None, "start", "[BM, G]", False)
  for i in range(M):
    loop += [
        f"kp{i} = start + offs_g * {M} + {i}",
        f"x{i} = tl.load(X + base + kp{i}[:, None] * RS + offs_d[None, :], "
        f"mask=(kp{i} < L)[:, None], other=0.0)",
        f"acc = tl.dot(a{i}.to(X.dtype.element_ty), x{i}, acc)",
    ]
  body.append(_ind(loop, 4))
  body.append(
      "tl.store(OUT + base + offs_m[:, None] * RS + offs_d[None, :], "
      "(acc * ALPHA).to(OUT.dtype.element_ty), mask=rin[:, None])")
  src.append(
      "@triton.jit\n"
      f"def dfss_spmm(AC, META, X, L, LP, KP, H, {P(['OUT'])}OUT, ALPHA: tl.constexpr,\n"
      "              D: tl.constexpr,\n"
      "              NKEEP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):\n"
      + _ind(body, 4) + "\n"
  )

  # ---------------------------------------------------------------- SpMM^T: OUT = dense(AC)^T @ X
  body = [
      "G: tl.constexpr = BN // %d" % M,
      "CW = KP // %d * NKEEP" % M,
      "NW = KP // 32",
      "pid_n = tl.program_id(0)",
      "bh = tl.program_id(1)",
      "b = bh // H",
      "h = bh % H",
      "RS = H * D",
      "base = b.to(tl.int64) * L * RS + h * D",
      "offs_d = tl.arange(0, D)",
      "offs_g = tl.arange(0, G)",
      "kstart = pid_n * BN",
  ]
  body += [f"acc{i} = tl.zeros([G, D], tl.float32)" for i in range(M)]
  body.append("for start in range(0, L, BM):")
  loop = [
      "offs_m = start + tl.arange(0, BM)",
      "rin = offs_m < L",
      "row = bh.to(tl.int64) * LP + offs_m",
      "x = tl.load(X + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], "
      "other=0.0)",
  ]
  loop += decomp("AC", "row", None, "kstart", "[G, BM]", True)
  for i in range(M):
    loop.append(f"acc{i} = tl.dot(a{i}.to(X.dtype.element_ty), x, acc{i})")
  body.append(_ind(loop, 4))
  for i in range(M):
    body += [
        f"kp{i} = kstart + offs_g * {M} + {i}",
        f"tl.store(OUT + base + kp{i}[:, None] * RS + offs_d[None, :], "
        f"(acc{i} * ALPHA).to(OUT.dtype.element_ty), mask=(kp{i} < L)[:, None])",
    ]
  src.append(
      "@triton.jit\n"
      f"def dfss_spmm_t(AC, META, X, L, LP, KP, H, {P(['OUT'])}OUT, ALPHA: tl.constexpr,\n"
      "                D: tl.constexpr,\n"
      "                NKEEP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):\n"
      + _ind(body, 4) + "\n"
  )

  # ---------------------------------------------------------------- compressed dS at kept entries
  # dS = A * (dO V^T - delta) at the kept positions only
  body = [
      "G: tl.constexpr = BN // %d" % M,
      "CW = KP // %d * NKEEP" % M,
      "NW = KP // 32",
      "pid_m = tl.program_id(0)",
      "pid_n = tl.program_id(1)",
      "bh = tl.program_id(2)",
      "b = bh // H",
      "h = bh % H",
      "RS = H * D",
      "base = b.to(tl.int64) * L * RS + h * D",
      "offs_m = pid_m * BM + tl.arange(0, BM)",
      "offs_d = tl.arange(0, D)",
      "offs_g = tl.arange(0, G)",
      "rin = offs_m < L",
      "row = bh.to(tl.int64) * LP + offs_m",
      "kstart = pid_n * BN",
      "do = tl.load(DO + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], "
      "other=0.0)",
      "dlt = tl.load(DELTA + row, mask=rin, other=0.0)",
  ]
  body += decomp("AC", "row", None, "kstart", "[BM, G]", False)
  body.append("slot = tl.zeros([BM, G], tl.int32)")
  for i in range(M):
    body += [
        f"kp{i} = kstart + offs_g * {M} + {i}",
        f"vt{i} = tl.load(V + base + kp{i}[None, :] * RS + offs_d[:, None], "
        f"mask=(kp{i} < L)[None, :], other=0.0)",
        f"dp{i} = tl.dot(do, vt{i})",
        f"ds{i} = a{i}.to(tl.float32) * (dp{i} - dlt[:, None])",
        f"tl.store(DS + row[:, None] * CW + (kstart // {M} + offs_g[None, :]) * NKEEP + slot, "
        f"ds{i}.to(DS.dtype.element_ty), mask=kb{i})",
        f"slot = slot + kb{i}.to(tl.int32)",
    ]
  src.append(
      "@triton.jit\n"
      f"def dfss_sddmm_bwd(AC, META, DO, V, DELTA, L, LP, KP, H, {P(['DS'])}DS,\n"
      "                   D: tl.constexpr,\n"
      "                   NKEEP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):\n"
      + _ind(body, 4) + "\n"
  )
  return "\n\n".join(src)


def _kernels(M: int, N: int, poison: bool):
  """The kernel module for N:M under the current code-generation switches."""
  return _kernel_module(M, N, poison, tuple(sorted(_GEN_OPTIONS.items())))


@functools.lru_cache(maxsize=None)
def _kernel_module(M: int, N: int, poison: bool, gen_options: tuple):
  """Generate, write and import the kernel module.  gen_options is part of the cache key
  because the source depends on it (one compiled module per formulation)."""
  del gen_options  # read by _gen_source through _GEN_OPTIONS
  src = _gen_source(M, N, poison)
  digest = hashlib.sha1(src.encode()).hexdigest()[:12]
  d = os.path.join(tempfile.gettempdir(), "dfss_triton_gen")
  os.makedirs(d, exist_ok=True)
  name = f"dfss_gen_{N}of{M}_{'p' if poison else 'n'}_{digest}"
  path = os.path.join(d, name + ".py")
  if not os.path.exists(path):
    tmp = path + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.write(src)
    os.replace(tmp, path)
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  spec.loader.exec_module(mod)
  return mod


# ----------------------------------------------------------------------------- launch helper
_RUNTIME_INTS = ("CW", "L", "LP", "KP", "H")


def _call(kernel_name, M, args, out_shapes, grid, *, num_warps, num_stages, zero_outs=(), **meta):
  import jax_triton as jt

  poison = _POISON[0]
  mod = _kernels(M, meta.get("NKEEP", 1), poison)
  kernel = getattr(mod, kernel_name)
  is_scalar = lambda a: isinstance(a, (int, float, np.floating))  # noqa: E731
  arrays = [a for a in args if not is_scalar(a)]
  # jax-triton 0.3.1 types a Python float as fp64: pass float scalars as np.float32
  scalars = [np.float32(a) if isinstance(a, (float, np.floating)) else a
             for a in args if is_scalar(a)]
  # runtime integer arguments, in signature order (one compile serves every length)
  scalars += [int(meta.pop(nm)) for nm in _RUNTIME_INTS if nm in meta]
  # outputs in zero_outs are accumulated into (atomics): always pre-filled with 0 and
  # aliased; the others are pre-filled with NaN / -1 and aliased when poisoning
  fills, aliases = [], {}
  n_in = len(arrays)  # aliases index the array operands only
  for j, s in enumerate(out_shapes):
    if j in zero_outs:
      fill = 0
    elif poison:
      fill = jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else -1
    else:
      continue
    aliases[n_in + len(fills)] = j
    fills.append(jnp.full(s.shape, fill, s.dtype))
  # kernel parameter order: input arrays, scalars, poison buffers, outputs, constexprs
  outs = jt.triton_call(
      *arrays, *scalars, *fills, kernel=kernel, out_shape=out_shapes, grid=grid,
      num_warps=num_warps, num_stages=num_stages, input_output_aliases=aliases or None, **meta)
  return outs


def _cdiv(a, b):
  return -(-a // b)


def _lp(l):
  return _cdiv(l, 128) * 128


def _km(mask, b):
  if mask is None:
    return jnp.zeros((1,), jnp.int32), False
  return mask.astype(jnp.int32).reshape(b, -1), True


# ----------------------------------------------------------------------------- fused path
def _fused_fwd(q, k, v, mask, n, m):
  b, l, h, d = q.shape
  c = _cfg("fwd", q.dtype, d, m)
  lp = _lp(l)
  km, has_mask = _km(mask, b)
  o, lse = _call(
      "dfss_fwd", m, (q, k, v, km, 1.0 / math.sqrt(d)),
      (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b * h, lp), jnp.float32)),
      (_cdiv(l, c["BM"]), b * h), num_warps=c["num_warps"], num_stages=c["num_stages"],
      L=l, LP=lp, H=h, D=d, NKEEP=n, HAS_MASK=has_mask, BM=c["BM"], BN=c["BN"])
  return o, lse


def _delta(o, do):
  b, l, h, _ = o.shape
  dl = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, L, H]
  dl = jnp.transpose(dl, (0, 2, 1)).reshape(b * h, l)
  return jnp.pad(dl, ((0, 0), (0, _lp(l) - l)))


def _fused_bwd(q, k, v, mask, o, lse, do, n, m, deterministic=False):
  b, l, h, d = q.shape
  c = _cfg("bwd", q.dtype, d, m)
  lp = _lp(l)
  km, has_mask = _km(mask, b)
  do = do.astype(q.dtype)
  dlt = _delta(o, do)
  scale = 1.0 / math.sqrt(d)
  meta = dict(L=l, LP=lp, H=h, D=d, NKEEP=n, HAS_MASK=has_mask)
  grid = (_cdiv(l, c["BN"]), b * h)
  if c.get("onepass") and not deterministic:
    dk, dv, dq = _call(
        "dfss_bwd_onepass", m, (q, k, v, km, do, lse, dlt, scale),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(q.shape, jnp.float32)),
        grid, num_warps=c["num_warps"], num_stages=c["num_stages"], zero_outs=(2,),
        BM=c["BM"], BN=c["BN"], **meta)
    return (dq * scale).astype(q.dtype), dk, dv
  dk, dv = _call(
      "dfss_bwd_dkdv", m, (q, k, v, km, do, lse, dlt, scale),
      (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid, num_warps=c["num_warps"], num_stages=c["num_stages"],
      BM=c["BM"], BN=c["BN"], **meta)
  cq = _cfg("dq", q.dtype, d, m)
  (dq,) = _call(
      "dfss_bwd_dq", m, (q, k, v, km, do, lse, dlt, scale),
      (jax.ShapeDtypeStruct(q.shape, q.dtype),),
      (_cdiv(l, cq["BM"]), b * h), num_warps=cq["num_warps"], num_stages=cq["num_stages"],
      BM=cq["BM"], BN=cq["BN"], **meta)
  return dq, dk, dv


# ----------------------------------------------------------------------------- compressed path
def _geom(l, m, c):
  kp = _cdiv(l, c["BN"]) * c["BN"]
  lp = _lp(l)
  return lp, kp


def sddmm_prune(q, k, *, n, m, mask=None):
  """SDDMM + N:M prune epilogue.  Returns (values fp32 [B*H, LP, KP*n/m],
  meta int32 [B*H, LP, KP/32]) with LP, KP the internally padded row / key counts."""
  b, l, h, d = q.shape
  c = _cfg("cmp", q.dtype, d, m)
  lp, kp = _geom(l, m, c)
  km, has_mask = _km(mask, b)
  cw = kp // m * n
  sc, meta = _call(
      "dfss_sddmm_prune", m, (q, k, km, 1.0 / math.sqrt(d)),
      (jax.ShapeDtypeStruct((b * h, lp, cw), jnp.float32),
       jax.ShapeDtypeStruct((b * h, lp, kp // META_BITS), jnp.int32)),
      (lp // c["BM"], kp // c["BN"], b * h), num_warps=c["num_warps"], num_stages=c["num_stages"],
      L=l, LP=lp, KP=kp, H=h, D=d, NKEEP=n, HAS_MASK=has_mask, BM=c["BM"], BN=c["BN"])
  return sc, meta


def compressed_softmax(values, *, m, out_dtype=None):
  """Softmax over each compressed row (values [R0, R1, CW]); -inf rows -> zeros."""
  del m
  cw = values.shape[-1]
  rows = math.prod(values.shape[:-1])
  block = 1 << max(4, (cw - 1).bit_length())
  nw = 4 if block <= 1024 else 8
  (a,) = _call(
      "dfss_csoftmax", 2, (values,),
      (jax.ShapeDtypeStruct(values.shape, out_dtype or values.dtype),),
      (rows,), num_warps=nw, num_stages=1, CW=cw, BLOCK=block)
  return a


def spmm(probs, meta, x, *, n, m, alpha=1.0, transpose=False):
  """Compressed probs [B*H, LP, CW] + meta times x [B, L, H, D] -> [B, L, H, D].
  transpose=True computes dense(probs)^T @ x (keys as output rows)."""
  b, l, h, d = x.shape
  c = _cfg("cmp", x.dtype, d, m)
  lp, kp = _geom(l, m, c)
  assert probs.shape[1:] == (lp, kp // m * n), (probs.shape, lp, kp)
  meta_kw = dict(L=l, LP=lp, KP=kp, H=h, D=d, NKEEP=n, BM=c["BM"], BN=c["BN"])
  if transpose:
    grid = (kp // c["BN"], b * h)
    name = "dfss_spmm_t"
  else:
    grid = (lp // c["BM"], b * h)
    name = "dfss_spmm"
  (out,) = _call(name, m, (probs, meta, x),
                 (jax.ShapeDtypeStruct(x.shape, x.dtype),), grid,
                 num_warps=c["num_warps"], num_stages=c["num_stages"], ALPHA=float(alpha),
                 **meta_kw)
  return out


def _cmp_fwd(q, k, v, mask, n, m):
  sc, meta = sddmm_prune(q, k, n=n, m=m, mask=mask)
  a = compressed_softmax(sc, m=m, out_dtype=q.dtype)
  o = spmm(a, meta, v, n=n, m=m)
  return o, a, meta


def _cmp_bwd(q, k, v, o, a, meta, do, n, m):
  b, l, h, d = q.shape
  c = _cfg("cmp", q.dtype, d, m)
  lp, kp = _geom(l, m, c)
  do = do.astype(q.dtype)
  dlt = _delta(o, do)
  scale = 1.0 / math.sqrt(d)
  dv = spmm(a, meta, do, n=n, m=m, transpose=True)
  (ds,) = _call(
      "dfss_sddmm_bwd", m, (a, meta, do, v, dlt),
      (jax.ShapeDtypeStruct(a.shape, q.dtype),),
      (lp // c["BM"], kp // c["BN"], b * h), num_warps=c["num_warps"], num_stages=c["num_stages"],
      L=l, LP=lp, KP=kp, H=h, D=d, NKEEP=n, BM=c["BM"], BN=c["BN"])
  dq = spmm(ds, meta, k, n=n, m=m, alpha=scale)
  dk = spmm(ds, meta, q, n=n, m=m, alpha=scale, transpose=True)
  return dq, dk, dv


# ----------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attn(q, k, v, mask, n, m, impl, deterministic):
  if impl == "fused":
    return _fused_fwd(q, k, v, mask, n, m)[0]
  return _cmp_fwd(q, k, v, mask, n, m)[0]


def _attn_fwd(q, k, v, mask, n, m, impl, deterministic):
  if impl == "fused":
    o, lse = _fused_fwd(q, k, v, mask, n, m)
    return o, (q, k, v, mask, o, lse)
  o, a, meta = _cmp_fwd(q, k, v, mask, n, m)
  return o, (q, k, v, mask, o, (a, meta))


def _attn_bwd(n, m, impl, deterministic, res, do):
  q, k, v, mask, o, extra = res
  if impl == "fused":
    dq, dk, dv = _fused_bwd(q, k, v, mask, o, extra, do, n, m, deterministic)
  else:
    a, meta = extra  # the key mask is already encoded in A and meta
    dq, dk, dv = _cmp_bwd(q, k, v, o, a, meta, do, n, m)
  return dq, dk, dv, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def dfss_attention_triton(q, k, v, *, n: int, m: int, mask=None, impl: str = "fused",
                          deterministic: bool = False):
  """DFSS attention on the GPU.  q, k, v: [batch, length, heads, head_dim] (fp32 / bf16 /
  fp16, head_dim 16, 32, 64 or 128; 0 < n < m, m a power of two <= 32), mask: bool
  [batch, length] key padding (True = real token).  Same semantics as
  ``dfss_reference.dfss_attention_reference``.
  impl: "fused" (flash-style, default) or "compressed" (SDDMM+prune / softmax / SpMM).
  deterministic: the fused backward accumulates dQ with fp32 atomics by default (one pass,
  fastest; the summation order, hence the last bits of dQ, can vary run to run); True uses
  the separate dK/dV and dQ kernels, bit-reproducible and slower.
  Raises ValueError(``unsupported_reason(q, v, n, m, k=k)``) for operands the kernels do not
  handle."""
  reason = unsupported_reason(q, v, n, m, k=k)
  if reason is not None:
    raise ValueError(reason)
  if impl not in ("fused", "compressed"):
    raise ValueError(f"impl must be 'fused' or 'compressed', got {impl!r}")
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.shape != q.shape[:2]:
      raise ValueError(f"mask must be [batch, length] = {q.shape[:2]}, got {mask.shape}")
    mask = mask.astype(bool)
  return _attn(q, k, v, mask, n, m, impl, bool(deterministic))
