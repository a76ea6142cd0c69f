"""The paper's compressed DFSS pipeline (App. A.1) as Triton kernels.

Forward: SDDMM with an N:M-prune epilogue writes the compressed scaled scores S' (the N kept
values of every group, fp32 [B*H, LP, CW] with CW = KP*N/M) and the keep bits (int32 words, one
bit per key: M bits per group); a mask-aware softmax over each compressed row gives the
compressed probabilities A; SpMM multiplies dense(A) with V.  Backward on the compressed form:
dV = dense(A)^T dO (transposed SpMM), dS = A * (dO V^T - delta) sampled at the kept positions
(SDDMM), dQ = scale * dS K (SpMM) and dK = scale * dS^T Q (transposed SpMM).

Key sub-tiles and the N:M choice are those of the fused kernels (``kernels.dfss.triton_select``). 
Operands are
[batch, length, heads, head_dim] read in place; LP and KP are the padded row and key counts.

This module imports triton: the launchers in ``kernels.dfss.compressed`` import it on first use.
"""

import triton
import triton.language as tl

from lra_sparse.kernels.dfss import triton_select as dfss_select

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def dfss_sddmm_prune(Q, K, KM, sm_scale, L, LP, KP, H, SC, META, D: tl.constexpr,
                     M: tl.constexpr, NKEEP: tl.constexpr, HAS_MASK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
  """SDDMM + N:M prune: the compressed S' and its keep bits for one BM x BN tile of S.

  The kept values of group g go to columns g*NKEEP .. g*NKEEP+NKEEP-1 of SC in key order
  (padded keys give -inf); bit (g*M + i) % 32 of word (g*M + i) // 32 of META is member i's
  keep bit.
  """
  G: tl.constexpr = BN // M
  pid_m = tl.program_id(0)
  pid_n = tl.program_id(1)
  bh = tl.program_id(2)
  b = bh // H
  h = bh % H
  RS = H * D
  base = b.to(tl.int64) * L * RS + h * D
  offs_m = pid_m * BM + tl.arange(0, BM)
  offs_d = tl.arange(0, D)
  offs_g = tl.arange(0, G)
  rin = offs_m < L
  q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
  kp, kin, kv = dfss_select.key_subtiles(pid_n * BN, offs_g, L, KM, b, M, HAS_MASK)
  s = ()
  for i in tl.static_range(M):
    kt = tl.load(K + base + kp[i][None, :] * RS + offs_d[:, None], mask=kin[i][None, :],
                 other=0.0)
    s = s + (tl.where(kv[i][None, :], tl.dot(q, kt) * sm_scale, NEG_INF),)
  keep = dfss_select.nm_keep(s, NKEEP)
  # slot of each kept member in its group's NKEEP columns: kept members before it
  slot = (tl.zeros([BM, G], tl.int32),)
  for i in tl.static_range(1, M):
    slot = slot + (slot[i - 1] + keep[i - 1].to(tl.int32),)
  CW = KP // M * NKEEP
  NW = KP // 32
  row = bh.to(tl.int64) * LP + offs_m
  col0 = (pid_n * G + offs_g) * NKEEP
  for t in tl.static_range(NKEEP):
    in_slot = ()
    for i in tl.static_range(M):
      in_slot = in_slot + (keep[i] & (slot[i] == t),)
    val = NEG_INF
    for i in tl.static_range(M - 1, -1, -1):
      val = tl.where(in_slot[i], s[i], val)
    tl.store(SC + row[:, None] * CW + (col0 + t)[None, :], val)
  w = keep[0].to(tl.int32) << ((offs_g * M) % 32)[None, :]
  for i in tl.static_range(1, M):
    w = w | (keep[i].to(tl.int32) << ((offs_g * M + i) % 32)[None, :])
  WPB: tl.constexpr = BN // 32
  words = tl.xor_sum(tl.reshape(w, [BM, WPB, 32 // M]), 2)
  offs_w = pid_n * WPB + tl.arange(0, WPB)
  tl.store(META + row[:, None] * NW + offs_w[None, :], words)


@triton.jit
def dfss_csoftmax(SC, CW, A, BLOCK: tl.constexpr):
  """Softmax over one compressed row of CW values (-inf = padded): A = exp(S' - max) / sum.

  A row with no finite value gives zeros, never NaN.
  """
  r = tl.program_id(0).to(tl.int64)
  offs = tl.arange(0, BLOCK)
  x = tl.load(SC + r * CW + offs, mask=offs < CW, other=NEG_INF)
  mx = tl.max(x, 0)
  mx = tl.where(mx == NEG_INF, 0.0, mx)
  e = tl.exp(x - mx)
  z = tl.sum(e, 0)
  z = tl.where(z == 0.0, 1.0, z)
  tl.store(A + r * CW + offs, (e / z).to(A.dtype.element_ty), mask=offs < CW)


@triton.jit
def _decompress(AC, META, row, start, offs_g, CW, NW, M: tl.constexpr, NKEEP: tl.constexpr,
                TRANSPOSED: tl.constexpr):
  """Dense tiles of compressed rows for the keys start + g*M + i of a key block.

  Returns tuples (a, kb) of M tiles [BM, G] ([G, BM] when TRANSPOSED): a[i] holds the
  compressed value of member i of every group where its keep bit kb[i] is set, else 0.
  """
  if TRANSPOSED:
    wd = tl.load(META + row[None, :] * NW + (start // 32 + (offs_g * M) // 32)[:, None])
    bit0 = ((offs_g * M) % 32)[:, None]
  else:
    wd = tl.load(META + row[:, None] * NW + (start // 32 + (offs_g * M) // 32)[None, :])
    bit0 = ((offs_g * M) % 32)[None, :]
  slot = tl.zeros(wd.shape, tl.int32)
  a = ()
  kb = ()
  for i in tl.static_range(M):
    kb_i = ((wd >> (bit0 + i)) & 1) != 0
    if TRANSPOSED:
      ptr = AC + row[None, :] * CW + (start // M + offs_g)[:, None] * NKEEP + slot
    else:
      ptr = AC + row[:, None] * CW + (start // M + offs_g)[None, :] * NKEEP + slot
    a = a + (tl.load(ptr, mask=kb_i, other=0.0),)
    kb = kb + (kb_i,)
    slot = slot + kb_i.to(tl.int32)
  return a, kb


@triton.jit
def dfss_spmm(AC, META, X, L, LP, KP, H, OUT, ALPHA: tl.constexpr, D: tl.constexpr,
              M: tl.constexpr, NKEEP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
  """SpMM: OUT = ALPHA * dense(AC) X for one block of BM rows (O = A V; dQ = scale * dS K)."""
  G: tl.constexpr = BN // M
  CW = KP // M * NKEEP
  NW = KP // 32
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
  row = bh.to(tl.int64) * LP + offs_m
  acc = tl.zeros([BM, D], tl.float32)
  for start in range(0, L, BN):
    a, _ = _decompress(AC, META, row, start, offs_g, CW, NW, M, NKEEP, False)
    for i in tl.static_range(M):
      kp = start + offs_g * M + i
      x = tl.load(X + base + kp[:, None] * RS + offs_d[None, :], mask=(kp < L)[:, None],
                  other=0.0)
      acc = tl.dot(a[i].to(X.dtype.element_ty), x, acc)
  tl.store(OUT + base + offs_m[:, None] * RS + offs_d[None, :],
           (acc * ALPHA).to(OUT.dtype.element_ty), mask=rin[:, None])


@triton.jit
def dfss_spmm_t(AC, META, X, L, LP, KP, H, OUT, ALPHA: tl.constexpr, D: tl.constexpr,
                M: tl.constexpr, NKEEP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
  """Transposed SpMM: OUT = ALPHA * dense(AC)^T X for one block of BN keys (dV = A^T dO;
  dK = scale * dS^T Q), looping over row blocks; one accumulator per key sub-tile."""
  G: tl.constexpr = BN // M
  CW = KP // M * NKEEP
  NW = KP // 32
  pid_n = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // H
  h = bh % H
  RS = H * D
  base = b.to(tl.int64) * L * RS + h * D
  offs_d = tl.arange(0, D)
  offs_g = tl.arange(0, G)
  kstart = pid_n * BN
  acc = ()
  for i in tl.static_range(M):
    acc = acc + (tl.zeros([G, D], tl.float32),)
  for start in range(0, L, BM):
    offs_m = start + tl.arange(0, BM)
    rin = offs_m < L
    row = bh.to(tl.int64) * LP + offs_m
    x = tl.load(X + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
    a, _ = _decompress(AC, META, row, kstart, offs_g, CW, NW, M, NKEEP, True)
    acc_new = ()
    for i in tl.static_range(M):
      acc_new = acc_new + (tl.dot(a[i].to(X.dtype.element_ty), x, acc[i]),)
    acc = acc_new
  for i in tl.static_range(M):
    kp = kstart + offs_g * M + i
    tl.store(OUT + base + kp[:, None] * RS + offs_d[None, :],
             (acc[i] * ALPHA).to(OUT.dtype.element_ty), mask=(kp < L)[:, None])


@triton.jit
def dfss_sddmm_bwd(AC, META, DO, V, DELTA, L, LP, KP, H, DS, D: tl.constexpr, M: tl.constexpr,
                   NKEEP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
  """Compressed dS = A * (dO V^T - delta) at the kept positions of one BM x BN tile (SDDMM),
  written in the layout of A."""
  G: tl.constexpr = BN // M
  CW = KP // M * NKEEP
  NW = KP // 32
  pid_m = tl.program_id(0)
  pid_n = tl.program_id(1)
  bh = tl.program_id(2)
  b = bh // H
  h = bh % H
  RS = H * D
  base = b.to(tl.int64) * L * RS + h * D
  offs_m = pid_m * BM + tl.arange(0, BM)
  offs_d = tl.arange(0, D)
  offs_g = tl.arange(0, G)
  rin = offs_m < L
  row = bh.to(tl.int64) * LP + offs_m
  kstart = pid_n * BN
  do = tl.load(DO + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
  dlt = tl.load(DELTA + row, mask=rin, other=0.0)
  a, kb = _decompress(AC, META, row, kstart, offs_g, CW, NW, M, NKEEP, False)
  slot = tl.zeros([BM, G], tl.int32)
  for i in tl.static_range(M):
    kp = kstart + offs_g * M + i
    vt = tl.load(V + base + kp[None, :] * RS + offs_d[:, None], mask=(kp < L)[None, :],
                 other=0.0)
    dp = tl.dot(do, vt)
    ds = a[i].to(tl.float32) * (dp - dlt[:, None])
    tl.store(DS + row[:, None] * CW + (kstart // M + offs_g[None, :]) * NKEEP + slot,
             ds.to(DS.dtype.element_ty), mask=kb[i])
    slot = slot + kb[i].to(tl.int32)
