"""Test entry points of the DSA kernels: every output pre-filled with NaN (int32: -1).

As ``dfss_poisoned_kernels``: ``dfss_launch.launch(..., poison=True)`` aliases a filled copy of
each output to it (jax-triton passes both, the same memory), so each entry point takes the
filled buffers (``*_NAN``, not read) before the outputs, and an element the kernel does not
write shows up in the result.

This module imports triton: only the poisoned launch path (GPU tests) imports it.
"""

import triton
import triton.language as tl

from lra_sparse.kernels import dsa_attention_kernels as ak
from lra_sparse.kernels import dsa_select_kernels as sk


@triton.jit
def dsa_select_poisoned(Q8, K8, KM, EXT, NEED, FACTOR, threshold, L, G, W, H, BITS_NAN, BITS,
                        KP: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
                        TOPK: tl.constexpr, HAS_MASK: tl.constexpr):
  sk.dsa_select(Q8, K8, KM, EXT, NEED, FACTOR, threshold, L, G, W, H, BITS, KP, R, BN, TOPK,
                HAS_MASK)


@triton.jit
def dsa_fwd_poisoned(Q, K, V, BITS, EXT, SEED, sm_scale, L, LP, H, G, W, O_NAN, LSE_NAN, O,
                     LSE, D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, SKIP: tl.constexpr, DROP_T: tl.constexpr):
  ak.dsa_fwd(Q, K, V, BITS, EXT, SEED, sm_scale, L, LP, H, G, W, O, LSE, D, VEC, BM, BN, SKIP,
             DROP_T)


@triton.jit
def dsa_bwd_dkdv_poisoned(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, sm_scale, L, LP, H,
                          G, W, DK_NAN, DV_NAN, DK, DV, D: tl.constexpr, VEC: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, SKIP: tl.constexpr,
                          DROP_T: tl.constexpr):
  ak.dsa_bwd_dkdv(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, sm_scale, L, LP, H, G, W, DK,
                  DV, D, VEC, BM, BN, SKIP, DROP_T)


@triton.jit
def dsa_bwd_dq_poisoned(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, sm_scale, L, LP, H, G,
                        W, DQ_NAN, DQ, D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, SKIP: tl.constexpr, DROP_T: tl.constexpr):
  ak.dsa_bwd_dq(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, sm_scale, L, LP, H, G, W, DQ, D,
                VEC, BM, BN, SKIP, DROP_T)


@triton.jit
def dsa_bwd_onepass_poisoned(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, sm_scale, L, LP,
                             H, G, W, DK_NAN, DV_NAN, DK, DV, DQ, D: tl.constexpr,
                             VEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             SKIP: tl.constexpr, DROP_T: tl.constexpr):
  ak.dsa_bwd_onepass(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, sm_scale, L, LP, H, G, W,
                     DK, DV, DQ, D, VEC, BM, BN, SKIP, DROP_T)


@triton.jit
def dsa_compact_poisoned(BITS, EXT, L, G, W, H, T, SLOTS_NAN, COUNT_NAN, SLOTS, COUNT,
                         VEC: tl.constexpr, BM: tl.constexpr, CW: tl.constexpr):
  sk.dsa_compact(BITS, EXT, L, G, W, H, T, SLOTS, COUNT, VEC, BM, CW)


@triton.jit
def dsa_fwd_gather_poisoned(Q, K, V, SLOTS, COUNT, SEED, sm_scale, L, LP, H, T, O_NAN, LSE_NAN,
                            O, LSE, D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, DROP_T: tl.constexpr):
  ak.dsa_fwd_gather(Q, K, V, SLOTS, COUNT, SEED, sm_scale, L, LP, H, T, O, LSE, D, VEC, BM, BN,
                    DROP_T)
