"""Test entry points of the DFSS kernels: every output pre-filled with NaN (int32: -1).

``dfss_launch.launch(..., poison=True)`` fills a copy of each output with NaN and aliases it to
that output, so an element the kernel does not write stays NaN.  jax-triton 0.3.1 passes an
aliased input and its output as two parameters (the same memory), so each entry point below
takes the filled buffers (``*_NAN``, not read) before the outputs and runs the kernel on the
outputs.  Atomic accumulators (the one-pass dQ) are zeroed instead and take no filled buffer.

This module imports triton: only the poisoned launch path (GPU tests) imports it.
"""

import triton
import triton.language as tl

from lra_sparse.kernels import dfss_compressed_kernels as ck
from lra_sparse.kernels import dfss_fused_kernels as fk


@triton.jit
def dfss_fwd_poisoned(Q, K, V, KM, SEED, sm_scale, L, LP, H, O_NAN, LSE_NAN, O, LSE,
                      D: tl.constexpr, M: tl.constexpr, NKEEP: tl.constexpr,
                      HAS_MASK: tl.constexpr, DROP_T: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr):
  fk.dfss_fwd(Q, K, V, KM, SEED, sm_scale, L, LP, H, O, LSE, D, M, NKEEP, HAS_MASK, DROP_T, BM,
              BN)


@triton.jit
def dfss_bwd_dkdv_poisoned(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK_NAN,
                           DV_NAN, DK, DV, D: tl.constexpr, M: tl.constexpr,
                           NKEEP: tl.constexpr, HAS_MASK: tl.constexpr, DROP_T: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr):
  fk.dfss_bwd_dkdv(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK, DV, D, M, NKEEP,
                   HAS_MASK, DROP_T, BM, BN)


@triton.jit
def dfss_bwd_onepass_poisoned(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK_NAN,
                              DV_NAN, DK, DV, DQ, D: tl.constexpr, M: tl.constexpr,
                              NKEEP: tl.constexpr, HAS_MASK: tl.constexpr,
                              DROP_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
  fk.dfss_bwd_onepass(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DK, DV, DQ, D, M,
                      NKEEP, HAS_MASK, DROP_T, BM, BN)


@triton.jit
def dfss_bwd_dq_poisoned(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DQ_NAN, DQ,
                         D: tl.constexpr, M: tl.constexpr, NKEEP: tl.constexpr,
                         HAS_MASK: tl.constexpr, DROP_T: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr):
  fk.dfss_bwd_dq(Q, K, V, KM, SEED, DO, LSE, DELTA, sm_scale, L, LP, H, DQ, D, M, NKEEP,
                 HAS_MASK, DROP_T, BM, BN)


@triton.jit
def dfss_sddmm_prune_poisoned(Q, K, KM, sm_scale, L, LP, KP, H, SC_NAN, META_NAN, SC, META,
                              D: tl.constexpr, M: tl.constexpr, NKEEP: tl.constexpr,
                              HAS_MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
  ck.dfss_sddmm_prune(Q, K, KM, sm_scale, L, LP, KP, H, SC, META, D, M, NKEEP, HAS_MASK, BM, BN)


@triton.jit
def dfss_csoftmax_poisoned(SC, CW, A_NAN, A, BLOCK: tl.constexpr):
  ck.dfss_csoftmax(SC, CW, A, BLOCK)


@triton.jit
def dfss_spmm_poisoned(AC, META, X, L, LP, KP, H, OUT_NAN, OUT, ALPHA: tl.constexpr,
                       D: tl.constexpr, M: tl.constexpr, NKEEP: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr):
  ck.dfss_spmm(AC, META, X, L, LP, KP, H, OUT, ALPHA, D, M, NKEEP, BM, BN)


@triton.jit
def dfss_spmm_t_poisoned(AC, META, X, L, LP, KP, H, OUT_NAN, OUT, ALPHA: tl.constexpr,
                         D: tl.constexpr, M: tl.constexpr, NKEEP: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr):
  ck.dfss_spmm_t(AC, META, X, L, LP, KP, H, OUT, ALPHA, D, M, NKEEP, BM, BN)


@triton.jit
def dfss_sddmm_bwd_poisoned(AC, META, DO, V, DELTA, L, LP, KP, H, DS_NAN, DS, D: tl.constexpr,
                            M: tl.constexpr, NKEEP: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr):
  ck.dfss_sddmm_bwd(AC, META, DO, V, DELTA, L, LP, KP, H, DS, D, M, NKEEP, BM, BN)
