"""DSA's L_MSE from Gram matrices (Triton source): one pass over Q, K and X P forward, one
backward, over the real rows only.

With Q~_h = (X P) W~q_h, K~_h = (X P) W~k_h (``kernels.dsa.gram`` has the algebra):

    forward   G_h = X_h^T X_h, C_h = X_h^T (X P)   for X = Q and X = K, per (example, head)
              GX  = (X P)^T (X P)                    per example
    backward  dX_h  = X_h A_h + (X P) M_h           for X = Q and X = K
              d(X P) = (X P) N + sum_h (Q_h P_h + K_h R_h)

The small matrices A, M, N, P, R come from the Grams (XLA, ``kernels.dsa.gram``).  Every product
runs
on the bf16 tensor cores with fp32 accumulation; an fp32 operand arrives split as hi + lo, two
bf16 arrays that ``kernels.dsa.gram`` makes once in XLA (about 16 bits of mantissa; L_MSE needs
about
fp32 accuracy because its terms cancel when S~ ~ S), and a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi
(XLA's BF16_BF16_F32_X3).  A bf16 operand is exact in its hi part (X_EXACT: Q and K in bf16,
the model's usual case), which saves its lo passes.  Every operand is bf16 in memory, so the
loads feed the tensor cores directly and pipeline across the loops (the first version split
fp32 tiles in registers in every program: 2.85 ms per layer at the ListOps shape).
Three TF32 passes (``input_precision="tf32x3"``) were 1.7x slower still on an H100.

A row is real when it lies before the example's extent EXT[b] (one past its last real token)
and, with HAS_MASK, KM[b, row] != 0; the other rows are read as zeros (that removes exactly
their pairs), the loops stop at the extent, and the backward writes zeros there.

Operands: QH, QL, KH, KL [batch, length, heads, D0] (rows of stride H * D0; QL = QH and KL = KH
unread with X_EXACT), XPH, XPL [batch, length, R0]; D and RP are D0 and R0 rounded up to powers
of two >= 16 (the padded columns are read as zeros).  H, D0 and R0 are compile-time constants:
with them the row strides are known multiples of 8 elements, so the bf16 tiles load as 16-byte
vectors and the loops' loads go through asynchronous copies (runtime strides allowed neither).
The small matrices come padded to D / RP, as hi and lo.  Columns of width RP are handled in
blocks of RB (a grid axis, or a loop over the contraction) to bound the registers.  This module
imports triton: ``kernels.dsa.gram`` launches it.
"""

import triton
import triton.language as tl


@triton.jit
def _real_rows(KM, b, rows, L, ext, HAS_MASK: tl.constexpr):
  """bool [BL]: rows before the extent (and unmasked, with HAS_MASK)."""
  live = rows < ext
  if HAS_MASK:
    live = live & (tl.load(KM + b * L + rows, mask=live, other=0) != 0)
  return live


@triton.jit
def _rows(hi, lo, rows, stride, cols, ncols, live, EXACT: tl.constexpr):
  """(hi, lo) [BL, C] of ptr[rows * stride + cols], zeros off the live rows and past ncols
  (lo = hi, unread, when EXACT)."""
  offsets = rows[:, None].to(tl.int64) * stride + cols[None, :]
  keep = live[:, None] & (cols[None, :] < ncols)
  x = tl.load(hi + offsets, mask=keep, other=0.0)
  if EXACT:
    return x, x
  return x, tl.load(lo + offsets, mask=keep, other=0.0)


@triton.jit
def _small(hi, lo, offsets):
  """(hi, lo) of a padded small matrix (every element in bounds)."""
  return tl.load(hi + offsets), tl.load(lo + offsets)


@triton.jit
def _dot(a, b, acc, A_EXACT: tl.constexpr = False, B_EXACT: tl.constexpr = False):
  """acc + a b from (hi, lo) parts, omitting lo x lo and the lo of an exact operand."""
  acc = tl.dot(a[0], b[0], acc)
  if not B_EXACT:
    acc = tl.dot(a[0], b[1], acc)
  if not A_EXACT:
    acc = tl.dot(a[1], b[0], acc)
  return acc


@triton.jit
def _trans(a):
  return tl.trans(a[0]), tl.trans(a[1])


@triton.jit
def gram_fwd(QH, QL, KH, KL, XPH, XPL, KM, EXT, L, G, C, H: tl.constexpr, D0: tl.constexpr,
             R0: tl.constexpr, D: tl.constexpr, RP: tl.constexpr, RB: tl.constexpr,
             BL: tl.constexpr, HAS_MASK: tl.constexpr, X_EXACT: tl.constexpr):
  """For X = Q (program_id(0) = 0) or K (1) of one (example, head) = program_id(1):
  C [batch*heads, 2, D, RP] columns program_id(2) * RB... of X^T (XP), and with the first
  column block G [batch*heads, 2, D, D] = X^T X."""
  side = tl.program_id(0)
  bh = tl.program_id(1)
  rb = tl.program_id(2)
  b = bh // H
  h = bh % H
  ext = tl.load(EXT + b)
  cols = tl.arange(0, D)
  rcols = rb * RB + tl.arange(0, RB)
  x_base = b.to(tl.int64) * L * H * D0 + h * D0
  xp_base = b.to(tl.int64) * L * R0
  if side == 0:
    xh, xl = QH + x_base, QL + x_base
  else:
    xh, xl = KH + x_base, KL + x_base
  gram = tl.zeros([D, D], tl.float32)
  cross = tl.zeros([D, RB], tl.float32)
  for start in range(0, ext, BL):
    rows = start + tl.arange(0, BL)
    live = _real_rows(KM, b, rows, L, ext, HAS_MASK)
    x = _rows(xh, xl, rows, H * D0, cols, D0, live, X_EXACT)
    xp = _rows(XPH + xp_base, XPL + xp_base, rows, R0, rcols, R0, live, False)
    xt = _trans(x)
    if rb == 0:
      gram = _dot(xt, x, gram, X_EXACT, X_EXACT)
    cross = _dot(xt, xp, cross, X_EXACT)
  out = (bh * 2 + side).to(tl.int64)
  if rb == 0:
    tl.store(G + out * D * D + cols[:, None] * D + cols[None, :], gram)
  tl.store(C + out * D * RP + cols[:, None] * RP + rcols[None, :], cross)


@triton.jit
def gram_fwd_xp(XPH, XPL, KM, EXT, L, GX, R0: tl.constexpr, RP: tl.constexpr, RB: tl.constexpr,
                BL: tl.constexpr, HAS_MASK: tl.constexpr):
  """GX [batch, RP, RP] = (XP)^T (XP) of one example = program_id(0), the block of rows
  program_id(1) * RB... and columns program_id(2) * RB...."""
  b = tl.program_id(0)
  ri = tl.program_id(1) * RB + tl.arange(0, RB)
  rj = tl.program_id(2) * RB + tl.arange(0, RB)
  ext = tl.load(EXT + b)
  xph = XPH + b.to(tl.int64) * L * R0
  xpl = XPL + b.to(tl.int64) * L * R0
  gram = tl.zeros([RB, RB], tl.float32)
  for start in range(0, ext, BL):
    rows = start + tl.arange(0, BL)
    live = _real_rows(KM, b, rows, L, ext, HAS_MASK)
    xi = _rows(xph, xpl, rows, R0, ri, R0, live, False)
    xj = _rows(xph, xpl, rows, R0, rj, R0, live, False)
    gram = _dot(_trans(xi), xj, gram)
  tl.store(GX + b.to(tl.int64) * RP * RP + ri[:, None] * RP + rj[None, :], gram)


@triton.jit
def gram_bwd_qk(QH, QL, KH, KL, XPH, XPL, KM, EXT, AH, AL, MH, ML, L, DQ, DK, H: tl.constexpr,
                D0: tl.constexpr, R0: tl.constexpr, D: tl.constexpr, RP: tl.constexpr,
                RB: tl.constexpr, BL: tl.constexpr, HAS_MASK: tl.constexpr,
                X_EXACT: tl.constexpr):
  """dX = X A + XP M on the real rows program_id(1) * BL... (zeros on the others) for X = Q
  (program_id(0) = 0, into DQ) or K (1, into DK) of one (example, head) = program_id(2);
  A [batch*heads, 2, D, D], M [batch*heads, 2, RP, D] as hi and lo."""
  side = tl.program_id(0)
  start = tl.program_id(1) * BL
  bh = tl.program_id(2)
  b = bh // H
  h = bh % H
  ext = tl.load(EXT + b)
  cols = tl.arange(0, D)
  rows = start + tl.arange(0, BL)
  offset = b.to(tl.int64) * L * H * D0 + h * D0
  xp_base = b.to(tl.int64) * L * R0
  small = (bh * 2 + side).to(tl.int64)
  out = tl.zeros([BL, D], tl.float32)
  if start < ext:
    live = _real_rows(KM, b, rows, L, ext, HAS_MASK)
    if side == 0:
      x = _rows(QH + offset, QL + offset, rows, H * D0, cols, D0, live, X_EXACT)
    else:
      x = _rows(KH + offset, KL + offset, rows, H * D0, cols, D0, live, X_EXACT)
    a = _small(AH, AL, small * D * D + cols[:, None] * D + cols[None, :])
    out = _dot(x, a, out, X_EXACT)
    for rb in tl.static_range(0, RP, RB):
      rcols = rb + tl.arange(0, RB)
      xp = _rows(XPH + xp_base, XPL + xp_base, rows, R0, rcols, R0, live, False)
      m = _small(MH, ML, small * RP * D + rcols[:, None] * D + cols[None, :])
      out = _dot(xp, m, out)
    out = tl.where(live[:, None], out, 0.0)
  ptrs = rows[:, None].to(tl.int64) * H * D0 + cols[None, :]
  keep = (rows[:, None] < L) & (cols[None, :] < D0)
  if side == 0:
    tl.store(DQ + offset + ptrs, out.to(DQ.dtype.element_ty), mask=keep)
  else:
    tl.store(DK + offset + ptrs, out.to(DK.dtype.element_ty), mask=keep)


@triton.jit
def gram_bwd_xp(QH, QL, KH, KL, XPH, XPL, KM, EXT, NH, NL, PH, PL, RH, RL, L, DXP,
                H: tl.constexpr, D0: tl.constexpr, R0: tl.constexpr, D: tl.constexpr,
                RP: tl.constexpr, RB: tl.constexpr, BL: tl.constexpr, HAS_MASK: tl.constexpr,
                X_EXACT: tl.constexpr):
  """d(XP) = XP N + sum_h (Q_h P_h + K_h R_h) on the real rows program_id(0) * BL... of one
  example = program_id(1), columns program_id(2) * RB... (zeros on the other rows);
  N [batch, RP, RP], P, R [batch*heads, D, RP] as hi and lo."""
  start = tl.program_id(0) * BL
  b = tl.program_id(1)
  ocols = tl.program_id(2) * RB + tl.arange(0, RB)
  ext = tl.load(EXT + b)
  cols = tl.arange(0, D)
  rows = start + tl.arange(0, BL)
  xp_base = b.to(tl.int64) * L * R0
  out = tl.zeros([BL, RB], tl.float32)
  if start < ext:
    live = _real_rows(KM, b, rows, L, ext, HAS_MASK)
    for rb in tl.static_range(0, RP, RB):
      rcols = rb + tl.arange(0, RB)
      xp = _rows(XPH + xp_base, XPL + xp_base, rows, R0, rcols, R0, live, False)
      n = _small(NH, NL, b.to(tl.int64) * RP * RP + rcols[:, None] * RP + ocols[None, :])
      out = _dot(xp, n, out)
    for h in range(0, H):
      offset = b.to(tl.int64) * L * H * D0 + h * D0
      small = (b * H + h).to(tl.int64) * D * RP + cols[:, None] * RP + ocols[None, :]
      q = _rows(QH + offset, QL + offset, rows, H * D0, cols, D0, live, X_EXACT)
      out = _dot(q, _small(PH, PL, small), out, X_EXACT)
      k = _rows(KH + offset, KL + offset, rows, H * D0, cols, D0, live, X_EXACT)
      out = _dot(k, _small(RH, RL, small), out, X_EXACT)
    out = tl.where(live[:, None], out, 0.0)
  tl.store(DXP + b.to(tl.int64) * L * R0 + rows[:, None] * R0 + ocols[None, :], out,
           mask=(rows[:, None] < L) & (ocols[None, :] < R0))
