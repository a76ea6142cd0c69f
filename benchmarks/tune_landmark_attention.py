"""Tiles of the Nystromformer's flash kernels (kernels/nystrom/landmark.py) against cuDNN.

  python -m benchmarks.tune_landmark_attention [--kernels=few_keys,few_queries] [--nm=,2:4]
      [--shape=32x2000x8x64 --landmarks=64] [--out=FILE]

Times forward and forward+backward (grads of <out, cotangent> w.r.t. q, k, v) of cuDNN's flash
attention and of each kernel under every combination of its tile constants, in one process,
bf16; median after warm-up (benchmarks.harness.time_fn). One table.

  F (.)  (L queries over the m landmark keys): ROWS x NUM_WARPS x BWD_BLOCKS x NUM_STAGES
  B V    (the m landmark queries over L keys): KEY_BLOCK x SPAN x SPAN_WARPS x SPAN_STAGES
"""
from __future__ import annotations

import itertools

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.harness import grad_of, normal_sets, time_fn
from lra_sparse.attention import dense
from lra_sparse.ops.nm import parse_nm
from lra_sparse.kernels.nystrom import landmark as kernel

flags.DEFINE_list("kernels", ["few_keys", "few_queries"], "Which kernels to tune.")
flags.DEFINE_list("nm", ["", "2:4"], "N:M settings ('' = plain).")
flags.DEFINE_list("rows", ["64", "128"], "F (.): ROWS values.")
flags.DEFINE_list("warps", ["4", "8"], "NUM_WARPS / SPAN_WARPS values.")
flags.DEFINE_list("bwd_blocks", ["4", "8"], "F (.): BWD_BLOCKS values.")
flags.DEFINE_list("stages", ["1", "2"], "NUM_STAGES / SPAN_STAGES values.")
flags.DEFINE_list("key_blocks", ["64", "128"], "B V: KEY_BLOCK values.")
flags.DEFINE_list("spans", ["256", "512", "1024"], "B V: SPAN values.")
flags.DEFINE_string("shape", "32x2000x8x64", "batch x length x heads x head_dim.")
flags.DEFINE_integer("landmarks", 64, "Landmarks: the keys of F (.), the queries of B V.")
flags.DEFINE_string("out", "", "Also write the table here.")
FLAGS = flags.FLAGS

KNOBS = {"few_keys": ("ROWS", "NUM_WARPS", "BWD_BLOCKS", "NUM_STAGES"),
         "few_queries": ("KEY_BLOCK", "SPAN", "SPAN_WARPS", "SPAN_STAGES")}


def _values(name: str):
  flag = {"ROWS": "rows", "NUM_WARPS": "warps", "BWD_BLOCKS": "bwd_blocks",
          "NUM_STAGES": "stages", "KEY_BLOCK": "key_blocks", "SPAN": "spans",
          "SPAN_WARPS": "warps", "SPAN_STAGES": "stages"}[name]
  return [int(x) for x in FLAGS[flag].value]


def main(argv):
  del argv
  b, l, h, d = harness.parse_shape(FLAGS.shape, dims=4)
  m = FLAGS.landmarks
  many, few = ((b, l, h, d), jnp.bfloat16), ((b, m, h, d), jnp.bfloat16)
  inputs = {"few_keys": normal_sets([many, few, few, ((b, l, h, d), jnp.float32)]),
            "few_queries": normal_sets([few, many, many, ((b, m, h, d), jnp.float32)])}
  cudnn = lambda q, k, v: dense.cudnn_attention(q, k, v)  # noqa: E731
  rows = []

  def run(what, name, fn):
    sets = inputs[what]
    try:
      fwd, _ = time_fn(jax.jit(fn), [s[:3] for s in sets])
      both, _ = time_fn(grad_of(fn), sets)
      rows.append((what, name, f"{fwd:.3f}", f"{both:.3f}"))
    except Exception as e:  # noqa: BLE001  one failing row must not hide the others
      rows.append((what, name, "failed", str(e).splitlines()[0][:80]))
    print(rows[-1], flush=True)

  for what in FLAGS.kernels:
    run(what, "cuDNN", cudnn)
    knobs = KNOBS[what]
    saved = tuple(getattr(kernel, k) for k in knobs)
    for nm_text in FLAGS.nm:
      nm = parse_nm(nm_text) if nm_text else None
      attend = kernel.few_keys_attention if what == "few_keys" else kernel.few_queries_attention
      for values in itertools.product(*(_values(k) for k in knobs)):
        tiles = dict(zip(knobs, values))
        if what == "few_queries" and tiles["SPAN"] % tiles["KEY_BLOCK"]:
          continue
        label = " ".join(f"{k}={v}" for k, v in tiles.items())
        with harness.swapped(kernel, **tiles):                # read at trace time
          run(what, f"Pallas {nm_text or 'plain'} {label}" + (" (default)" if values == saved
                                                              else ""),
              lambda q, k, v, nm=nm, attend=attend: attend(q, k, v, nm=nm))
  harness.emit_table(f"Nystromformer flash kernels, {FLAGS.shape}, {m} landmarks, bf16; "
                     + harness.run_header(), ["kernel", "what", "fwd ms", "fwd+bwd ms"], rows,
                     FLAGS.out)


if __name__ == "__main__":
  app.run(main)
