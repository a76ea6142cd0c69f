"""Compiles the OLD (generated) and NEW (source) DFSS Triton kernels to PTX for sm_90a and
compares them; writes one markdown table.  Needs triton (3.6) only: no GPU, no jax.

OLD is the f-string generator of ``lra_sparse/kernels/dfss/triton.py`` at ``--old_rev`` (its
``_gen_source`` and tile tables, read from git and run without jax; no poison parameters).  NEW
is the kernel source of this checkout (``kernels.dfss.triton_kernels``, ``kernels.dfss.compressed_kernels``).
Each case compiles both with the signature and specialisation jax-triton 0.3.1 gives the launch
(pointers 16-byte aligned, runtime ints unspecialised, H == 1 a constant) and the tiles the
runtime picks, with line info off (no .loc / debug sections), and compares the PTX text.
Cases whose PTX differs are also read back from the cubin: registers, stack, spill
instructions (STL/LDL) and the SASS instruction counts per opcode.

Cases (--tiers), each with the runtime's tiles for its kind / dtype / head_dim / M:
* 'grid': every kernel x dtype (float32, bfloat16, float16) x head_dim (16, 32, 64, 128) for
  1:2 and 2:4 (the paper's settings), and at head_dim 64 for 3:4 and 4:8; with and without the
  key mask at head_dim 64; SpMM with alpha 1 and 1/sqrt(head_dim).
* 'nm': the other N:M with M <= 8, N in (1, 2, 8, 15) for M = 16, N = 16 for M = 32 (and N = 1
  for the forward and one-pass backward), at bfloat16, head_dim 64, masked.  N enters the code
  only as NKEEP: the N == 1 branch, the M == 4 boolean branch, else a constant of the rank
  compare and of the compressed column count.  An M = 32 kernel takes ~50 s to compile.
* 'misc': the compressed softmax's block sizes per output dtype, and H == 1.
* 'poison': each NEW kernel against its test entry point in ``tests/poisoned_kernels.py`` (2:4).

The fused kernels gained attention dropout after this comparison was made: NEW compiles them
with DROP_T = 0 (no dropout) and their unused SEED parameter is dropped from the PTX before the
comparison (the parameter loads may still be numbered differently: see the cubin columns).

Usage, from the repository root:

  python -m benchmarks.compare_kernel_ptx [--old_rev=ce422c2] [--jobs=2]
      [--tiers=grid,nm,misc,poison] [--out=experiments/reports/dfss_triton/ptx_equivalence.md]
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import datetime
import importlib
import importlib.util
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from typing import Sequence

from absl import app, flags

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
HEAD_DIMS = (16, 32, 64, 128)
GRID_NM = ((1, 2), (2, 4), (3, 4), (4, 8))
GRID_ALL_HEAD_DIMS = ((1, 2), (2, 4))
M_KERNELS = ("dfss_fwd", "dfss_bwd_onepass", "dfss_bwd_dkdv", "dfss_bwd_dq", "dfss_sddmm_prune",
             "dfss_spmm", "dfss_spmm_t", "dfss_sddmm_bwd")
MASKED = ("dfss_fwd", "dfss_bwd_onepass", "dfss_bwd_dkdv", "dfss_bwd_dq", "dfss_sddmm_prune")
OUTPUTS = {"dfss_fwd": 2, "dfss_bwd_onepass": 3, "dfss_bwd_dkdv": 2, "dfss_bwd_dq": 1,
           "dfss_sddmm_prune": 2, "dfss_spmm": 1, "dfss_spmm_t": 1, "dfss_sddmm_bwd": 1,
           "dfss_csoftmax": 1}
TILE_KIND = {"dfss_fwd": "fwd", "dfss_bwd_onepass": "bwd", "dfss_bwd_dkdv": "bwd",
             "dfss_bwd_dq": "dq"}
OLD_NAMES = ("META_BITS", "_DEFAULT_CFG", "_M_CFG", "_GEN_OPTIONS", "_cfg", "_ind", "_rank_keep",
             "_key_idx", "_HEADER", "_gen_source")

# --------------------------------------------------------------------------- modules
_OLD: dict = {}  # generator namespace, and the compiled-module cache per (M, N)


def old_generator(rev: str) -> dict:
  """The OLD generator and tile tables, executed from ``git show rev:...`` without jax."""
  src = subprocess.check_output(["git", "show", f"{rev}:lra_sparse/kernels/dfss/triton.py"],
                                cwd=REPO, text=True)
  tree = ast.parse(src)
  keep = []
  for node in tree.body:
    names = ([node.name] if isinstance(node, ast.FunctionDef) else
             [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)])
    if any(n in OLD_NAMES for n in names):
      keep.append(node)
  ns = {"_dclass": lambda dt: "f32" if dt == "float32" else "half", "_CFG_OVERRIDE": {}}
  exec(compile(ast.Module(keep, []), f"{rev}:dfss_triton.py", "exec"), ns)  # noqa: S102
  assert ns["_GEN_OPTIONS"] == {"logic_rank": True, "fold_scale": True, "row_once": True}
  return ns


def old_module(m: int, n: int):
  key = (m, n)
  if key not in _OLD:
    path = os.path.join(_OLD["dir"], f"dfss_gen_{n}of{m}.py")
    if not os.path.exists(path):
      with open(path, "w") as f:
        f.write(_OLD["gen"]["_gen_source"](m, n, False))
    spec = importlib.util.spec_from_file_location(f"dfss_gen_{n}of{m}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _OLD[key] = mod
  return _OLD[key]


def new_module(name: str):
  """lra_sparse.kernels.<name> without running the package __init__ (which imports jax)."""
  for pkg in ("lra_sparse", "lra_sparse.kernels"):
    if pkg not in sys.modules:
      mod = types.ModuleType(pkg)
      mod.__path__ = [os.path.join(REPO, *pkg.split("."))]
      sys.modules[pkg] = mod
  return importlib.import_module(f"lra_sparse.kernels.{name}")


# --------------------------------------------------------------------------- cases
def signature(kernel: str, dt: str, old: bool):
  """Parameter name -> triton type, in the kernel's order (outputs last)."""
  p = "*" + DTYPES[dt]
  seed = [] if old else [("SEED", "*i32")]  # NEW: the dropout seed (unused at DROP_T=0)
  fused = [("Q", p), ("K", p), ("V", p), ("KM", "*i32")] + seed + [("DO", p), ("LSE", "*fp32"),
           ("DELTA", "*fp32"), ("sm_scale", "fp32"), ("L", "i32"), ("LP", "i32"), ("H", "i32")]
  ints = [("L", "i32"), ("LP", "i32"), ("KP", "i32"), ("H", "i32")]
  sig = {
      "dfss_fwd": [("Q", p), ("K", p), ("V", p), ("KM", "*i32")] + seed
                  + [("sm_scale", "fp32"), ("L", "i32"), ("LP", "i32"), ("H", "i32"), ("O", p),
                     ("LSE", "*fp32")],
      "dfss_bwd_onepass": fused + ([("DQ_ZERO", "*fp32")] if old else [])
                          + [("DK", p), ("DV", p), ("DQ", "*fp32")],
      "dfss_bwd_dkdv": fused + [("DK", p), ("DV", p)],
      "dfss_bwd_dq": fused + [("DQ", p)],
      "dfss_sddmm_prune": [("Q", p), ("K", p), ("KM", "*i32"), ("sm_scale", "fp32")] + ints
                          + [("SC", "*fp32"), ("META", "*i32")],
      "dfss_spmm": [("AC", p), ("META", "*i32"), ("X", p)] + ints + [("OUT", p)],
      "dfss_spmm_t": [("AC", p), ("META", "*i32"), ("X", p)] + ints + [("OUT", p)],
      "dfss_sddmm_bwd": [("AC", p), ("META", "*i32"), ("DO", p), ("V", p), ("DELTA", "*fp32")]
                        + ints + [("DS", p)],
      "dfss_csoftmax": [("SC", "*fp32"), ("CW", "i32"), ("A", p)],
  }[kernel]
  return dict(sig)


def poisoned_signature(kernel: str, dt: str):
  """The test entry point's parameters: a *_NAN buffer before the outputs for each output but
  the one-pass dQ (zeroed, not poisoned)."""
  sig = list(signature(kernel, dt, False).items())
  k = OUTPUTS[kernel]
  outs = sig[-k:]
  nans = [(name + "_NAN", ty) for name, ty in outs if not (kernel == "dfss_bwd_onepass"
                                                            and name == "DQ")]
  return dict(sig[:-k] + nans + outs)


def make_case(tier, kernel, m, n, dt, d, has_mask=True, h1=False, alpha=None, block=None):
  c = dict(tier=tier, kernel=kernel, m=m, n=n, dt=dt, d=d, has_mask=has_mask, h1=h1,
           alpha=alpha, block=block)
  if kernel == "dfss_csoftmax":
    c.update(bm=None, bn=None, num_warps=4 if block <= 1024 else 8, num_stages=1)
    return c
  tiles_mod = new_module("dfss_tiles")
  kind = TILE_KIND.get(kernel, "cmp")
  t = tiles_mod.tiles(kind, dt, d, m)
  o = _OLD["gen"]["_cfg"](kind, dt, d, m)
  assert (o["BM"], o["BN"], o["num_warps"], o["num_stages"], o.get("onepass", False)) == (
      t.bm, t.bn, t.num_warps, t.num_stages, t.onepass), (kind, dt, d, m, o, t)
  c.update(bm=t.bm, bn=t.bn, num_warps=t.num_warps, num_stages=t.num_stages)
  return c


def cases(tiers):
  out = []
  if "grid" in tiers:
    for n, m in GRID_NM:
      for dt in DTYPES:
        for d in HEAD_DIMS if (n, m) in GRID_ALL_HEAD_DIMS else (64,):
          for kernel in M_KERNELS:
            masks = (True, False) if kernel in MASKED and d == 64 else (True,)
            alphas = (1.0, 1.0 / math.sqrt(d)) if kernel.startswith("dfss_spmm") else (None,)
            for has_mask in masks:
              for alpha in alphas:
                out.append(make_case("grid", kernel, m, n, dt, d, has_mask, alpha=alpha))
  if "nm" in tiers:
    pairs = [(n, m) for m in (2, 4, 8) for n in range(1, m)]
    pairs += [(1, 16), (2, 16), (8, 16), (15, 16), (1, 32), (16, 32)]
    for n, m in pairs:
      if (n, m) in GRID_NM:
        continue
      for kernel in M_KERNELS:
        if (n, m) == (1, 32) and kernel not in ("dfss_fwd", "dfss_bwd_onepass"):
          continue
        alpha = 0.125 if kernel.startswith("dfss_spmm") else None
        out.append(make_case("nm", kernel, m, n, "bfloat16", 64, alpha=alpha))
  if "poison" in tiers:
    for kernel in M_KERNELS:
      alpha = 0.125 if kernel.startswith("dfss_spmm") else None
      out.append(make_case("poison", kernel, 4, 2, "bfloat16", 64, alpha=alpha))
    out.append(make_case("poison", "dfss_csoftmax", None, None, "bfloat16", None, block=1024))
  if "misc" in tiers:
    for dt in DTYPES:
      for block in (16, 128, 1024, 2048, 4096):
        out.append(make_case("misc", "dfss_csoftmax", None, None, dt, None, block=block))
    for n, m, dt in ((2, 4, "bfloat16"), (1, 2, "float32")):
      for kernel in ("dfss_fwd", "dfss_bwd_onepass", "dfss_bwd_dkdv", "dfss_bwd_dq"):
        out.append(make_case("misc", kernel, m, n, dt, 64, h1=True))
  return out


# --------------------------------------------------------------------------- compile
def compile_one(fn, sig, constexprs, num_warps, num_stages):
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


def strip_ptx(ptx: str) -> str:
  """PTX without debug info (none is emitted with line info off; kept as a safeguard)."""
  lines = [ln for ln in ptx.splitlines()
           if not ln.strip().startswith((".loc", ".file")) and not re.match(r"\$L__tmp\d+:$",
                                                                            ln.strip())]
  return re.sub(r"\t\.section\t\.debug_\w+\n\t\{.*?\n\t\}", "", "\n".join(lines), flags=re.S)


def drop_param(ptx: str, kernel: str, index: int) -> str:
  """PTX with parameter ``index`` (unused) removed and the later ones renumbered."""
  out = []
  for ln in ptx.splitlines():
    if re.search(rf"\.param .*\b{kernel}_param_{index}\b", ln):
      continue
    out.append(re.sub(rf"\b{kernel}_param_(\d+)\b",
                      lambda mt: f"{kernel}_param_{int(mt.group(1)) - (int(mt.group(1)) > index)}",
                      ln))
  return "\n".join(out)


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


def run_case(c: dict) -> dict:
  kernel = c["kernel"]
  constexprs = {}
  if kernel == "dfss_csoftmax":
    constexprs["BLOCK"] = c["block"]
    old_fn = getattr(old_module(2, 1), kernel)
  else:
    old_fn = getattr(old_module(c["m"], c["n"]), kernel)
    if c["alpha"] is not None:
      constexprs["ALPHA"] = c["alpha"]
    constexprs.update(D=c["d"], NKEEP=c["n"], BM=c["bm"], BN=c["bn"])
    if kernel in MASKED:
      constexprs["HAS_MASK"] = c["has_mask"]
  if c["h1"]:
    constexprs["H"] = 1  # jax-triton 0.3.1 turns an int argument equal to 1 into a constant
  mod = "dfss_fused_kernels" if kernel in TILE_KIND else "dfss_compressed_kernels"
  new_fn = getattr(new_module(mod), kernel)
  new_constexprs = dict(constexprs)
  if kernel != "dfss_csoftmax":
    new_constexprs["M"] = c["m"]
  if kernel in TILE_KIND:
    new_constexprs["DROP_T"] = 0  # no attention dropout: the code OLD had
  old_sig = signature(kernel, c["dt"], True)
  new_sig = signature(kernel, c["dt"], False)
  if c["tier"] == "poison":  # NEW kernel (as "OLD") against its poisoned test entry point
    old_fn, old_sig, constexprs = new_fn, new_sig, new_constexprs
    new_fn = getattr(new_module("dfss_poisoned_kernels"), kernel + "_poisoned")
    new_sig = poisoned_signature(kernel, c["dt"])
  res = dict(c)
  t0 = time.time()
  ko = compile_one(old_fn, old_sig, constexprs, c["num_warps"], c["num_stages"])
  t1 = time.time()
  kn = compile_one(new_fn, new_sig, new_constexprs, c["num_warps"], c["num_stages"])
  res["seconds"] = (t1 - t0, time.time() - t1)
  old_ptx, new_ptx = strip_ptx(ko.asm["ptx"]), strip_ptx(kn.asm["ptx"])
  if kernel in TILE_KIND and c["tier"] != "poison":
    new_ptx = drop_param(new_ptx, kernel, [q for q in new_sig if q not in new_constexprs]
                         .index("SEED"))
  res["ptx_lines"] = len(new_ptx.splitlines())
  if old_ptx == new_ptx:
    res["status"] = "identical"
  elif c["tier"] == "poison":
    nan_params = [i for i, p in enumerate(q for q in new_sig if q not in new_constexprs)
                  if p.endswith("_NAN")]
    poisoned = new_ptx.replace(f"{kernel}_poisoned", kernel)
    for i in reversed(nan_params):
      poisoned = drop_param(poisoned, kernel, i)
    uncomment = lambda t: re.sub(r"[ \t]*//.*", "", t)  # noqa: E731  name-aligned comments
    poisoned, kernel_ptx = uncomment(poisoned), uncomment(old_ptx)
    if poisoned == kernel_ptx:
      res["status"] = "identical but *_NAN"
    elif sorted(poisoned.splitlines()) == sorted(kernel_ptx.splitlines()):
      res["status"] = "same lines reordered but *_NAN"
    else:
      res["status"] = "DIFFERENT"
  elif kernel == "dfss_bwd_onepass" and drop_param(
      old_ptx, kernel, [p for p in old_sig if p not in constexprs].index("DQ_ZERO")) == new_ptx:
    res["status"] = "identical but DQ_ZERO"
  elif sorted(old_ptx.splitlines()) == sorted(new_ptx.splitlines()):
    res["status"] = "same lines reordered"
  else:
    res["status"] = "DIFFERENT"
  if res["status"] != "identical":
    so, sn = cubin_stats(ko.asm["cubin"]), cubin_stats(kn.asm["cubin"])
    res["old_cubin"], res["new_cubin"] = so, sn
    res["same_cubin_stats"] = all(so[k] == sn[k] for k in ("regs", "stack", "stl", "ldl", "ops"))
    if res["status"] == "DIFFERENT" and c["tier"] == "poison" and res["same_cubin_stats"]:
      res["status"] = "PTX differs, same cubin stats, but *_NAN"
  return res


def _init_worker(gen_dir, rev):
  os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
  _OLD.update(dir=gen_dir, gen=old_generator(rev))


# --------------------------------------------------------------------------- table
def describe(r):
  if r["kernel"] == "dfss_csoftmax":
    return f"BLOCK={r['block']} w{r['num_warps']}"
  s = f"{r['bm']}x{r['bn']} w{r['num_warps']} s{r['num_stages']}"
  if r["kernel"] in MASKED:
    s += " mask" if r["has_mask"] else " no mask"
  if r["alpha"] is not None:
    s += f" alpha={r['alpha']:.4g}"
  if r["h1"]:
    s += " H=1"
  return s


def cubin_note(r):
  if "old_cubin" not in r:
    return ""
  o, n = r["old_cubin"], r["new_cubin"]
  txt = (f"regs {o['regs']}/{n['regs']}, stack {o['stack']}/{n['stack']}, "
         f"STL {o['stl']}/{n['stl']}, LDL {o['ldl']}/{n['ldl']}, SASS {o['n_sass']}/{n['n_sass']}")
  if not r["same_cubin_stats"]:
    diff = {k: (o["ops"].get(k, 0), n["ops"].get(k, 0)) for k in set(o["ops"]) | set(n["ops"])
            if o["ops"].get(k, 0) != n["ops"].get(k, 0)}
    txt += f"; opcode counts differ: {diff}"
  else:
    txt += "; same opcode counts"
  return txt


def table(results, header):
  lines = [header, ""]
  counts = collections.Counter(r["status"] for r in results)
  lines.append("Summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
               + f" of {len(results)} cases.")
  by_kernel = collections.defaultdict(collections.Counter)
  for r in results:
    by_kernel[r["kernel"]][r["status"]] += 1
  lines += ["", "OLD vs NEW, per kernel:", "",
            "| kernel | cases | identical | identical but DQ_ZERO | DIFFERENT |",
            "|---|---|---|---|---|"]
  for k, cnt in sorted(by_kernel.items()):
    n_poison = sum(v for key, v in cnt.items() if key.endswith("*_NAN"))
    lines.append(f"| {k} | {sum(cnt.values()) - n_poison} | "
                 f"{cnt['identical']} | {cnt['identical but DQ_ZERO']} | {cnt['DIFFERENT']} |")
  lines += ["", "'identical but DQ_ZERO': the PTX is identical once OLD's unused DQ_ZERO parameter "
            "(the zero buffer jax-triton aliased to dQ; NEW zeroes dQ with zeroed_outputs) is "
            "dropped and the later parameters renumbered; the cubin columns give "
            "OLD/NEW registers, stack bytes, spill stores / loads and SASS instructions.  "
            "Tier 'poison' compares NEW kernels with their poisoned test entry points "
            "(dfss_poisoned_kernels): 'identical but *_NAN' = identical once the unused NaN "
            "buffer parameters are dropped and the kernel name is the same; 'same lines "
            "reordered' = the same PTX lines in another order.", "",
            "| tier | kernel | N:M | dtype | head_dim | tiles | PTX lines | status | "
            "cubin (OLD/NEW) | compile s (OLD/NEW) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    nm = f"{r['n']}:{r['m']}" if r["m"] else "-"
    lines.append(f"| {r['tier']} | {r['kernel']} | {nm} | {r['dt']} | {r['d'] or '-'} | "
                 f"{describe(r)} | {r['ptx_lines']} | {r['status']} | {cubin_note(r)} | "
                 f"{r['seconds'][0]:.1f}/{r['seconds'][1]:.1f} |")
  return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main
def define_flags() -> None:
  flags.DEFINE_string("old_rev", "ce422c2", "Git revision of the generated kernels (OLD).")
  flags.DEFINE_list("tiers", ["grid", "nm", "misc", "poison"],
                  "Case tiers: grid, nm, misc, poison.")
  flags.DEFINE_integer("jobs", 2, "Compile processes.")
  flags.DEFINE_string("kernels", "", "Comma-separated subset of kernels (default: all).")
  flags.DEFINE_string("out", None, "Write the markdown table here.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import triton  # pylint: disable=import-outside-toplevel

  os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
  gen_dir = tempfile.mkdtemp(prefix="dfss_old_")
  _init_worker(gen_dir, FLAGS.old_rev)
  todo = cases(FLAGS.tiers)
  if FLAGS.kernels:
    todo = [c for c in todo if c["kernel"] in FLAGS.kernels.split(",")]
  print(f"{len(todo)} cases, {FLAGS.jobs} processes", flush=True)
  results = []
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(FLAGS.jobs, mp_context=ctx, initializer=_init_worker,
                                              initargs=(gen_dir, FLAGS.old_rev)) as pool:
    # the largest M first, so that the slowest compiles do not trail
    order = sorted(range(len(todo)), key=lambda i: -(todo[i]["m"] or 0))
    for i, r in zip(order, pool.map(run_case, [todo[i] for i in order])):
      results.append(dict(r, index=i))
      print(f"[{len(results)}/{len(todo)}] {r['kernel']} {r['n']}:{r['m']} {r['dt']} d{r['d']} "
            f"{describe(r)}: {r['status']} {cubin_note(r)}", flush=True)
  results.sort(key=lambda r: r["index"])
  rev = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                text=True).strip()
  now = datetime.datetime.now(datetime.timezone.utc)
  header = (f"# DFSS kernels: OLD (generated, {FLAGS.old_rev}) vs NEW (source, {rev}) PTX\n\n"
            f"triton {triton.__version__}, target cuda sm_90a (GPUTarget('cuda', 90, 32)), "
            f"compiled on the CPU, line info off; {now:%Y-%m-%d %H:%M} UTC.  Command: "
            f"`python -m benchmarks.compare_kernel_ptx --tiers={','.join(FLAGS.tiers)}`.")
  text = table(results, header)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(text)
  bad = [r for r in results if r["status"] == "DIFFERENT"]
  print(f"{len(results) - len(bad)}/{len(results)} not DIFFERENT")
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  define_flags()
  app.run(main)
