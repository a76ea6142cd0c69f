"""DSA kernels against dense attention on one GPU; prints ONE markdown table.

Rows per shape (bf16, every method on the same random inputs, in one process):
  XLA dense, cuDNN dense (jax.nn.dot_product_attention), DFSS 2:4 Triton (fused), and DSA-s
  (s = sparsity) with vector V and predictor rank k = round(sigma * heads * head_dim):
  * "DSA pure-JAX": the reference path (int scores, top-k, masked softmax; [L, L] arrays);
  * "DSA Triton": selection kernel (bits) + attention kernels, "Triton gather" with the
    gathered forward (key lists per 64 query rows, then those keys only; --forwards).
A setting SPARSITY%:VECTOR:SIGMA:t selects by threshold instead of top-k ("DSA-t99"): the
threshold is the SPARSITY quantile of the predicted group scores of the shape's first input
set, and the row names the share of entries the selection then keeps on it.
A setting SPARSITY%:bBLOCK:SIGMA ("90:b64:0.25") is the block rule
(``attention.dsa.granularity="block"``): each query block keeps whole key blocks by the block
pair's mean predicted score (per-head predictor weights W~ drawn once), and the kernels run
with tiles cut to the blocks, skipping the empty ones (``tiles.block_overrides``).
"fwd" is the attention output (DSA: the selection from Q~, K~ and the attention over it);
"fwd+bwd" adds the gradient of sum(out * ct) + L_MSE(S, S~) w.r.t. q, k, v, Q~, K~ and the
predictor weights (the MSE from Gram matrices of the factors (XP) W~, as in training).
Timing: --steps calls chained in one jit (lax.scan over stacked inputs, 3 random sets),
median of --rounds; ms per call.  "temp MiB" is XLA's compiled
temp-buffer size of one fwd+bwd call (memory_analysis).

  python -m benchmarks.bench_dsa [--shapes=32x1024,16x2048,8x4096] [--heads=4] [--dim=64]
      [--settings=90:1:0.25,95:1:0.25,99:1:0.25,95:8:0.1,99:8:0.1,99:8:0.1:t] [--steps=20]
      [--rounds=7] [--forwards=tiles,gather] [--skip_reference] [--select_only]
      [--dropout=0.1] [--out=FILE]

--dropout=RATE adds, per shape, XLA dense with attention dropout (what a dense model trains
on then: cuDNN has none through JAX) and each DSA Triton setting with dropout in its kernels;
"drop / no drop" is such a row's time over the same method's without dropout.
"""

from __future__ import annotations

from typing import Sequence

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks import harness
from lra_sparse.attention.dense import dense_attention_reference
from lra_sparse.kernels.dfss import triton as dfss_triton
from lra_sparse.kernels.dsa import reference as dsa_reference
from lra_sparse.kernels.dsa import tiles as dsa_tiles
from lra_sparse.kernels.dsa import triton as dsa_triton

FLAGS = flags.FLAGS


def define_flags() -> None:
  harness.define_shape_flags()
  harness.define_chain_flags()
  flags.adopt_module_key_flags(harness)
  flags.DEFINE_string("settings",
                      "90:1:0.25,95:1:0.25,99:1:0.25,90:8:0.25,95:8:0.1,99:8:0.1,99:8:0.1:t",
                      "DSA settings SPARSITY%:VECTOR:SIGMA[:t], comma-separated (t: threshold "
                      "selection at that quantile).")
  flags.DEFINE_list("forwards", ["tiles", "gather"], "DSA Triton forwards to time "
                    "(dsa_triton.FORWARDS; gather only for vector >= 4).")
  flags.DEFINE_bool("skip_reference", False, "Skip the DSA pure-JAX rows.")
  flags.DEFINE_bool("block_skip_rows", False, "Block settings: also the kernels testing every "
                    "tile's bits (no tile lists), the A/B of the lists.")
  flags.DEFINE_string("out", None, "Also write the table here.")
  flags.DEFINE_list("tiles", [], "Kernel tile overrides KERNEL:BM:BN:WARPS:STAGES[:SKIP] "
                    "(kernels.dsa.tiles), e.g. fwd:128:64:8:3:0.")
  flags.DEFINE_bool("no_dense", False, "Skip the XLA / cuDNN / DFSS rows (tuning runs).")
  flags.DEFINE_bool("select_only", False, "Add a row per DSA setting timing the selection "
                    "alone (its forward; the attention kernel's share is the difference).")
  flags.DEFINE_float("dropout", 0.0, "> 0: add XLA dense and DSA Triton rows with attention "
                     "dropout at this rate.")


_SEED = jnp.array([12345, -6789], jnp.int32)   # dropout rows: one fixed Philox key


def _selection(sparsity, threshold):
  """select_bits' selection arguments: top-k at ``sparsity`` (threshold None), else the
  threshold rule at ``threshold``."""
  if threshold is None:
    return dict(sparsity=sparsity)
  return dict(selection="threshold", threshold=threshold)


def _block_keep(q, qp, kp, sparsity, block):
  """The block rule's kept key blocks from the factored predictor (qp's and kp's first head as
  X P, per-head W~ drawn once)."""
  _, _, h, d = q.shape
  rank = qp.shape[-1]
  w = jax.random.normal(jax.random.PRNGKey(7), (h, rank, rank)) / rank ** 0.5
  return dsa_reference.block_select(
      dsa_reference.LowRank(qp[:, :, 0], w), dsa_reference.LowRank(kp[:, :, 0], w), None,
      block_size=block, sparsity=sparsity, scale=d ** -0.5)


def block_select_fns(sparsity, block):
  """The block rule's selection alone (block scores, top-k, the kernels' bits): what its
  forward spends before the attention kernel; no backward."""

  def fwd(q, k, v, qp, kp, ct):
    del k, v, ct
    l = q.shape[1]
    return dsa_reference.block_bits(_block_keep(q, qp, kp, sparsity, block), block, l,
                                    vector=dsa_reference.block_vector(l))
  return fwd, None


def block_fns(sparsity, block, triton: bool, rate: float = 0.0, lists: bool = True):
  """The block rule: block selection from the factored predictor (qp's and kp's first head as
  X P, per-head W~), then the attention over the kept blocks' keys (kernels with tiles cut to
  the blocks visiting the kept tiles' lists, or with ``lists`` False testing every tile's
  bits and skipping the empty ones; or the pure-JAX path)."""

  def attend(q, k, v, qp, kp):
    l = q.shape[1]
    keep_blocks = _block_keep(q, qp, kp, sparsity, block)
    if triton:
      vector = dsa_reference.block_vector(l)
      bits = dsa_reference.block_bits(keep_blocks, block, l, vector=vector)
      return dsa_triton.dsa_attention_triton(
          q, k, v, bits, vector=vector, dropout_rate=rate, dropout_seed=_SEED if rate else None,
          tiles=dsa_tiles.block_overrides(block, jnp.dtype(q.dtype).name),
          blocks=keep_blocks if lists else None, block_size=block)
    return dsa_reference.attention_under_keep(
        q, k, v, dsa_reference.expand_blocks(keep_blocks, block, l))
  return _passes(attend)


def dsa_fns(sparsity, vector, triton: bool, rate: float = 0.0, threshold=None,
            forward: str = "tiles", tiles: dsa_tiles.Overrides = ()):
  select = _selection(sparsity, threshold)

  def attend(q, k, v, qp, kp):
    ops = dsa_reference.selection_operands(qp, kp, None, vector=vector,
                                           scale=q.shape[-1] ** -0.5)
    if triton:
      bits = dsa_triton.select_bits(ops, **select, tiles=tiles)
      return dsa_triton.dsa_attention_triton(q, k, v, bits, vector=vector, dropout_rate=rate,
                                             dropout_seed=_SEED if rate else None,
                                             forward=forward, tiles=tiles)
    keep = dsa_reference.reference_select(ops, **select)
    return dsa_reference.attention_under_keep(q, k, v,
                                              dsa_reference.expand_groups(keep, vector))
  return _passes(attend)


def _passes(attend):
  """(fwd, fwd_bwd) of a DSA attention ``attend(q, k, v, qp, kp)``: the output, and the
  gradient of sum(out * ct) + L_MSE w.r.t. every input and the predictor weights."""

  def fwd(q, k, v, qp, kp, ct):
    del ct
    return attend(q, k, v, qp, kp)

  def fwd_bwd(q, k, v, qp, kp, ct):
    # L_MSE as training computes it: from the factors of Q~ = (XP) W~, here X P = the first
    # head's Q~ and W~ the identity (same shapes and cost as the model's).
    eye = jnp.broadcast_to(jnp.eye(qp.shape[-1], dtype=jnp.float32),
                           (qp.shape[2],) + (qp.shape[-1],) * 2)
    def loss(q, k, v, qp, kp, wq, wk):
      out = attend(q, k, v, qp, kp)
      return (jnp.sum((out * ct).astype(jnp.float32)) + 1e-6 * dsa_reference.prediction_mse(
          q, k, dsa_reference.LowRank(qp[:, :, 0], wq), dsa_reference.LowRank(qp[:, :, 0], wk)))
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6))(q, k, v, qp, kp, eye, eye)
  return fwd, fwd_bwd


def select_fns(sparsity, vector, threshold=None, tiles: dsa_tiles.Overrides = ()):
  """The selection alone (predictor scores and bits): what the forward spends before the
  attention kernel; no backward (None: the row's fwd+bwd is not timed)."""
  select = _selection(sparsity, threshold)

  def fwd(q, k, v, qp, kp, ct):
    del k, v, ct
    ops = dsa_reference.selection_operands(qp, kp, None, vector=vector,
                                           scale=q.shape[-1] ** -0.5)
    return dsa_triton.select_bits(ops, **select, tiles=tiles)
  return fwd, None


def calibrated_threshold(qp, kp, vector, sparsity, head_dim):
  """(threshold, kept share): the ``sparsity`` quantile of the float group scores that the
  threshold rule compares (int8 scores times their factor), on the first example, and the
  share of all entries of (qp, kp) the threshold selection keeps."""
  ops = dsa_reference.selection_operands(qp, kp, None, vector=vector, scale=head_dim ** -0.5)
  first = jax.tree_util.tree_map(lambda x: x[:1], ops)
  scores = (dsa_reference.integer_scores(first).astype(jnp.float32)
            * first.factor[..., None])
  threshold = float(jnp.quantile(scores.ravel(), sparsity))
  keep = dsa_reference.unpack_bits(
      dsa_triton.select_bits(ops, selection="threshold", threshold=threshold), qp.shape[1])
  return threshold, float(jnp.mean(keep))


def dense_fns(f):
  """(fwd, fwd_bwd) of the attention ``f(q, k, v)``, taking the DSA methods' arguments
  (q, k, v, qp, kp, ct; the predictor factors qp, kp unused)."""
  fwd, fwd_bwd = harness.passes(f).values()
  return ((lambda q, k, v, qp, kp, ct: fwd(q, k, v, ct)),
          (lambda q, k, v, qp, kp, ct: fwd_bwd(q, k, v, ct)))


def _num(x, digits: int) -> str:
  """x with ``digits`` decimals; "-" for a cell not timed (None)."""
  return "-" if x is None else f"{x:.{digits}f}"


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    tiles = dsa_tiles.parse_overrides(FLAGS.tiles)
  except ValueError as error:
    raise app.UsageError(f"--tiles: {error}") from error
  triton_ok = dsa_triton.is_available()
  h, d = FLAGS.heads, FLAGS.dim
  header = (harness.run_header(f"bf16, heads {h}, head_dim {d}",
                               f"{FLAGS.steps} calls per jit (lax.scan), median of "
                               f"{FLAGS.rounds} rounds, ms per call",
                               f"tiles {FLAGS.tiles or 'default'}")
            + "\n" + harness.gpu_state())
  print(header, flush=True)
  settings = []
  for s in FLAGS.settings.split(","):
    sp, vec, sigma, *rule = s.split(":")
    block = int(vec[1:]) if vec.startswith("b") and vec[1:].isdigit() else 0
    if rule not in ([], ["t"]) or not (block or vec.isdigit()) or (block and rule):
      raise app.UsageError(f"--settings entry {s!r}: SPARSITY%:VECTOR:SIGMA[:t] or "
                           "SPARSITY%:bBLOCK:SIGMA")
    settings.append((int(sp) / 100, block or int(vec), float(sigma), rule == ["t"], bool(block)))
  drop = f" drop {FLAGS.dropout:g}"   # the name suffix of a row with attention dropout
  rows = []
  for b, l in harness.parse_shapes(FLAGS.shapes):
    shape = f"{b}x{l}"
    methods = {
        "XLA dense": dense_fns(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="xla")),
        "cuDNN dense": dense_fns(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn")),
    }
    if FLAGS.dropout and not FLAGS.no_dense:
      methods["XLA dense" + drop] = dense_fns(lambda q, k, v: dense_attention_reference(
          q, k, v, dropout_rate=FLAGS.dropout, dropout_rng=jax.random.PRNGKey(0)))
    if FLAGS.no_dense:
      methods = {}
    elif triton_ok:
      methods["DFSS 2:4 Triton"] = dense_fns(
          lambda q, k, v: dfss_triton.dfss_attention_triton(q, k, v, n=2, m=4))
    key = jax.random.PRNGKey(b * l)
    base = harness.attention_sets(b, l, h, d, jnp.bfloat16)
    preds = {}
    for sparsity, vec, sigma, by_threshold, block in settings:
      rank = max(1, round(sigma * h * d))
      if rank not in preds:
        preds[rank] = [tuple(jax.random.normal(kk, (b, l, h, rank), jnp.float32)
                             for kk in jax.random.split(jax.random.fold_in(key, 10 + i), 2))
                       for i in range(3)]
      if block:
        tag = f"DSA-{round(sparsity * 100)} block {vec} k={rank}"
        if triton_ok:
          methods[f"{tag} Triton"] = block_fns(sparsity, vec, True) + (rank,)
          if FLAGS.block_skip_rows:
            methods[f"{tag} Triton, bit-test skip"] = block_fns(sparsity, vec, True,
                                                                lists=False) + (rank,)
          if FLAGS.dropout:
            methods[f"{tag} Triton{drop}"] = block_fns(sparsity, vec, True,
                                                       FLAGS.dropout) + (rank,)
        if FLAGS.select_only:
          methods[f"{tag} selection alone"] = block_select_fns(sparsity, vec) + (rank,)
        if not FLAGS.skip_reference:
          methods[f"{tag} pure-JAX"] = block_fns(sparsity, vec, False) + (rank,)
        continue
      threshold = None
      tag = f"DSA-{round(sparsity * 100)} V={vec} k={rank}"
      if by_threshold:
        if not triton_ok:
          continue
        threshold, kept = calibrated_threshold(*preds[rank][0], vec, sparsity, d)
        tag = (f"DSA-t{round(sparsity * 100)} V={vec} k={rank} (threshold {threshold:.3g}, "
               f"kept {100 * kept:.2f}%)")
      if triton_ok:
        for forward in FLAGS.forwards:
          if forward == "gather" and vec < 4:
            continue
          name = f"{tag} Triton" + ("" if forward == "tiles" else f" {forward}")
          methods[name] = dsa_fns(sparsity, vec, True, threshold=threshold,
                                  forward=forward, tiles=tiles) + (rank,)
          if FLAGS.dropout:
            methods[f"{name}{drop}"] = dsa_fns(sparsity, vec, True, FLAGS.dropout, threshold,
                                               forward, tiles) + (rank,)
        if FLAGS.select_only:
          methods[f"{tag} selection alone"] = select_fns(sparsity, vec, threshold, tiles) + (rank,)
      if not FLAGS.skip_reference:
        methods[f"{tag} pure-JAX"] = dsa_fns(sparsity, vec, False, threshold=threshold) + (rank,)
    for name, fns in methods.items():
      fwd, fwd_bwd = fns[:2]
      rank = fns[2] if len(fns) > 2 else next(iter(preds))
      sets = [base[i][:3] + preds[rank][i] + (base[i][3],) for i in range(3)]
      xs = harness.stack_sets(sets, FLAGS.steps)
      res = {}
      for kind, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        if f is None:
          res[kind] = None            # not timed (a selection-only row has no backward)
          continue
        try:
          res[kind] = harness.chained_ms(f, xs, FLAGS.steps, FLAGS.rounds)
        except Exception as e:  # noqa: BLE001  report and go on
          print(f"{shape} {name} {kind} failed: {type(e).__name__}: {str(e)[-600:]}", flush=True)
          res[kind] = float("nan")
      res["temp"] = None if fwd_bwd is None else harness.temp_mib(fwd_bwd, *sets[0])
      rows.append((shape, name, res))
      print(f"{shape} {name}: fwd {_num(res['fwd'], 3)} fwd+bwd {_num(res['fwd+bwd'], 3)} "
            f"temp {_num(res['temp'], 0)} MiB", flush=True)
  cols = ["BxL", "method", "fwd ms", "fwd+bwd ms", "fwd / cuDNN", "fwd+bwd / cuDNN",
          "fwd+bwd / XLA", "temp MiB (fwd+bwd)"]
  if FLAGS.dropout:
    cols += ["fwd drop / no drop", "fwd+bwd drop / no drop"]
  table = []
  nan = {"fwd": float("nan"), "fwd+bwd": float("nan")}
  for shape, name, res in rows:
    ref = {n: r for s, n, r in rows if s == shape}
    cu, xla = ref.get("cuDNN dense", nan), ref.get("XLA dense", nan)
    ratio = lambda a, b: None if a is None else a / b  # noqa: E731
    cells = [shape, name, _num(res["fwd"], 3), _num(res["fwd+bwd"], 3),
             _num(ratio(res["fwd"], cu["fwd"]), 2), _num(ratio(res["fwd+bwd"], cu["fwd+bwd"]), 2),
             _num(ratio(res["fwd+bwd"], xla["fwd+bwd"]), 2), _num(res["temp"], 0)]
    if FLAGS.dropout:
      plain = ref.get(name[:-len(drop)], nan) if name.endswith(drop) else None
      cells += ["-" if plain is None else _num(ratio(res[kind], plain[kind]), 2)
                for kind in ("fwd", "fwd+bwd")]
    table.append(cells)
  harness.emit_table(header, cols, table, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
