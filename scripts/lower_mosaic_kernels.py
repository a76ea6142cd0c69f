"""Lowers the Mosaic GPU attention kernels for CUDA on any machine, a CPU included: the free
pre-flight of a kernel change before device time.

Pallas builds a Mosaic GPU kernel's MLIR while JAX lowers the call, and that is where most
kernel errors surface (a wgmma's shapes, swizzles and layouts; shared memory over the 227 KiB
of a Hopper SM; a primitive with no lowering). This lowers the forward and the backward
(``jax.grad`` of the output's sum) of ``dfss_attention_mgpu`` and ``dense_attention_mgpu``
for each case of the grid below with ``lowering_platforms=("cuda",)``, and prints one line per
case: ok, or the error's first line. It does not compile to PTX (that needs the CUDA plugin)
nor check numbers: the GPU tests do.

It needs the device's JAX (0.11.2; 0.10.2 has no lowering for some primitives the kernels
use), which needs Python 3.12: the venv of ``make venv`` has it wherever Python 3.12 runs.

  .venv/bin/python -m scripts.lower_mosaic_kernels [--kinds=dense,2:4,1:2,2:8] \\
      [--head_dims=8,16,32,64,128] [--dropout=0,0.1] [--masks=none,holes] \\
      [--tiles=min_head_dim=64]

``tests/test_lower_mosaic_kernels.py`` lowers 24 of these cases in the CPU suite.

Exit status 1 when a case fails.
"""
from __future__ import annotations

import itertools
import os
import re
import sys
import traceback

from absl import app, flags

KINDS = flags.DEFINE_list("kinds", ["dense", "2:4", "1:2", "2:8"],
                          "'dense' or DFSS N:M entries.")
HEAD_DIMS = flags.DEFINE_list("head_dims", ["8", "16", "32", "64", "128"], "Head dims.")
DROPOUT = flags.DEFINE_list("dropout", ["0", "0.1"], "Attention dropout rates.")
MASKS = flags.DEFINE_list("masks", ["none", "holes"],
                          "Key masks: none, or holes (and a fully padded example).")
TILES = flags.DEFINE_string("tiles", "", "Tiles fields 'name=value,...' for every case.")
SHAPE = (2, 256, 2)   # batch, length, heads: small; the kernels' code does not depend on them


def cases(kinds, head_dims, rates, masks):
  """The grid's cases: (kind, head_dim, rate, mask) with kind 'dense' or (n, m)."""
  from lra_sparse.ops.nm import parse_nm  # pylint: disable=import-outside-toplevel
  parsed = [k if k == "dense" else parse_nm(k, what="--kinds") for k in kinds]
  for mask in masks:
    if mask not in ("none", "holes"):
      raise ValueError(f"--masks: {mask!r} is not none or holes")
  return list(itertools.product(parsed, [int(d) for d in head_dims],
                                [float(r) for r in rates], masks))


def lowered_for_cuda(loss, q) -> str:
  """The program of ``jax.grad(loss)`` (forward and backward, all three operands shaped and
  typed like ``q``, a ``jax.ShapeDtypeStruct``) lowered for CUDA, as text."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
      lowering_platforms=("cuda",)).as_text()


def kernel_launches(text: str) -> int:
  """Mosaic GPU kernels a lowered program launches (its ``mosaic_gpu`` custom calls)."""
  return len(re.findall(r"custom_call @mosaic_gpu", text))


def lower_case(case, tiles) -> str:
  """'ok', or the first line of the error lowering this case's forward and backward."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from lra_sparse.kernels.dfss import mosaic  # pylint: disable=import-outside-toplevel
  kind, head_dim, rate, mask_kind = case
  b, l, h = SHAPE
  q = jax.ShapeDtypeStruct((b, l, h, head_dim), jnp.bfloat16)
  mask = None
  if mask_kind == "holes":
    mask = (jnp.arange(l)[None, :] % 3 != 1) & (jnp.arange(b)[:, None] < b - 1)
  seed = jnp.zeros((2,), jnp.int32) if rate else None
  opts = dict(mask=mask, tiles=tiles, dropout_rate=rate, dropout_seed=seed)

  def loss(q, k, v):
    if kind == "dense":
      out = mosaic.dense_attention_mgpu(q, k, v, **opts)
    else:
      out = mosaic.dfss_attention_mgpu(q, k, v, n=kind[0], m=kind[1], **opts)
    return out.astype(jnp.float32).sum()

  try:
    lowered_for_cuda(loss, q)
  except Exception as error:  # pylint: disable=broad-except  (one line per failing case)
    lines = str(error).strip().splitlines()
    if lines:
      return f"FAILED: {type(error).__name__}: {lines[0][:200]}"
    frame = traceback.extract_tb(error.__traceback__)[-1]   # e.g. a bare assert
    return (f"FAILED: {type(error).__name__} at {os.path.basename(frame.filename)}:"
            f"{frame.lineno} ({frame.line})")
  return "ok"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import jax  # pylint: disable=import-outside-toplevel
  from lra_sparse.kernels.dfss import mosaic  # pylint: disable=import-outside-toplevel
  tiles = mosaic.parse_tiles(TILES.value, "--tiles")
  grid = cases(KINDS.value, HEAD_DIMS.value, DROPOUT.value, MASKS.value)
  print(f"jax {jax.__version__}; lowering for cuda; {tiles}", flush=True)
  failed = 0
  for case in grid:
    kind, head_dim, rate, mask_kind = case
    name = "dense" if kind == "dense" else f"{kind[0]}:{kind[1]}"
    result = lower_case(case, tiles)
    failed += result != "ok"
    print(f"{name:>5} head_dim {head_dim:>3} dropout {rate:g} mask {mask_kind:>5}: {result}",
          flush=True)
  print(f"{len(grid) - failed} of {len(grid)} cases lowered")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  app.run(main)
