"""DSA attention kernels (Triton source): softmax over the selected keys only, flash style.

    S = Q K^T / sqrt(d) on the kept entries (one bit per (row group, key), from dsa_select)
    P = softmax(S over the kept entries);  O = P V

Each kernel computes its QK^T tile on the tensor cores, reads the tile's keep bits (BN / 32
words per row; row i reads its group i // VEC) and treats every other entry as -inf.  No
kernel writes S or P: the forward keeps an online softmax and writes O and a per-row
log-sum-exp; the backward recomputes the tile.  A key-tile whose bits are all zero for the
whole query block is skipped when SKIP (no products, no exponentials), so the work falls as
the kept set thins out in blocks.  With LISTS (the block rule) a block's loop runs over a list
of tile indices instead of every tile (``kernels.dsa.reference.tile_lists``: the tiles that
meet a kept block pair), so the skipped tiles cost nothing at all, not even their bit test.

``dsa_fwd_gather`` is the forward over compact key lists instead (``dsa_compact``): per block of
query rows it loads only the keys its row groups keep (K and V rows by index), so its work is
the union of those keys, and it writes the same O and log-sum-exp for the same backward.

Padding costs no work, exactly: EXT int32 [batch] is one past each example's last real key
(L without a mask) and no bit is set past it, so the forward and dQ key loops stop there and a
dK/dV key block past it does no step (its P is 0) and writes zeros.  Row groups past EXT
(trailing padding) keep nothing, so a forward block of rows past it does no step and writes
O = 0.  ROWS int32 [batch] is one past the example's last query row with a non-zero dO: a row
with dO = 0 adds exactly 0 to dK, dV and dQ (dV += P^T dO, and dS = P (dP - rowsum(dO O))
vanishes), so the dK/dV query loops stop there and a dQ block past it does no step and writes
zeros.  Padded rows' outputs reach no loss in a masked model, so forward and backward cost
what the real lengths need.

Attention dropout (DROP_T > 0, Philox key in SEED): the kept probabilities are multiplied by
Z / (1 - rate), Z drawn per (batch*head, query row, key) by ``ops.dropout``'s per-key rule
(``dropout.key_draws``), so the backward draws the same Z again: O = (P * Z) V / (1 - rate),
dV = (P * Zs)^T dO, dS = P * (Zs * dP - delta) with Zs = Z / (1 - rate); delta = rowsum(dO * O)
is unchanged (the dropped O's).  The softmax normaliser sums the undropped P.

Operands are [batch, length, heads, head_dim] (row stride H*D), read in place; grid axis 1 runs
batch*heads.  BITS int32 [batch*heads, G, W].  LSE and delta = rowsum(dO * O) are fp32
[batch*heads, LP].  Exponentials are base 2 (the scale carries log2(e)).  A row that keeps
nothing (all keys padded) gives O = 0, LSE = +inf and zero gradients.
"""

import triton
import triton.language as tl

from lra_sparse.kernels.shared import philox as dropout

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _program(L, H, G, W, D: tl.constexpr):
  """(block index, batch*head index, example index, operand base offset, bits base offset)
  of this program: grid axis 0 runs the row (or key) blocks, axis 1 batch*heads."""
  pid = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // H
  h = bh % H
  RS = H * D
  base = b.to(tl.int64) * L * RS + h * D
  return pid, bh, b, base, bh.to(tl.int64) * G * W


@triton.jit
def _tile_words(BITS, bbase, offs_m, rin, start, W, VEC: tl.constexpr, BN: tl.constexpr):
  """The keep words [BM, BN / 32] of query rows offs_m for the keys start .. start + BN."""
  offs_w = start // 32 + tl.arange(0, BN // 32)
  return tl.load(BITS + bbase + (offs_m // VEC)[:, None] * W + offs_w[None, :],
                 mask=rin[:, None] & (offs_w[None, :] < W), other=0)


@triton.jit
def _any(words):
  """True when a tile keeps at least one entry."""
  return tl.max(tl.max((words != 0).to(tl.int32), 1), 0) > 0


@triton.jit
def _go(words, SKIP: tl.constexpr):
  """Whether to compute a tile: always, or (SKIP) only when it keeps an entry."""
  if SKIP:
    go = _any(words)
  else:
    go = tl.full([], 1, tl.int1)
  return go


@triton.jit
def _unpack(words, BM: tl.constexpr, BN: tl.constexpr):
  """[BM, BN / 32] words -> bool [BM, BN]."""
  bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
  return tl.reshape(bits, [BM, BN]) != 0


@triton.jit
def _keys_transposed(K, base, start, offs_d, RS, L, BN: tl.constexpr):
  """(the key tile's positions, which are in range, its K^T [D, BN]) for keys start .. + BN."""
  offs_n = start + tl.arange(0, BN)
  kin = offs_n < L
  kt = tl.load(K + base + offs_n[None, :] * RS + offs_d[:, None], mask=kin[None, :], other=0.0)
  return offs_n, kin, kt


@triton.jit
def _fwd_tile(start, K, V, BITS, bbase, base, offs_m, offs_d, rin, RS, q, m_i, l_i, acc,
              qk_scale, L, W, bh, k0, k1, VEC: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, SKIP: tl.constexpr, DROP_T: tl.constexpr):
  """The forward's step over the key tile at ``start``: (m_i, l_i, acc) updated."""
  words = _tile_words(BITS, bbase, offs_m, rin, start, W, VEC, BN)
  if _go(words, SKIP):
    keep = _unpack(words, BM, BN)
    offs_n, kin, kt = _keys_transposed(K, base, start, offs_d, RS, L, BN)
    p, alpha, m_i, l_i = _online_softmax(tl.where(keep, tl.dot(q, kt), NEG_INF), m_i, l_i,
                                         qk_scale)
    if DROP_T > 0:
      p = tl.where(dropout.key_draws(k0, k1, bh, offs_m, start, BN, False) >= DROP_T, p, 0.0)
    v = tl.load(V + base + offs_n[:, None] * RS + offs_d[None, :], mask=kin[:, None],
                other=0.0)
    acc = tl.dot(p.to(V.dtype.element_ty), v, acc * alpha[:, None])
  return m_i, l_i, acc


@triton.jit
def _listed(LIST, COUNT, NL, block, bh, n_blocks, live):
  """(the list row's base offset, its length): the tiles a block visits in list mode (0 of
  them when not ``live``)."""
  row = bh.to(tl.int64) * n_blocks + block
  return row * NL, tl.where(live, tl.load(COUNT + row), 0)


@triton.jit
def dsa_fwd(Q, K, V, BITS, EXT, SEED, LIST, COUNT, sm_scale, L, LP, H, G, W, NL, O, LSE,
            D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            SKIP: tl.constexpr, DROP_T: tl.constexpr, LISTS: tl.constexpr):
  """Forward: one program per BM query rows, online softmax over the kept keys (the key
  tiles below the example's extent EXT: no bit is set past it; none for a block of rows past
  EXT, trailing padding, whose rows keep nothing: O = 0).  LISTS: only the key tiles of the
  block's list (LIST int32 [batch*heads, row blocks, NL] tile indices, increasing, COUNT of
  them): the tiles whose bits can be set, in the same order, so the same result."""
  pid_m, bh, b, base, bbase = _program(L, H, G, W, D)
  RS, offs_m, offs_d, rin, q, m_i, l_i, acc = _fwd_start(Q, base, pid_m, L, H, D, BM)
  qk_scale = sm_scale * LOG2E
  k0 = 0
  k1 = 0
  if DROP_T > 0:
    k0, k1 = dropout.seed_key(SEED)
  ext = tl.load(EXT + b)
  ext = tl.where(pid_m * BM < ext, ext, 0)
  if LISTS:
    lbase, n = _listed(LIST, COUNT, NL, pid_m, bh, tl.cdiv(L, BM), ext > 0)
    for i in range(0, n):
      start = tl.load(LIST + lbase + i) * BN
      m_i, l_i, acc = _fwd_tile(start, K, V, BITS, bbase, base, offs_m, offs_d, rin, RS, q,
                                m_i, l_i, acc, qk_scale, L, W, bh, k0, k1, VEC, BM, BN, SKIP,
                                DROP_T)
  else:
    for start in range(0, ext, BN):
      m_i, l_i, acc = _fwd_tile(start, K, V, BITS, bbase, base, offs_m, offs_d, rin, RS, q,
                                m_i, l_i, acc, qk_scale, L, W, bh, k0, k1, VEC, BM, BN, SKIP,
                                DROP_T)
  _store_out(O, LSE, base, bh * LP, offs_m, rin, offs_d, RS, acc, m_i, l_i, DROP_T)


@triton.jit
def _fwd_start(Q, base, pid_m, L, H, D: tl.constexpr, BM: tl.constexpr):
  """A forward program's row block: (row stride, rows, columns, rows in range, its Q tile, and
  the online softmax's empty row maxima, sums and accumulator)."""
  RS = H * D
  offs_m = pid_m * BM + tl.arange(0, BM)
  offs_d = tl.arange(0, D)
  rin = offs_m < L
  q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
  return (RS, offs_m, offs_d, rin, q, tl.full([BM], NEG_INF, tl.float32),
          tl.zeros([BM], tl.float32), tl.zeros([BM, D], tl.float32))


@triton.jit
def _online_softmax(s, m_i, l_i, qk_scale):
  """One key tile of the online softmax: s [BM, BN] (-inf where not kept) -> (the tile's
  unnormalised probabilities, the rescale of the earlier sums, the new row maxima and sums),
  base 2.  A row with nothing kept so far keeps m = -inf and l = 0."""
  m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
  m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
  alpha = tl.math.exp2(m_i - m_safe)
  p = tl.math.exp2(s * qk_scale - m_safe[:, None])
  return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store_out(O, LSE, base, lbase, offs_m, rin, offs_d, RS, acc, m_i, l_i,
               DROP_T: tl.constexpr):
  """O = acc / l (0 for a row that kept nothing; times 1 / (1 - rate) with dropout) and the
  row's log-sum-exp (+inf for a row that kept nothing)."""
  l_safe = tl.where(l_i == 0.0, 1.0, l_i)
  out = acc / l_safe[:, None]
  if DROP_T > 0:
    out = out * dropout.kept_scale(DROP_T)
  tl.store(O + base + offs_m[:, None] * RS + offs_d[None, :], out.to(O.dtype.element_ty),
           mask=rin[:, None])
  tl.store(LSE + lbase + offs_m, tl.where(l_i == 0.0, POS_INF, m_i + tl.math.log2(l_safe)))


@triton.jit
def dsa_fwd_gather(Q, K, V, SLOTS, COUNT, SEED, sm_scale, L, LP, H, T, O, LSE,
                   D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   DROP_T: tl.constexpr):
  """Forward over compact key lists: one program per BM query rows (the block of
  ``dsa_compact``, same BM), online softmax over the union of its row groups' kept keys only,
  BN list slots per step.  Each slot gives the key (K and V rows loaded by index) and which of
  the block's groups keep it; the other rows treat it as -inf.  Same O and log-sum-exp as
  ``dsa_fwd`` (up to the order of the fp32 sums), so the backward kernels serve both; the work
  is that of the union, not of every key tile.  Dropout draws each (row, key) as ``dsa_fwd``
  does (``dropout.gathered_key_draws``)."""
  pid_m, bh, b, base, _ = _program(L, H, 0, 0, D)
  RS, offs_m, offs_d, rin, q, m_i, l_i, acc = _fwd_start(Q, base, pid_m, L, H, D, BM)
  qk_scale = sm_scale * LOG2E
  group = tl.arange(0, BM) // VEC
  if DROP_T > 0:
    k0, k1 = dropout.seed_key(SEED)
  sbase = (bh * T + pid_m).to(tl.int64) * L
  count = tl.load(COUNT + bh * T + pid_m)
  for start in range(0, count, BN):
    offs_s = start + tl.arange(0, BN)
    sin = offs_s < count
    slot = tl.load(SLOTS + sbase + offs_s, mask=sin, other=0)
    key = slot >> 16
    keep = ((slot[None, :] >> group[:, None]) & 1) != 0
    kt = tl.load(K + base + key[None, :] * RS + offs_d[:, None], mask=sin[None, :], other=0.0)
    p, alpha, m_i, l_i = _online_softmax(tl.where(keep, tl.dot(q, kt), NEG_INF), m_i, l_i,
                                         qk_scale)
    if DROP_T > 0:
      p = tl.where(dropout.gathered_key_draws(k0, k1, bh, offs_m, key) >= DROP_T, p, 0.0)
    v = tl.load(V + base + key[:, None] * RS + offs_d[None, :], mask=sin[:, None], other=0.0)
    acc = tl.dot(p.to(V.dtype.element_ty), v, acc * alpha[:, None])
  _store_out(O, LSE, base, bh * LP, offs_m, rin, offs_d, RS, acc, m_i, l_i, DROP_T)


@triton.jit
def _bwd_keys_tile(start, Q, BITS, DO, LSE, DELTA, bbase, base, bh, LP, pid_n, offs_n, offs_d,
                   RS, k, v, dk, dv, qk_scale, L, W, k0, k1, DQ, VEC: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, SKIP: tl.constexpr,
                   DROP_T: tl.constexpr):
  """The key block's step over the query tile at ``start``: (dk, dv) updated (and dQ's
  atomics when DQ is not None)."""
  offs_m = start + tl.arange(0, BM)
  rin = offs_m < L
  words = _tile_words(BITS, bbase, offs_m, rin, pid_n * BN, W, VEC, BN)
  if _go(words, SKIP):
    keep = tl.trans(_unpack(words, BM, BN))                             # [BN, BM]
    qt = tl.load(Q + base + offs_m[None, :] * RS + offs_d[:, None], mask=rin[None, :],
                 other=0.0)
    do = tl.load(DO + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None],
                 other=0.0)
    lse = tl.load(LSE + bh * LP + offs_m, mask=rin, other=POS_INF)
    dlt = tl.load(DELTA + bh * LP + offs_m, mask=rin, other=0.0)
    s = tl.dot(k, qt)
    p = tl.where(keep, tl.math.exp2(s * qk_scale - lse[None, :]), 0.0)
    dp = tl.dot(v, tl.trans(do))
    if DROP_T > 0:
      live = dropout.key_draws(k0, k1, bh, offs_m, pid_n * BN, BN, True) >= DROP_T
      dv = tl.dot(tl.where(live, p, 0.0).to(DO.dtype.element_ty), do, dv)
      dp = tl.where(live, dp * dropout.kept_scale(DROP_T), 0.0)
    else:
      dv = tl.dot(p.to(DO.dtype.element_ty), do, dv)
    ds = (p * (dp - dlt[None, :])).to(Q.dtype.element_ty)
    dk = tl.dot(ds, tl.trans(qt), dk)
    if DQ is not None:
      dq = tl.dot(tl.trans(ds), k)
      tl.atomic_add(DQ + base + offs_m[:, None] * RS + offs_d[None, :], dq,
                    mask=rin[:, None], sem="relaxed")
  return dk, dv


@triton.jit
def _bwd_keys(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L, LP, H,
              G, W, NL, DK, DV, DQ, D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, SKIP: tl.constexpr, DROP_T: tl.constexpr,
              LISTS: tl.constexpr):
  """dV = P^T dO and dK = scale * dS^T Q for one block of BN keys, over the query blocks
  below ROWS (none when the block starts at or past the key extent EXT), with
  dS = P * (dP - delta), dP = dO V^T (transposed tiles: keys x queries).  With DQ (not None)
  also adds dQ / scale = dS K into the fp32 buffer DQ with atomics (one pass).  DROP_T > 0:
  the forward's survivors again (module docstring).  LISTS: only the query tiles of the key
  block's list (LIST [batch*heads, key blocks, NL], COUNT), those below ROWS."""
  pid_n, bh, b, base, bbase = _program(L, H, G, W, D)
  RS = H * D
  offs_n = pid_n * BN + tl.arange(0, BN)
  offs_d = tl.arange(0, D)
  kin = offs_n < L
  qk_scale = sm_scale * LOG2E
  k = tl.load(K + base + offs_n[:, None] * RS + offs_d[None, :], mask=kin[:, None], other=0.0)
  v = tl.load(V + base + offs_n[:, None] * RS + offs_d[None, :], mask=kin[:, None], other=0.0)
  dk = tl.zeros([BN, D], tl.float32)
  dv = tl.zeros([BN, D], tl.float32)
  k0 = 0
  k1 = 0
  if DROP_T > 0:
    k0, k1 = dropout.seed_key(SEED)
  rows = tl.where(pid_n * BN < tl.load(EXT + b), tl.load(ROWS + b), 0)
  if LISTS:
    lbase, n = _listed(LIST, COUNT, NL, pid_n, bh, tl.cdiv(L, BN), rows > 0)
    for i in range(0, n):
      start = tl.load(LIST + lbase + i) * BM
      if start < rows:
        dk, dv = _bwd_keys_tile(start, Q, BITS, DO, LSE, DELTA, bbase, base, bh, LP, pid_n,
                                offs_n, offs_d, RS, k, v, dk, dv, qk_scale, L, W, k0, k1, DQ,
                                VEC, BM, BN, SKIP, DROP_T)
  else:
    for start in range(0, rows, BM):
      dk, dv = _bwd_keys_tile(start, Q, BITS, DO, LSE, DELTA, bbase, base, bh, LP, pid_n,
                              offs_n, offs_d, RS, k, v, dk, dv, qk_scale, L, W, k0, k1, DQ,
                              VEC, BM, BN, SKIP, DROP_T)
  if DROP_T > 0:
    dv = dv * dropout.kept_scale(DROP_T)
  tl.store(DK + base + offs_n[:, None] * RS + offs_d[None, :],
           (dk * sm_scale).to(DK.dtype.element_ty), mask=kin[:, None])
  tl.store(DV + base + offs_n[:, None] * RS + offs_d[None, :], dv.to(DV.dtype.element_ty),
           mask=kin[:, None])


@triton.jit
def dsa_bwd_dkdv(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L, LP,
                 H, G, W, NL, DK, DV, D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, SKIP: tl.constexpr, DROP_T: tl.constexpr,
                 LISTS: tl.constexpr):
  """Deterministic backward, first kernel: dK and dV per key block (dsa_bwd_dq: dQ)."""
  _bwd_keys(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L, LP, H, G,
            W, NL, DK, DV, None, D, VEC, BM, BN, SKIP, DROP_T, LISTS)


@triton.jit
def dsa_bwd_onepass(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L,
                    LP, H, G, W, NL, DK, DV, DQ, D: tl.constexpr, VEC: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, SKIP: tl.constexpr,
                    DROP_T: tl.constexpr, LISTS: tl.constexpr):
  """One-pass backward: dK, dV as dsa_bwd_dkdv, and dQ / scale added into the zeroed fp32
  buffer DQ with atomics (each tile's products and exponentials once; dQ's summation order,
  hence its last bits, can vary run to run)."""
  _bwd_keys(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L, LP, H, G,
            W, NL, DK, DV, DQ, D, VEC, BM, BN, SKIP, DROP_T, LISTS)


@triton.jit
def _dq_tile(start, K, V, BITS, bbase, base, bh, offs_m, offs_d, rin, RS, q, do, lse, dlt, dq,
             qk_scale, L, W, k0, k1, VEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             SKIP: tl.constexpr, DROP_T: tl.constexpr):
  """The query block's step over the key tile at ``start``: dq updated."""
  words = _tile_words(BITS, bbase, offs_m, rin, start, W, VEC, BN)
  if _go(words, SKIP):
    keep = _unpack(words, BM, BN)
    offs_n, kin, kt = _keys_transposed(K, base, start, offs_d, RS, L, BN)
    vt = tl.load(V + base + offs_n[None, :] * RS + offs_d[:, None], mask=kin[None, :],
                 other=0.0)
    p = tl.where(keep, tl.math.exp2(tl.dot(q, kt) * qk_scale - lse[:, None]), 0.0)
    dp = tl.dot(do, vt)
    if DROP_T > 0:
      live = dropout.key_draws(k0, k1, bh, offs_m, start, BN, False) >= DROP_T
      dp = tl.where(live, dp * dropout.kept_scale(DROP_T), 0.0)
    ds = p * (dp - dlt[:, None])
    dq = tl.dot(ds.to(K.dtype.element_ty), tl.trans(kt), dq)
  return dq


@triton.jit
def dsa_bwd_dq(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L, LP, H,
               G, W, NL, DQ, D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, SKIP: tl.constexpr, DROP_T: tl.constexpr,
               LISTS: tl.constexpr):
  """dQ = scale * dS K for one block of BM query rows, over the key blocks below the key
  extent EXT (none when the block starts at or past ROWS: its dO is 0).  LISTS: the key tiles
  of the forward's list only."""
  pid_m, bh, b, base, bbase = _program(L, H, G, W, D)
  RS = H * D
  offs_m = pid_m * BM + tl.arange(0, BM)
  offs_d = tl.arange(0, D)
  rin = offs_m < L
  qk_scale = sm_scale * LOG2E
  q = tl.load(Q + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
  do = tl.load(DO + base + offs_m[:, None] * RS + offs_d[None, :], mask=rin[:, None], other=0.0)
  lse = tl.load(LSE + bh * LP + offs_m, mask=rin, other=POS_INF)
  dlt = tl.load(DELTA + bh * LP + offs_m, mask=rin, other=0.0)
  dq = tl.zeros([BM, D], tl.float32)
  k0 = 0
  k1 = 0
  if DROP_T > 0:
    k0, k1 = dropout.seed_key(SEED)
  ext = tl.where(pid_m * BM < tl.load(ROWS + b), tl.load(EXT + b), 0)
  if LISTS:
    lbase, n = _listed(LIST, COUNT, NL, pid_m, bh, tl.cdiv(L, BM), ext > 0)
    for i in range(0, n):
      start = tl.load(LIST + lbase + i) * BN
      dq = _dq_tile(start, K, V, BITS, bbase, base, bh, offs_m, offs_d, rin, RS, q, do, lse,
                    dlt, dq, qk_scale, L, W, k0, k1, VEC, BM, BN, SKIP, DROP_T)
  else:
    for start in range(0, ext, BN):
      dq = _dq_tile(start, K, V, BITS, bbase, base, bh, offs_m, offs_d, rin, RS, q, do, lse,
                    dlt, dq, qk_scale, L, W, k0, k1, VEC, BM, BN, SKIP, DROP_T)
  tl.store(DQ + base + offs_m[:, None] * RS + offs_d[None, :],
           (dq * sm_scale).to(DQ.dtype.element_ty), mask=rin[:, None])
