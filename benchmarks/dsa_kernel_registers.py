"""Registers, stack and spills of the DSA attention kernels for sm_90a, compiled on the CPU
(triton only: no GPU, no jax-triton); prints one markdown table.

Each row compiles one kernel with the signature jax-triton gives its launch (pointers 16-byte
aligned, runtime ints unspecialised) and reads ptxas's resource usage and the SASS back from
the cubin (``compare_kernel_ptx``): a tile that spills (STL / LDL in the loop) is a candidate
to drop before any device time is spent.

  python -m benchmarks.dsa_kernel_registers [--kernels=dsa_fwd,dsa_bwd_onepass] \
      [--dtype=bf16] [--head_dim=64] [--vector=8] [--dropout=0,0.1] \
      [--tiles=128:64:4:3,64:64:4:3]   # BM:BN:WARPS:STAGES; default: dsa_triton's own tiles
"""

from __future__ import annotations

from typing import Sequence

from absl import app, flags

from benchmarks.compare_kernel_ptx import compile_one, cubin_stats
from lra_sparse.ops import dropout as dfss_dropout
from lra_sparse.kernels.dsa import triton as dsa_triton

FLAGS = flags.FLAGS
flags.DEFINE_list("kernels", ["dsa_fwd", "dsa_fwd_gather", "dsa_bwd_onepass", "dsa_bwd_dkdv",
                               "dsa_bwd_dq"],
                  "Kernels of lra_sparse/kernels/dsa/attention_kernels.py.")
flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp16", "fp32"], "Operand dtype.")
flags.DEFINE_integer("head_dim", 64, "Head dimension (16, 32, 64 or 128).")
flags.DEFINE_integer("vector", 8, "Column-vector size (1, 4, 8).")
flags.DEFINE_list("dropout", ["0", "0.1"], "Attention dropout rates.")
flags.DEFINE_list("tiles", [], "BM:BN:WARPS:STAGES per row; empty: the runtime's tiles.")

_TILE_KIND = {"dsa_fwd": "fwd", "dsa_fwd_gather": "gather", "dsa_bwd_onepass": "onepass",
              "dsa_bwd_dkdv": "dkdv", "dsa_bwd_dq": "dq"}


def signature(kernel: str, dtype: str) -> dict:
  """The kernel's runtime parameters and their Triton types, in order."""
  p = "*" + dtype
  if kernel == "dsa_fwd":
    names = "Q K V BITS EXT SEED sm_scale L LP H G W O LSE".split()
    types = [p, p, p, "*i32", "*i32", "*i32", "fp32"] + ["i32"] * 5 + [p, "*fp32"]
  elif kernel == "dsa_fwd_gather":
    names = "Q K V SLOTS COUNT SEED sm_scale L LP H T O LSE".split()
    types = [p, p, p, "*i32", "*i32", "*i32", "fp32"] + ["i32"] * 4 + [p, "*fp32"]
  else:
    names = "Q K V BITS DO LSE DELTA EXT ROWS SEED sm_scale L LP H G W".split()
    types = [p, p, p, "*i32", p, "*fp32", "*fp32", "*i32", "*i32", "*i32", "fp32"] + ["i32"] * 5
    outs = {"dsa_bwd_onepass": (["DK", "DV", "DQ"], [p, p, "*fp32"]),
            "dsa_bwd_dkdv": (["DK", "DV"], [p, p]), "dsa_bwd_dq": (["DQ"], [p])}[kernel]
    names, types = names + outs[0], types + outs[1]
  return dict(zip(names, types))


def runtime_tile(kernel: str, dtype: str, rate: float) -> tuple:
  """(BM, BN, warps, stages) that ``kernels.dsa.triton`` launches ``kernel`` with."""
  kind = _TILE_KIND[kernel] + ("_drop" if rate and kernel == "dsa_fwd" else "")
  operands = "f32" if dtype == "fp32" else "half"
  return dsa_triton._TILES[(kind, operands)][:4]  # pylint: disable=protected-access


def kernel_stats(kernel: str, dtype: str, head_dim: int, vector: int, rate: float,
                 tile=None) -> dict:
  """ptxas's registers, stack and spill instructions (``compare_kernel_ptx.cubin_stats``) of one
  kernel at ``tile`` (BM, BN, warps, stages; default the runtime's)."""
  from lra_sparse.kernels.dsa import attention_kernels as dsa_attention_kernels  # pylint: disable=import-outside-toplevel
  bm, bn, warps, stages = tile or runtime_tile(kernel, dtype, rate)
  constexprs = dict(D=head_dim, VEC=vector, BM=bm, BN=bn, DROP_T=dfss_dropout.threshold(rate))
  if kernel != "dsa_fwd_gather":
    constexprs["SKIP"] = False
  compiled = compile_one(getattr(dsa_attention_kernels, kernel), signature(kernel, dtype),
                         constexprs, warps, stages)
  return cubin_stats(compiled.asm["cubin"])


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  lines = ["| kernel | dropout | BMxBN warps stages | registers | stack bytes | STL / LDL | "
           "SASS instructions |", "|---|---|---|---|---|---|---|"]
  for kernel in FLAGS.kernels:
    for rate in (float(r) for r in FLAGS.dropout):
      tiles = ([tuple(int(x) for x in t.split(":")) for t in FLAGS.tiles]
               or [runtime_tile(kernel, FLAGS.dtype, rate)])
      for bm, bn, warps, stages in tiles:
        st = kernel_stats(kernel, FLAGS.dtype, FLAGS.head_dim, FLAGS.vector, rate,
                          (bm, bn, warps, stages))
        lines.append(f"| {kernel} | {rate:g} | {bm}x{bn} w{warps} s{stages} | {st['regs']} | "
                     f"{st['stack']} | {st['stl']} / {st['ldl']} | {st['n_sass']} |")
        print(lines[-1], flush=True)
  print("\n" + "\n".join(lines))


if __name__ == "__main__":
  app.run(main)
