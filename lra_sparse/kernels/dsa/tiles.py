"""Tile choices of the DSA Triton kernels (plain Python: no jax, no triton).

Kernels: "select" (the selection, int8 operands), "fwd" / "fwd_drop" (the tile forward without
/ with attention dropout), "gather" (the gathered forward), "onepass" (the backward with dQ by
atomics), "dkdv" and "dq" (the deterministic pair). Operand classes: "int8", "half" (bfloat16,
float16), "f32".

Chosen on an H100 (bf16, 16x2048, 4 heads of 64; the DSA kernel report): testing each tile for
emptiness (``skip``) cost 7% at DSA-90 (random kept sets leave no tile empty), so it is off by
default; 8 warps, 64x128 or 128x128 tiles were no faster. "fwd_drop": the forward with attention
dropout, whose 128x64 tile spills (ptxas for sm_90a: 255 registers, 40 bytes of stack); 64x64
does not (230 registers) and was 6-8% faster at 16x2048 and 8x4096 than 128x64 with 4 or 8
warps (the DSA dropout report).
"""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One launch configuration: ``bm`` query rows (the selection: row groups) x ``bn`` keys per
  tile (a multiple of 32), warps, pipeline stages; ``skip``: test each tile's keep bits and
  skip the empty ones (attention kernels)."""
  bm: int
  bn: int
  num_warps: int
  num_stages: int
  skip: bool = False


DEFAULT = {
    ("select", "int8"): Tiles(64, 64, 4, 2),
    ("fwd", "half"): Tiles(128, 64, 4, 3),
    ("fwd", "f32"): Tiles(64, 64, 4, 2),
    ("fwd_drop", "half"): Tiles(64, 64, 4, 3),
    ("fwd_drop", "f32"): Tiles(64, 64, 4, 2),
    ("gather", "half"): Tiles(64, 64, 4, 3),
    ("gather", "f32"): Tiles(64, 32, 4, 2),   # 64x64 spills at head_dim 128 (ptxas)
    ("dkdv", "half"): Tiles(64, 64, 4, 2),
    ("dkdv", "f32"): Tiles(32, 64, 4, 2),
    ("onepass", "half"): Tiles(64, 64, 4, 2),
    ("onepass", "f32"): Tiles(32, 64, 4, 2),
    ("dq", "half"): Tiles(64, 64, 4, 2),
    ("dq", "f32"): Tiles(32, 64, 4, 2),
}
KERNELS = tuple(sorted({kernel for kernel, _ in DEFAULT}))

# Overrides of one call: a tuple of (kernel, Tiles) pairs (hashable, so a static argument of
# the jitted wrappers); a kernel not named keeps its default.
Overrides = tuple


def operand_class(dtype_name: str) -> str:
  """'f32' for float32, 'half' for bfloat16 / float16, 'int8' for int8."""
  return {"float32": "f32", "int8": "int8"}.get(dtype_name, "half")


def tiles(kernel: str, dtype_name: str, overrides: Overrides = ()) -> Tiles:
  """The tiles of ``kernel`` for operands of ``dtype_name``: the override of that kernel when
  ``overrides`` names it, else the default."""
  for name, choice in overrides:
    if name == kernel:
      return choice
  return DEFAULT[(kernel, operand_class(dtype_name))]


# The attention kernels (everything but the selection and the gathered forward).
ATTENTION_KERNELS = ("fwd", "fwd_drop", "onepass", "dkdv", "dq")


# The block rule's row cap per kernel: its kernels loop over tile lists, and the one-pass
# backward with attention dropout then spilled at 64x64 (ptxas for sm_90a: 255 registers, 72
# stack bytes, 26 STL / 18 LDL, with or without the skip test; 8 warps or 1 stage did not
# help); at 32x64 it holds 198 registers, no spill (benchmarks/dsa_kernel_registers
# --block_rule).
BLOCK_RULE_MAX_BM = {"onepass": 32}


def block_overrides(block_size: int, dtype_name: str) -> Overrides:
  """Tiles for the block rule (``attention.dsa.granularity="block"``): each attention kernel's
  default with its rows and keys cut to fit one block (BM <= block_size, and the caps of
  ``BLOCK_RULE_MAX_BM``; BN <= max(32, block_size)) and ``skip`` on, so a tile lies inside
  one (query block, key block) pair and is either wholly kept or skipped: the work falls with
  the kept blocks (the kernels visit only the tiles of their lists, ``reference.tile_lists``,
  when given the kept blocks)."""
  out = []
  for kernel in ATTENTION_KERNELS:
    t = tiles(kernel, dtype_name)
    bm = min(t.bm, block_size, BLOCK_RULE_MAX_BM.get(kernel, t.bm))
    out.append((kernel, Tiles(bm, min(t.bn, max(32, block_size)), t.num_warps, t.num_stages,
                              True)))
  return tuple(out)


def parse_overrides(entries) -> Overrides:
  """``("fwd:128:64:8:3:0", ...)`` (KERNEL:BM:BN:WARPS:STAGES[:SKIP]) -> Overrides, with one
  error naming a bad entry (benchmark and tuning flags)."""
  out = []
  for entry in entries:
    kernel, *nums = entry.split(":")
    if kernel not in KERNELS or len(nums) not in (4, 5) or not all(x.isdigit() for x in nums):
      raise ValueError(f"DSA tiles {entry!r}: expected KERNEL:BM:BN:WARPS:STAGES[:SKIP] with "
                       f"KERNEL in {KERNELS}")
    bm, bn, warps, stages = (int(x) for x in nums[:4])
    if bn % 32:
      raise ValueError(f"DSA tiles {entry!r}: BN must be a multiple of 32")
    out.append((kernel, Tiles(bm, bn, warps, stages, len(nums) == 5 and nums[4] == "1")))
  return tuple(out)


def check_overrides(overrides: Optional[Overrides]) -> Overrides:
  """``overrides`` as a tuple of (kernel, Tiles); one error naming what is wrong."""
  overrides = tuple(overrides or ())
  for item in overrides:
    if (not isinstance(item, tuple) or len(item) != 2 or item[0] not in KERNELS
        or not isinstance(item[1], Tiles)):
      raise ValueError(f"DSA tile override {item!r}: expected (kernel, Tiles) with kernel in "
                       f"{KERNELS}")
  return overrides
