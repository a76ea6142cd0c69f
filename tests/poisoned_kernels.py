"""Test entry points of the DFSS and DSA Triton kernels: every output pre-filled with NaN
(int32: -1).

``lra_sparse.kernels.shared.launch.launch(..., poison=True)`` fills a copy of each output with NaN
and aliases it to
that output, so an element the kernel does not write stays NaN.  jax-triton 0.3.1 passes an
aliased input and its output as two parameters (the same memory), so each entry point below
takes the filled buffers (``*_NAN``, not read) before the outputs and runs the kernel on the
outputs.  Atomic accumulators (the one-pass dQ) are zeroed instead and take no filled buffer.

Importing this module registers every entry point with ``launch.register_poisoned`` (the GPU
tests import it; it imports triton).
"""

import triton
import triton.language as tl

from lra_sparse.kernels.dfss import compressed_kernels as ck
from lra_sparse.kernels.dfss import triton_kernels as fk
from lra_sparse.kernels.dsa import attention_kernels as ak
from lra_sparse.kernels.dsa import select_kernels as sk
from lra_sparse.kernels.shared import launch


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



@triton.jit
def dsa_select_poisoned(Q8, K8, KM, EXT, NEED, FACTOR, threshold, L, G, W, H, BITS_NAN, BITS,
                        KP: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
                        TOPK: tl.constexpr, HAS_MASK: tl.constexpr):
  sk.dsa_select(Q8, K8, KM, EXT, NEED, FACTOR, threshold, L, G, W, H, BITS, KP, R, BN, TOPK,
                HAS_MASK)


@triton.jit
def dsa_fwd_poisoned(Q, K, V, BITS, EXT, SEED, LIST, COUNT, sm_scale, L, LP, H, G, W, NL, O_NAN,
                     LSE_NAN, O, LSE, D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, SKIP: tl.constexpr, DROP_T: tl.constexpr,
                     LISTS: tl.constexpr):
  ak.dsa_fwd(Q, K, V, BITS, EXT, SEED, LIST, COUNT, sm_scale, L, LP, H, G, W, NL, O, LSE, D,
             VEC, BM, BN, SKIP, DROP_T, LISTS)


@triton.jit
def dsa_bwd_dkdv_poisoned(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale,
                          L, LP, H, G, W, NL, DK_NAN, DV_NAN, DK, DV, D: tl.constexpr,
                          VEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          SKIP: tl.constexpr, DROP_T: tl.constexpr, LISTS: tl.constexpr):
  ak.dsa_bwd_dkdv(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L, LP,
                  H, G, W, NL, DK, DV, D, VEC, BM, BN, SKIP, DROP_T, LISTS)


@triton.jit
def dsa_bwd_dq_poisoned(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale,
                        L, LP, H, G, W, NL, DQ_NAN, DQ, D: tl.constexpr, VEC: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, SKIP: tl.constexpr,
                        DROP_T: tl.constexpr, LISTS: tl.constexpr):
  ak.dsa_bwd_dq(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L, LP, H,
                G, W, NL, DQ, D, VEC, BM, BN, SKIP, DROP_T, LISTS)


@triton.jit
def dsa_bwd_onepass_poisoned(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT,
                             sm_scale, L, LP, H, G, W, NL, DK_NAN, DV_NAN, DK, DV, DQ,
                             D: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, SKIP: tl.constexpr, DROP_T: tl.constexpr,
                             LISTS: tl.constexpr):
  ak.dsa_bwd_onepass(Q, K, V, BITS, DO, LSE, DELTA, EXT, ROWS, SEED, LIST, COUNT, sm_scale, L,
                     LP, H, G, W, NL, DK, DV, DQ, D, VEC, BM, BN, SKIP, DROP_T, LISTS)


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


# kernel -> its poisoned entry point
launch.register_poisoned(fk.dfss_fwd, dfss_fwd_poisoned)
launch.register_poisoned(fk.dfss_bwd_dkdv, dfss_bwd_dkdv_poisoned)
launch.register_poisoned(fk.dfss_bwd_onepass, dfss_bwd_onepass_poisoned)
launch.register_poisoned(fk.dfss_bwd_dq, dfss_bwd_dq_poisoned)
launch.register_poisoned(ck.dfss_sddmm_prune, dfss_sddmm_prune_poisoned)
launch.register_poisoned(ck.dfss_csoftmax, dfss_csoftmax_poisoned)
launch.register_poisoned(ck.dfss_spmm, dfss_spmm_poisoned)
launch.register_poisoned(ck.dfss_spmm_t, dfss_spmm_t_poisoned)
launch.register_poisoned(ck.dfss_sddmm_bwd, dfss_sddmm_bwd_poisoned)
launch.register_poisoned(sk.dsa_select, dsa_select_poisoned)
launch.register_poisoned(ak.dsa_fwd, dsa_fwd_poisoned)
launch.register_poisoned(ak.dsa_bwd_dkdv, dsa_bwd_dkdv_poisoned)
launch.register_poisoned(ak.dsa_bwd_dq, dsa_bwd_dq_poisoned)
launch.register_poisoned(ak.dsa_bwd_onepass, dsa_bwd_onepass_poisoned)
launch.register_poisoned(sk.dsa_compact, dsa_compact_poisoned)
launch.register_poisoned(ak.dsa_fwd_gather, dsa_fwd_gather_poisoned)
