"""DSA selection kernel (Triton source): the predictor's integer scores s = q8 k8^T, each row's
kept keys, written as one bit per (row group, key).  The rule is ``kernels.dsa.reference``'s.

Layout: Q8 int8 [batch*heads, G, KP] (G row groups), K8 int8 [batch*heads, L, KP], KM the
key-padding mask int32 [batch, L], EXT int32 [batch] (one past each example's last real key;
L without a mask), NEED int32 [batch] (keys each row keeps), FACTOR fp32 [batch*heads, G]
(threshold selection).  BITS int32 [batch*heads, G, W], W = ceil(L / 32): bit j % 32 of word
j // 32 says whether the row group keeps key j.

Every pass reads the key tiles below EXT only: the keys past it are padded, never valid, so
the row's lo / hi, counts and bits are those of all L keys; the bits of the tiles past EXT are
stored as zero words.  Row groups that start at or past EXT are trailing padding and keep
nothing (``kernels.dsa.reference.reference_select``): a program whose groups all are runs no pass.

s is recomputed on the int8 tensor cores in every pass instead of being stored: nothing of
size L x L is ever written but the bits.  top-k runs four passes over the row's keys:

  1. lo, hi: the row's smallest and largest s over its real keys -> shift, so that the code
     (s - lo) >> shift fits 8 bits;
  2. counts of the code's high nibble >= d (d = 1..15) -> the threshold's high nibble;
  3. counts of the low nibble >= d among codes with that high nibble -> the threshold code t
     and the number of ties to keep (lowest key index first);
  4. the bits: code > t, or code == t and fewer than ``ties`` equal codes before this key.

``dsa_compact`` turns the bits into one key list per block of query rows (the union of the
block's row groups' kept keys, each with the groups that keep it), which the gathered forward
(``kernels.dsa.attention_kernels.dsa_fwd_gather``) reads instead of every key tile.

This module imports triton: the launchers in ``kernels.dsa.triton`` import it on first use.
"""

import triton
import triton.language as tl

SENTINEL = tl.constexpr(2 ** 30)
LEVELS = tl.constexpr(256)


@triton.jit
def _row_scores(q8, K8, kbase, KM, b, start, L, KP: tl.constexpr, BN: tl.constexpr,
                HAS_MASK: tl.constexpr):
  """(s int32 [R, BN], valid bool [BN]) for the keys start .. start + BN."""
  offs_n = start + tl.arange(0, BN)
  valid = offs_n < L
  offs_k = tl.arange(0, KP)
  kt = tl.load(K8 + kbase + offs_n[None, :] * KP + offs_k[:, None], mask=valid[None, :],
               other=0)
  s = tl.dot(q8, kt, out_dtype=tl.int32)
  if HAS_MASK:
    valid = valid & (tl.load(KM + b * L + offs_n, mask=valid, other=0) != 0)
  return s, valid


@triton.jit
def _codes(s, valid, lo, shift):
  """The 8-bit code (s - lo) >> shift of each entry, -1 at invalid keys."""
  return tl.where(valid[None, :], (s - lo[:, None]) >> shift[:, None], -1)


@triton.jit
def _count_at_least(counts, x):
  """counts[d - 1] + (number of x >= d in each row), for d = 1..15 (a tuple of [R]); x int32
  [R, BN] in -1..15 (-1: not counted), BN <= 255.

  A histogram by byte lanes instead of 15 compares per entry: each entry adds 1 << 8 * (x % 8)
  to one of two int64 words (bins 0-7, 8-15), one row sum per word and tile, then each row's
  16 bytes are the bin counts (at most BN < 256 per tile: no carry between bytes)."""
  shift = (8 * (x & 7)).to(tl.int64)
  one = tl.full([], 1, tl.int64)
  low = tl.sum(tl.where((x >= 0) & (x < 8), one << shift, 0), 1)
  high = tl.sum(tl.where(x >= 8, one << shift, 0), 1)
  above = tl.zeros_like(counts[0])
  out = ()
  for d in tl.static_range(15, 0, -1):  # suffix sums of the bins, d = 15 .. 1
    if d >= 8:
      above += ((high >> (8 * (d - 8))) & 255).to(tl.int32)
    else:
      above += ((low >> (8 * d)) & 255).to(tl.int32)
    out = (counts[d - 1] + above,) + out
  return out


@triton.jit
def _digit(counts, base, need):
  """The largest d in 0..15 with base + counts[d - 1] >= need (d = 0 always qualifies), and
  base + counts[d] (the entries above digit d; base alone when d = 15)."""
  digit = tl.zeros_like(need)
  for d in tl.static_range(1, 16):
    digit += ((base + counts[d - 1]) >= need).to(tl.int32)
  above = base
  for d in tl.static_range(1, 16):
    above += tl.where(digit + 1 == d, counts[d - 1], 0)
  return digit, above


@triton.jit
def _store_bits(BITS, bh, G, W, offs_r, rin, start, keep, R: tl.constexpr, BN: tl.constexpr):
  """Packs keep [R, BN] into BN / 32 words per row and stores them."""
  kb = tl.reshape(keep.to(tl.int32), [R, BN // 32, 32])
  words = tl.sum(kb << tl.arange(0, 32)[None, None, :], 2)
  offs_w = start // 32 + tl.arange(0, BN // 32)
  ptrs = BITS + (bh * G + offs_r[:, None]).to(tl.int64) * W + offs_w[None, :]
  tl.store(ptrs, words, mask=rin[:, None] & (offs_w[None, :] < W))


@triton.jit
def _store_zeros(BITS, bh, G, W, offs_r, rin, ext, L, R: tl.constexpr, BN: tl.constexpr):
  """Zero words for the key tiles past the example's extent (no key there is valid)."""
  none = tl.zeros([R, BN], tl.int1)
  for start in range(tl.cdiv(ext, BN) * BN, L, BN):
    _store_bits(BITS, bh, G, W, offs_r, rin, start, none, R, BN)


@triton.jit
def dsa_select(Q8, K8, KM, EXT, NEED, FACTOR, threshold, L, G, W, H, BITS, KP: tl.constexpr,
               R: tl.constexpr, BN: tl.constexpr, TOPK: tl.constexpr,
               HAS_MASK: tl.constexpr):
  """One program per R row groups of one (example, head); grid (cdiv(G, R), batch*heads).
  The key loops stop at the example's extent EXT (past it every key is padded).  A group that
  starts at or past EXT (trailing padding) keeps nothing, and a program whose groups all do
  runs no key loop: it stores zero words."""
  pid = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // H
  ext = tl.load(EXT + b)
  offs_r = pid * R + tl.arange(0, R)
  rin = offs_r < G
  live = (offs_r * (L // G) < ext)[:, None]
  ext = tl.where(pid * R * (L // G) < ext, ext, 0)
  offs_k = tl.arange(0, KP)
  q8 = tl.load(Q8 + (bh * G + offs_r[:, None]).to(tl.int64) * KP + offs_k[None, :],
               mask=rin[:, None], other=0)
  kbase = bh.to(tl.int64) * L * KP
  if TOPK:
    need = tl.zeros([R], tl.int32) + tl.load(NEED + b)
    lo = tl.full([R], SENTINEL, tl.int32)
    hi = tl.full([R], -SENTINEL, tl.int32)
    for start in range(0, ext, BN):
      s, valid = _row_scores(q8, K8, kbase, KM, b, start, L, KP, BN, HAS_MASK)
      lo = tl.minimum(lo, tl.min(tl.where(valid[None, :], s, SENTINEL), 1))
      hi = tl.maximum(hi, tl.max(tl.where(valid[None, :], s, -SENTINEL), 1))
    span = hi - lo
    shift = tl.zeros([R], tl.int32)
    for t in tl.static_range(32):
      shift += ((span >> t) >= LEVELS).to(tl.int32)
    counts = ()
    for d in tl.static_range(15):
      counts = counts + (tl.zeros([R], tl.int32),)
    for start in range(0, ext, BN):
      s, valid = _row_scores(q8, K8, kbase, KM, b, start, L, KP, BN, HAS_MASK)
      counts = _count_at_least(counts, _codes(s, valid, lo, shift) >> 4)
    high, above = _digit(counts, tl.zeros([R], tl.int32), need)
    counts = ()
    for d in tl.static_range(15):
      counts = counts + (tl.zeros([R], tl.int32),)
    for start in range(0, ext, BN):
      s, valid = _row_scores(q8, K8, kbase, KM, b, start, L, KP, BN, HAS_MASK)
      code = _codes(s, valid, lo, shift)
      low = tl.where((code >> 4) == high[:, None], code & 15, -1)
      counts = _count_at_least(counts, low)
    low, greater = _digit(counts, above, need)
    t = high * 16 + low
    ties = need - greater
    seen = tl.zeros([R], tl.int32)
    for start in range(0, ext, BN):
      s, valid = _row_scores(q8, K8, kbase, KM, b, start, L, KP, BN, HAS_MASK)
      code = _codes(s, valid, lo, shift)
      eq = (code == t[:, None]).to(tl.int32)
      rank = seen[:, None] + tl.cumsum(eq, 1) - eq
      keep = live & ((code > t[:, None]) | ((eq != 0) & (rank < ties[:, None])))
      seen += tl.sum(eq, 1)
      _store_bits(BITS, bh, G, W, offs_r, rin, start, keep, R, BN)
    _store_zeros(BITS, bh, G, W, offs_r, rin, ext, L, R, BN)
  else:
    factor = tl.load(FACTOR + bh * G + offs_r, mask=rin, other=0.0)
    for start in range(0, ext, BN):
      s, valid = _row_scores(q8, K8, kbase, KM, b, start, L, KP, BN, HAS_MASK)
      keep = live & valid[None, :] & (s.to(tl.float32) * factor[:, None] >= threshold)
      _store_bits(BITS, bh, G, W, offs_r, rin, start, keep, R, BN)
    _store_zeros(BITS, bh, G, W, offs_r, rin, ext, L, R, BN)


@triton.jit
def dsa_compact(BITS, EXT, L, G, W, H, T, SLOTS, COUNT, VEC: tl.constexpr, BM: tl.constexpr,
                CW: tl.constexpr):
  """The kept keys of each block of BM query rows as one list (for ``dsa_fwd_gather``): one
  program per block of one (example, head); grid (T, batch*heads), T = cdiv(L, BM).

  The block's BM // VEC row groups (at most 16) keep the union of their keys.  Each key of
  that union, in increasing order, is one int32 slot: key << 16 | (bit i set when the block's
  group i keeps the key), stored at SLOTS[bh, block, 0 .. COUNT[bh, block]); the rest of the
  row is not written.  CW bit words (32 * CW keys) per step, up to the example's extent EXT."""
  pid = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // H
  GT: tl.constexpr = BM // VEC
  offs_g = pid * GT + tl.arange(0, GT)
  gin = offs_g < G
  ext = tl.load(EXT + b)
  ext = tl.where(pid * BM < ext, ext, 0)   # a block past EXT: its groups keep nothing
  sbase = (bh * T + pid).to(tl.int64) * L
  wbase = bh.to(tl.int64) * G * W
  n = tl.zeros([], tl.int32)
  for start in range(0, ext, 32 * CW):
    offs_w = start // 32 + tl.arange(0, CW)
    words = tl.load(BITS + wbase + offs_g[:, None] * W + offs_w[None, :],
                    mask=gin[:, None] & (offs_w[None, :] < W), other=0)          # [GT, CW]
    bits = tl.reshape((words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1,
                      [GT, CW * 32])
    groups = tl.sum(bits << tl.arange(0, GT)[:, None], 0)                      # [CW * 32]
    hit = (groups != 0).to(tl.int32)
    keys = start + tl.arange(0, CW * 32)
    pos = n + tl.cumsum(hit, 0) - hit
    tl.store(SLOTS + sbase + pos, (keys << 16) | groups, mask=hit != 0)
    n += tl.sum(hit, 0)
  tl.store(COUNT + bh * T + pid, n)
