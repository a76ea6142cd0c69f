"""Benchmark DFSS attention kernels against dense attention on one GPU; prints ONE markdown table.

Rows: XLA dense (jax.nn.dot_product_attention implementation="xla"), cuDNN dense
(implementation="cudnn", bf16 only), DFSS pure-JAX reference, DFSS Triton fused (flash-style,
the default; one-pass backward with dQ by atomics), the same with deterministic=True (separate
dK/dV and dQ backward kernels) and DFSS Triton compressed (SDDMM+prune / softmax / SpMM).
Forward and forward+backward (jax.grad of <out, cotangent> w.r.t. q, k, v), median of many
timed runs after warm-up (each sample = a burst of back-to-back calls / burst size, inputs
rotated among 3 random sets, block_until_ready at the end of the burst).

Memory: "A bytes" is what the method holds for the attention matrix between forward and
backward (dense: L^2 probabilities in the input dtype, plus the fp32 logits XLA materialises;
compressed: L^2*N/M values + 1 bit per key of metadata; fused: one fp32 log-sum-exp per row),
reported with its ratio to dense; "temp MiB" is XLA's compiled temp-buffer size of the
fwd+bwd program (memory_analysis), which bounds the peak of the whole step.

Usage: python benchmarks/bench_dfss_kernels.py [--out FILE] [--dtypes bf16,fp32]
       [--shapes 32x1024,16x2048,8x4096] [--skip-reference] [--log FILE]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels import dfss_reference, dfss_triton  # noqa: E402

DTYPES = {"bf16": (jnp.bfloat16, 2, 4), "fp32": (jnp.float32, 1, 2)}  # paper defaults


def _block(x):
    jax.tree_util.tree_map(lambda a: a.block_until_ready(), x)


def time_fn(fn, input_sets, target_s=0.4, min_samples=7, max_samples=41):
    """Median ms per call; bursts of back-to-back calls, inputs rotated."""
    for args in input_sets:  # warm-up (compile) on every input set
        _block(fn(*args))
    t0 = time.perf_counter()
    _block(fn(*input_sets[0]))
    est = max(time.perf_counter() - t0, 1e-5)
    burst = int(min(max(1, 0.02 / est), 50))
    n_samples = int(min(max(min_samples, target_s / (est * burst)), max_samples))
    samples = []
    for s in range(n_samples):
        t0 = time.perf_counter()
        out = None
        for j in range(burst):
            out = fn(*input_sets[(s * burst + j) % len(input_sets)])
        _block(out)
        samples.append((time.perf_counter() - t0) / burst * 1e3)
    return statistics.median(samples), samples


def gpu_state():
    """SM clock / max clock / power limit / temperature from nvidia-smi: compute-bound kernels
    (the fused DFSS ones) move with the SM clock, which differs between lent machines."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        return f"nvidia-smi sm clock, max sm clock, power, power limit, temp: {out}"
    except Exception as e:  # noqa: BLE001  no nvidia-smi (or no GPU): say so, do not fail
        return f"nvidia-smi unavailable ({type(e).__name__})"


def temp_mib(fn, *args):
    try:
        ma = jax.jit(fn).lower(*args).compile().memory_analysis()
        return ma.temp_size_in_bytes / 2**20
    except Exception:  # pragma: no cover
        return float("nan")


def make_methods(dtype, n, m, with_triton):
    meths = {}
    meths["XLA dense"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")
    if dtype != jnp.float32:
        meths["cuDNN dense"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    meths["DFSS pure-JAX"] = lambda q, k, v: dfss_reference.dfss_attention_reference(q, k, v, n=n, m=m)
    if with_triton:
        meths["DFSS Triton fused"] = lambda q, k, v: dfss_triton.dfss_attention_triton(q, k, v, n=n, m=m)
        meths["DFSS Triton fused, deterministic bwd"] = lambda q, k, v: dfss_triton.dfss_attention_triton(
            q, k, v, n=n, m=m, deterministic=True)
        meths["DFSS Triton compressed"] = lambda q, k, v: dfss_triton.dfss_attention_triton(
            q, k, v, n=n, m=m, impl="compressed")
    return meths


def fwd_bwd(f):
    def g(q, k, v, ct):
        return jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * ct).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    return g


def a_bytes(name, b, h, l, dtype, n, m):
    isz = jnp.dtype(dtype).itemsize
    bh = b * h
    dense = bh * l * l * isz
    if name.endswith("dense") or name == "DFSS pure-JAX":
        return dense, dense
    if name == "DFSS Triton compressed":
        return bh * l * l * n // m * isz + bh * l * l // 8, dense
    return bh * l * 4, dense  # fused: log-sum-exp per row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--shapes", default="32x1024,16x2048,8x4096", help="BATCHxLENGTH list")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--log", default=None)
    args = p.parse_args(argv)

    logf = open(args.log, "a") if args.log else None

    def log(msg):
        print(msg, flush=True)
        if logf:
            logf.write(msg + "\n")
            logf.flush()

    dev = jax.devices()[0]
    with_triton = dfss_triton.is_available()
    try:
        import triton
        tver = triton.__version__
    except Exception:
        tver = "n/a"
    try:
        import jax_triton
        jtver = getattr(jax_triton, "__version__", "?")
    except Exception:
        jtver = "n/a"
    header = (f"device: {getattr(dev, 'device_kind', dev.platform)} ({dev.platform}); jax {jax.__version__}; "
              f"triton {tver}; jax-triton {jtver}; date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
              f"heads {args.heads}, head_dim {args.dim}; times = median ms after warm-up")
    log(header)
    log("start: " + gpu_state())
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    h, d = args.heads, args.dim
    for dname in args.dtypes.split(","):
        dtype, n, m = DTYPES[dname]
        for b, l in shapes:
            key = jax.random.PRNGKey(l + b)
            sets = []
            for i in range(3):
                ks = jax.random.split(jax.random.fold_in(key, i), 4)
                sets.append(tuple(jax.random.normal(kk, (b, l, h, d), dtype) for kk in ks))
            fsets = [s[:3] for s in sets]
            res = {}
            for name, f in make_methods(dtype, n, m, with_triton).items():
                if name == "DFSS pure-JAX" and args.skip_reference:
                    continue
                r = {}
                try:
                    r["fwd"], _ = time_fn(jax.jit(f), fsets)
                except Exception as e:
                    log(f"{dname} {b}x{l} {name} fwd failed: {type(e).__name__}: {str(e)[-800:]}")
                    r["fwd"] = float("nan")
                try:
                    g = jax.jit(fwd_bwd(f))
                    r["fb"], _ = time_fn(g, sets)
                    r["temp"] = temp_mib(fwd_bwd(f), *sets[0])
                except Exception as e:
                    log(f"{dname} {b}x{l} {name} fwd+bwd failed: {type(e).__name__}: {str(e)[-800:]}")
                    r["fb"] = float("nan")
                    r["temp"] = float("nan")
                r["abytes"], r["dense"] = a_bytes(name, b, h, l, dtype, n, m)
                res[name] = r
                log(f"{dname} {n}:{m} B={b} L={l} {name}: fwd {r['fwd']:.3f} ms, fwd+bwd {r['fb']:.3f} ms, "
                    f"temp {r['temp']:.0f} MiB")
            x = res["XLA dense"]
            c = res.get("cuDNN dense")
            for name, r in res.items():
                def ratio(base, key):
                    if base is None or not np.isfinite(base[key]) or not np.isfinite(r[key]):
                        return "-"
                    return f"{base[key] / r[key]:.2f}x"
                rows.append([dname, f"{n}:{m}", str(b), str(l), name,
                             f"{r['fwd']:.3f}", ratio(x, "fwd"), ratio(c, "fwd"),
                             f"{r['fb']:.3f}", ratio(x, "fb"), ratio(c, "fb"),
                             f"{r['abytes'] / 2**20:.1f} ({r['abytes'] / r['dense']:.3f})",
                             f"{r['temp']:.0f}"])
            write_table(rows, header, args.out)  # after every shape, so a cut-off run keeps its rows
    header += "\n" + gpu_state().replace("nvidia-smi", "end of run, nvidia-smi")
    table = write_table(rows, header, args.out)
    print()
    print(table, flush=True)


def write_table(rows, header, out):
    cols = ["dtype", "N:M", "B", "L", "method", "fwd ms", "fwd vs XLA", "fwd vs cuDNN",
            "fwd+bwd ms", "f+b vs XLA", "f+b vs cuDNN", "A MiB (vs dense)", "temp MiB f+b"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    table = "\n".join(lines)
    if out:
        with open(out, "w") as f:
            f.write(header + "\n\n" + "Ratios are speed-ups (baseline time / method time); >1 means faster.\n\n"
                    + table + "\n")
    return table


if __name__ == "__main__":
    main()
