"""Registers, stack and spills of the DSA attention kernels for sm_90a, compiled on the CPU
(triton only: no GPU, no jax-triton); prints one markdown table.

Each row compiles one kernel with the signature jax-triton gives its launch (pointers 16-byte
aligned, runtime ints unspecialised) and reads ptxas's resource usage and the SASS back from
the cubin (``cubin_stats``, with triton's cuobjdump): a tile that spills (STL / LDL in the loop)
is a candidate to drop before any device time is spent.  ``tests/test_dsa_kernels.py`` runs it
to check that the runtime's tiles spill nothing.

  python -m benchmarks.dsa_kernel_registers [--kernels=dsa_fwd,dsa_bwd_onepass] \
      [--dtype=bf16] [--head_dim=64] [--vector=8] [--dropout=0,0.1] \
      [--tiles=128:64:4:3,64:64:4:3]   # BM:BN:WARPS:STAGES; default: kernels.dsa.tiles' table
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Sequence

from absl import app, flags

from benchmarks import harness
from lra_sparse.ops import dropout as dfss_dropout
from lra_sparse.kernels.dsa import tiles as dsa_tiles

FLAGS = flags.FLAGS
flags.DEFINE_list("kernels", ["dsa_fwd", "dsa_fwd_gather", "dsa_bwd_onepass", "dsa_bwd_dkdv",
                               "dsa_bwd_dq"],
                  "Kernels of lra_sparse/kernels/dsa/attention_kernels.py.")
flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp16", "fp32"], "Operand dtype.")
flags.DEFINE_integer("head_dim", 64, "Head dimension (16, 32, 64 or 128).")
flags.DEFINE_integer("vector", 8, "Column-vector size (1, 4, 8).")
flags.DEFINE_list("dropout", ["0", "0.1"], "Attention dropout rates.")
flags.DEFINE_list("tiles", [], "BM:BN:WARPS:STAGES per row; empty: the runtime's tiles.")
flags.DEFINE_bool("block_rule", False, "The block rule's kernels: tile lists and the empty-tile "
                  "skip on, at the tiles of 64-key blocks (tiles.block_overrides).")

_TILE_KIND = {"dsa_fwd": "fwd", "dsa_fwd_gather": "gather", "dsa_bwd_onepass": "onepass",
              "dsa_bwd_dkdv": "dkdv", "dsa_bwd_dq": "dq"}


def compile_one(fn, sig: dict, constexprs: dict, num_warps: int, num_stages: int):
  """triton.compile of the @triton.jit ``fn`` for sm_90a (on any machine): ``sig`` maps each
  runtime parameter to its Triton type (pointers taken as 16-byte aligned, as jax-triton
  launches them), ``constexprs`` the compile-time ones."""
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.compiler import ASTSource  # pylint: disable=import-outside-toplevel

  sig = dict(sig)
  for name in constexprs:
    sig[name] = "constexpr"
  attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values())
           if ty.startswith("*")}
  src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
  return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=num_warps, num_stages=num_stages))


def cubin_stats(cubin: bytes) -> dict:
  """Registers, stack, spill instructions and SASS opcode counts of one cubin."""
  import triton  # pylint: disable=import-outside-toplevel
  tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    res = subprocess.check_output([tool, "-res-usage", f.name], text=True)
    sass = subprocess.check_output([tool, "-sass", f.name], text=True)
  reg = re.search(r"REG:(\d+)", res)
  stack = re.search(r"STACK:(\d+)", res)
  ops = collections.Counter()
  for ln in sass.splitlines():
    mt = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
    if mt:
      ops[mt.group(1)] += 1
  return dict(regs=int(reg.group(1)) if reg else None, stack=int(stack.group(1)) if stack else None,
              stl=ops.get("STL", 0), ldl=ops.get("LDL", 0), n_sass=sum(ops.values()), ops=ops)


def signature(kernel: str, dtype: str) -> dict:
  """The kernel's runtime parameters and their Triton types, in order."""
  p = "*" + dtype
  if kernel == "dsa_fwd":
    names = "Q K V BITS EXT SEED LIST COUNT sm_scale L LP H G W NL O LSE".split()
    types = [p, p, p] + ["*i32"] * 5 + ["fp32"] + ["i32"] * 6 + [p, "*fp32"]
  elif kernel == "dsa_fwd_gather":
    names = "Q K V SLOTS COUNT SEED sm_scale L LP H T O LSE".split()
    types = [p, p, p, "*i32", "*i32", "*i32", "fp32"] + ["i32"] * 4 + [p, "*fp32"]
  else:
    names = "Q K V BITS DO LSE DELTA EXT ROWS SEED LIST COUNT sm_scale L LP H G W NL".split()
    types = ([p, p, p, "*i32", p, "*fp32", "*fp32"] + ["*i32"] * 5 + ["fp32"]
             + ["i32"] * 6)
    outs = {"dsa_bwd_onepass": (["DK", "DV", "DQ"], [p, p, "*fp32"]),
            "dsa_bwd_dkdv": (["DK", "DV"], [p, p]), "dsa_bwd_dq": (["DQ"], [p])}[kernel]
    names, types = names + outs[0], types + outs[1]
  return dict(zip(names, types))


def runtime_tile(kernel: str, dtype: str, rate: float, block_rule: bool = False) -> tuple:
  """(BM, BN, warps, stages) that ``kernels.dsa.triton`` launches ``kernel`` with (the block
  rule's, at 64-key blocks, with ``block_rule``)."""
  kind = _TILE_KIND[kernel] + ("_drop" if rate and kernel == "dsa_fwd" else "")
  dtype_name = "float32" if dtype == "fp32" else "bfloat16"
  overrides = dsa_tiles.block_overrides(64, dtype_name) if block_rule else ()
  tiles = dsa_tiles.tiles(kind, dtype_name, overrides)
  return tiles.bm, tiles.bn, tiles.num_warps, tiles.num_stages


def kernel_stats(kernel: str, dtype: str, head_dim: int, vector: int, rate: float,
                 tile=None, block_rule: bool = False) -> dict:
  """ptxas's registers, stack and spill instructions (``cubin_stats``) of one kernel at
  ``tile`` (BM, BN, warps, stages; default the runtime's); ``block_rule``: with tile lists
  and the empty-tile skip."""
  from lra_sparse.kernels.dsa import attention_kernels as dsa_attention_kernels
  bm, bn, warps, stages = tile or runtime_tile(kernel, dtype, rate, block_rule)
  constexprs = dict(D=head_dim, VEC=vector, BM=bm, BN=bn, DROP_T=dfss_dropout.threshold(rate))
  if kernel != "dsa_fwd_gather":
    constexprs["SKIP"] = block_rule
    constexprs["LISTS"] = block_rule
  compiled = compile_one(getattr(dsa_attention_kernels, kernel), signature(kernel, dtype),
                         constexprs, warps, stages)
  return cubin_stats(compiled.asm["cubin"])


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  rows = []
  for kernel in FLAGS.kernels:
    for rate in (float(r) for r in FLAGS.dropout):
      block_rule = FLAGS.block_rule and kernel != "dsa_fwd_gather"
      tiles = ([tuple(int(x) for x in t.split(":")) for t in FLAGS.tiles]
               or [runtime_tile(kernel, FLAGS.dtype, rate, block_rule)])
      for bm, bn, warps, stages in tiles:
        st = kernel_stats(kernel, FLAGS.dtype, FLAGS.head_dim, FLAGS.vector, rate,
                          (bm, bn, warps, stages), block_rule)
        rows.append((kernel, f"{rate:g}", f"{bm}x{bn} w{warps} s{stages}", st["regs"],
                     st["stack"], f"{st['stl']} / {st['ldl']}", st["n_sass"]))
        print(harness.markdown_row(rows[-1]), flush=True)
  print("\n" + harness.markdown_table(["kernel", "dropout", "BMxBN warps stages", "registers",
                                       "stack bytes", "STL / LDL", "SASS instructions"], rows))


if __name__ == "__main__":
  app.run(main)
