"""Fused DFSS kernels: flash-style attention over the N:M-pruned scores (Triton source).

Notation of the paper: S = Q K^T / sqrt(d) (here without the scale until the exponent: a
positive scale keeps the N:M order), the N:M-pruned scores S', P = softmax(S') and O = P V.  No
kernel writes S or P: each recomputes its QK^T tile on the tensor cores, prunes it N:M in
registers (``kernels.dfss.triton_select.nm_keep``) and works on the kept entries only.

Operands are [batch, length, heads, head_dim] (row stride H*D), read in place; grid axis 1 runs
batch*heads.  Rows past L are not stored; keys past L (and masked keys) score -inf.  The
log-sum-exp LSE and delta = rowsum(dO * O) are fp32 [batch*heads, LP] with LP >= L.  All
exponentials are base 2 (the scale carries log2(e)).

This module imports triton: the launchers in ``kernels.dfss.triton`` import it on first use.
"""

import triton
import triton.language as tl

from lra_sparse.kernels.shared import philox as dropout
from lra_sparse.kernels.dfss import triton_select as dfss_select

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def dfss_fwd(Q, K, V, KM, SEED, sm_scale, L, LP, H, O, LSE, D: tl.constexpr, M: tl.constexpr,
             NKEEP: tl.constexpr, HAS_MASK: tl.constexpr, DROP_T: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr):
  """Forward: O = softmax(S') V and LSE = log2 sum exp2 of the kept scaled scores, per row.

  One program per block of BM query rows; it loops over key blocks of BN keys with an online
  softmax over the kept entries (running max m_i, running sum l_i).  A row with no kept key
  (all keys padded) gives O = 0 and LSE = +inf.  DROP_T > 0: attention dropout (seed in SEED,
  ``ops.dropout``): the normaliser l_i sums every kept probability, the product with V takes
  the survivors only, and O is scaled by 1 / (1 - rate).
  """
  G: tl.constexpr = BN // M
  pid_m = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // H
  h = bh % H
  RS = H * D
  base = b.to(tl.int64) * L * RS + h * D
  offs_m = pid_m * BM + tl.arange(0, BM)
  offs_d = tl.arange(0, D)
  offs_g = tl.arange(0, G)
  rin = offs_m < L
  q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
  qk_scale = sm_scale * LOG2E
  m_i = tl.full([BM], NEG_INF, tl.float32)
  l_i = tl.zeros([BM], tl.float32)
  acc = tl.zeros([BM, D], tl.float32)
  if DROP_T > 0:
    k0, k1 = dropout.seed_key(SEED)
  for start in range(0, L, BN):
    kp, kin, kv = dfss_select.key_subtiles(start, offs_g, L, KM, b, M, HAS_MASK)
    s = ()
    for i in tl.static_range(M):
      kt = tl.load(K + base + kp[i][None, :] * RS + offs_d[:, None], mask=kin[i][None, :],
                   other=0.0)
      s = s + (tl.where(kv[i][None, :], tl.dot(q, kt), NEG_INF),)
    keep = dfss_select.nm_keep(s, NKEEP)
    live = keep
    if DROP_T > 0:
      live = dropout.survivors(
          keep, dropout.member_draws(k0, k1, bh, offs_m, start, M, G, False), DROP_T)
    if NKEEP == 1:  # the kept score of each group is its max: one exp per group
      gmax = dfss_select.group_max(s)
      m_new = tl.maximum(m_i, tl.max(gmax, 1) * qk_scale)
    else:
      t = ()
      for i in tl.static_range(M):
        t = t + (tl.where(keep[i], s[i], NEG_INF),)
      m_new = tl.maximum(m_i, tl.max(dfss_select.group_max(t), 1) * qk_scale)
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    acc = acc * alpha[:, None]
    l_i = l_i * alpha
    if NKEEP == 1:
      pg = tl.math.exp2(gmax * qk_scale - m_safe[:, None])
      l_i += tl.sum(pg, 1)
    for i in tl.static_range(M):
      if NKEEP == 1:
        p = tl.where(live[i], pg, 0.0)
      else:
        p = tl.math.exp2(t[i] * qk_scale - m_safe[:, None])
        if i == 0:
          psum = p
        else:
          psum += p
        if DROP_T > 0:
          p = tl.where(live[i], p, 0.0)
      v = tl.load(V + base + kp[i][:, None] * RS + offs_d[None, :], mask=kin[i][:, None],
                  other=0.0)
      acc = tl.dot(p.to(V.dtype.element_ty), v, acc)
    if NKEEP > 1:
      l_i += tl.sum(psum, 1)
    m_i = m_new
  l_safe = tl.where(l_i == 0.0, 1.0, l_i)
  out = acc / l_safe[:, None]
  if DROP_T > 0:
    out = out * dropout.kept_scale(DROP_T)
  tl.store(O + base + offs_m[:, None] * RS + offs_d[None, :], out.to(O.dtype.element_ty),
           mask=rin[:, None])
  lse = tl.where(l_i == 0.0, POS_INF, m_i + tl.math.log2(l_safe))
  tl.store(LSE + bh * LP + offs_m, lse)


@triton.jit
def _bwd_key_block(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK, DV, DQ,
                   D: tl.constexpr, M: tl.constexpr, NKEEP: tl.constexpr,
                   HAS_MASK: tl.constexpr, DROP_T: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr):
  """Backward for one key block (M sub-tiles of G keys), looping over query blocks of BM rows.

  Recomputes S and the N:M keep mask per tile, P = exp2(S * scale - LSE) on the kept entries
  and dS = P * (dP - delta) with dP = dO V^T; accumulates dV = P^T dO and dK = dS^T Q in
  registers.  With DQ (not None) it also adds dQ = dS K (unscaled) into the fp32 buffer DQ with
  atomics, so each tile's S, selection and exponentials are computed once for all three
  gradients (5 products per tile; dfss_bwd_dq recomputes them: 7 in all).  With dropout
  (DROP_T > 0) the forward's survivors Z are drawn again: dV = (P*Zs)^T dO and
  dS = P * (Zs * dP - delta), Zs = Z / (1 - rate).
  """
  G: tl.constexpr = BN // M
  pid_n = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // H
  h = bh % H
  RS = H * D
  base = b.to(tl.int64) * L * RS + h * D
  offs_d = tl.arange(0, D)
  offs_g = tl.arange(0, G)
  qk_scale = sm_scale * LOG2E
  kp, kin, kv = dfss_select.key_subtiles(pid_n * BN, offs_g, L, KM, b, M, HAS_MASK)
  if DROP_T > 0:
    k0, k1 = dropout.seed_key(SEED)
  k = ()
  v = ()
  dkv = ()  # per sub-tile (dK, dV) accumulators, fp32
  for i in tl.static_range(M):
    k = k + (tl.load(K + base + kp[i][:, None] * RS + offs_d[None, :], mask=kin[i][:, None],
                     other=0.0),)
    v = v + (tl.load(V + base + kp[i][:, None] * RS + offs_d[None, :], mask=kin[i][:, None],
                     other=0.0),)
    dkv = dkv + ((tl.zeros([G, D], tl.float32), tl.zeros([G, D], tl.float32)),)
  for start in range(0, L, BM):
    offs_m = start + tl.arange(0, BM)
    rin = offs_m < L
    if DQ is not None:  # Q rows (for dQ's atomic add); the products use tl.trans(q)
      q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None],
                  other=0.0)
      qt = tl.trans(q)
    else:
      qt = tl.load(Q + base + offs_m[None, :] * RS + offs_d[:, None], mask=rin[None, :],
                   other=0.0)
      q = tl.trans(qt)
    do = tl.load(DO + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None],
                 other=0.0)
    lse = tl.load(LSE + bh * LP + offs_m, mask=rin, other=POS_INF)
    dlt = tl.load(DELTA + bh * LP + offs_m, mask=rin, other=0.0)
    if DQ is not None:
      dq = tl.zeros([BM, D], tl.float32)
    s = ()
    for i in tl.static_range(M):
      s = s + (tl.where(kv[i][:, None], tl.dot(k[i], qt), NEG_INF),)
    keep = dfss_select.nm_keep(s, NKEEP)
    if DROP_T > 0:
      live = dropout.survivors(
          keep, dropout.member_draws(k0, k1, bh, offs_m, pid_n * BN, M, G, True), DROP_T)
    if NKEEP == 1:
      pg = tl.math.exp2(dfss_select.group_max(s) * qk_scale - lse[None, :])
    dkv_new = ()
    for i in tl.static_range(M):
      dk, dv = dkv[i]
      if NKEEP == 1:
        p = tl.where(keep[i], pg, 0.0)
      else:
        p = tl.where(keep[i], tl.math.exp2(s[i] * qk_scale - lse[None, :]), 0.0)
      if DROP_T > 0:
        dv = tl.dot(tl.where(live[i], p, 0.0).to(DO.dtype.element_ty), do, dv)
      else:
        dv = tl.dot(p.to(DO.dtype.element_ty), do, dv)
      dp = tl.dot(v[i], tl.trans(do))
      if DROP_T > 0:
        dp = tl.where(live[i], dp * dropout.kept_scale(DROP_T), 0.0)
      ds = (p * (dp - dlt[None, :])).to(Q.dtype.element_ty)
      dk = tl.dot(ds, q, dk)
      dkv_new = dkv_new + ((dk, dv),)
      if DQ is not None:
        dq = tl.dot(tl.trans(ds), k[i], dq)
    dkv = dkv_new
    if DQ is not None:
      tl.atomic_add(DQ + base + offs_m[:, None] * RS + offs_d[None, :], dq, mask=rin[:, None],
                    sem="relaxed")
  for i in tl.static_range(M):
    dk, dv = dkv[i]
    if DROP_T > 0:
      dv = dv * dropout.kept_scale(DROP_T)
    tl.store(DK + base + kp[i][:, None] * RS + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kin[i][:, None])
    tl.store(DV + base + kp[i][:, None] * RS + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kin[i][:, None])


@triton.jit
def dfss_bwd_dkdv(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK, DV,
                  D: tl.constexpr, M: tl.constexpr, NKEEP: tl.constexpr,
                  HAS_MASK: tl.constexpr, DROP_T: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr):
  """Deterministic backward, first kernel: dK = scale * dS^T Q and dV = P^T dO per key block."""
  _bwd_key_block(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK, DV, None, D, M,
                 NKEEP, HAS_MASK, DROP_T, BM, BN)


@triton.jit
def dfss_bwd_onepass(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK, DV, DQ,
                     D: tl.constexpr, M: tl.constexpr, NKEEP: tl.constexpr,
                     HAS_MASK: tl.constexpr, DROP_T: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr):
  """One-pass backward: dK, dV as dfss_bwd_dkdv, and dQ / scale = dS K added into the fp32
  buffer DQ (zeroed before the launch) with atomics; the summation order of dQ varies."""
  _bwd_key_block(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK, DV, DQ, D, M,
                 NKEEP, HAS_MASK, DROP_T, BM, BN)


@triton.jit
def dfss_bwd_dq(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DQ, D: tl.constexpr,
                M: tl.constexpr, NKEEP: tl.constexpr, HAS_MASK: tl.constexpr,
                DROP_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
  """Deterministic backward, second kernel: dQ = scale * dS K per block of BM query rows.

  Recomputes S, the keep mask and P for each key block, dP = dO V^T and dS = P * (dP - delta)
  (with dropout, dP * Zs as in ``_bwd_key_block``).
  """
  G: tl.constexpr = BN // M
  pid_m = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // H
  h = bh % H
  RS = H * D
  base = b.to(tl.int64) * L * RS + h * D
  offs_m = pid_m * BM + tl.arange(0, BM)
  offs_d = tl.arange(0, D)
  offs_g = tl.arange(0, G)
  rin = offs_m < L
  qk_scale = sm_scale * LOG2E
  q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
  do = tl.load(DO + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
  lse = tl.load(LSE + bh * LP + offs_m, mask=rin, other=POS_INF)
  dlt = tl.load(DELTA + bh * LP + offs_m, mask=rin, other=0.0)
  dq = tl.zeros([BM, D], tl.float32)
  if DROP_T > 0:
    k0, k1 = dropout.seed_key(SEED)
  for start in range(0, L, BN):
    kp, kin, kv = dfss_select.key_subtiles(start, offs_g, L, KM, b, M, HAS_MASK)
    kt = ()
    s = ()
    for i in tl.static_range(M):
      kt_i = tl.load(K + base + kp[i][None, :] * RS + offs_d[:, None], mask=kin[i][None, :],
                     other=0.0)
      kt = kt + (kt_i,)
      s = s + (tl.where(kv[i][None, :], tl.dot(q, kt_i), NEG_INF),)
    keep = dfss_select.nm_keep(s, NKEEP)
    if DROP_T > 0:
      live = dropout.survivors(
          keep, dropout.member_draws(k0, k1, bh, offs_m, start, M, G, False), DROP_T)
    if NKEEP == 1:
      pg = tl.math.exp2(dfss_select.group_max(s) * qk_scale - lse[:, None])
    for i in tl.static_range(M):
      if NKEEP == 1:
        p = tl.where(keep[i], pg, 0.0)
      else:
        p = tl.where(keep[i], tl.math.exp2(s[i] * qk_scale - lse[:, None]), 0.0)
      vt = tl.load(V + base + kp[i][None, :] * RS + offs_d[:, None], mask=kin[i][None, :],
                   other=0.0)
      dp = tl.dot(do, vt)
      if DROP_T > 0:
        dp = tl.where(live[i], dp * dropout.kept_scale(DROP_T), 0.0)
      ds = p * (dp - dlt[:, None])
      dq = tl.dot(ds.to(K.dtype.element_ty), tl.trans(kt[i]), dq)
  tl.store(DQ + base + offs_m[:, None] * RS + offs_d[None, :],
           (dq * sm_scale).to(DQ.dtype.element_ty), mask=rin[:, None])
