"""Attention analysis: L^p quality of attention tickets (DFSS Definition 4.1) and attention maps.

An attention *ticket* is a binary mask m over the dense attention matrix A = softmax(S). Its
L^p quality is the mean over (real) query rows j of

    Q^p = sum_i (m * A)_{j,i}^p / sum_i A_{j,i}^p

at density s = (kept entries) / (all entries). Tickets compared here: DFSS N:M masks
(``dfss_ticket``), top-k masks at a given density (``topk_ticket``, the upper bound at that
density), and DSA masks from a predictor's scores S~ (``dsa_ticket``).

Score-level functions take q, k ``[batch, length, heads, head_dim]`` or scores
``[batch, heads, length, length]`` directly. The model-level helper ``capture_attention`` needs
only the attention registry contract: every attention core is a Flax module with a ``dims``
attribute of type ``AttentionDims`` and its kind's settings in ``config``, called as
``core(q, k, v, mask=..., ...)`` (q, k, v positional); DSA cores also sow their predicted
scores into the "intermediates" collection. ``python -m lra_sparse.analysis --workdir=RUN
--out=maps.png`` runs it on a trained run (``analyse_run``).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

from absl import app
from absl import flags

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
from flax import traverse_util

from lra_sparse import cli
from lra_sparse import workdir as workdir_lib
from lra_sparse.kernels.dsa import reference as dsa_ref
from lra_sparse.attention import parse_attention_config
from lra_sparse.ops.softmax import attention_scores, masked_softmax
from lra_sparse.ops.nm import check_nm, nm_mask
from lra_sparse.attention.registry import AttentionDims


def dense_probabilities(scores, mask=None):
  """A = softmax(S) over real keys (rows with no real key -> 0)."""
  if mask is not None:
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  return masked_softmax(scores)


def dfss_ticket(scores, n: int, m: int, mask=None):
  """The DFSS N:M mask of S (padded keys never kept)."""
  check_nm(n, m, what="dfss_ticket")
  if mask is not None:
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  keep = nm_mask(scores, n, m)
  return keep if mask is None else keep & mask[:, None, None, :]


def topk_ticket(scores, density: float, mask=None):
  """Each row keeps its ceil(density * n_real) largest real scores (the oracle at density)."""
  if not 0.0 < density <= 1.0:
    raise ValueError(f"topk_ticket: density={density} must be in (0, 1]")
  return dsa_ref.oracle_topk_mask(scores, mask=mask, sparsity=1.0 - density)


def dsa_ticket(predicted_scores, mask=None, *, sparsity: float = 0.9, vector: int = 1,
               selection: str = "topk", threshold: float = 0.0):
  """The DSA mask chosen from predicted scores S~ by their float top-k / threshold (the core
  ranks int8-rounded predictor operands: the two can differ on near-ties)."""
  return dsa_ref.predicted_mask(predicted_scores, mask=mask, sparsity=sparsity, vector=vector,
                                selection=selection, threshold=threshold)


def _query_rows(shape, mask):
  rows = jnp.ones(shape[:1] + (1, shape[2]), jnp.float32)
  return rows if mask is None else rows * mask[:, None, :].astype(jnp.float32)


def lp_quality(probs, keep, *, p: float = 1.0, mask=None):
  """Q^p of ticket ``keep`` for attention ``probs`` [b, h, L, L]: mean over real query rows
  (and heads, batch) of sum(keep * A^p) / sum(A^p)."""
  if not p > 0:
    raise ValueError(f"lp_quality: p={p} must be > 0")
  powered = jnp.power(probs.astype(jnp.float32), p)
  kept = jnp.sum(jnp.where(keep, powered, 0.0), axis=-1)
  total = jnp.sum(powered, axis=-1)
  ratio = kept / jnp.where(total > 0, total, 1.0)
  rows = _query_rows(probs.shape, mask) * (total > 0)
  return jnp.sum(ratio * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def ticket_density(keep, mask=None):
  """Share of (real query, real key) pairs the ticket keeps."""
  pairs = _query_rows(keep.shape, mask)[..., None]
  if mask is not None:
    pairs = pairs * mask[:, None, None, :].astype(jnp.float32)
  pairs = jnp.broadcast_to(pairs, keep.shape)
  return jnp.sum(keep * pairs) / jnp.maximum(jnp.sum(pairs), 1.0)


def ticket_qualities(scores, *, mask=None, p: Sequence[float] = (1.0, 2.0),
                     nm: Sequence[tuple[int, int]] = ((1, 2), (2, 4)),
                     topk_densities: Sequence[float] = (0.5, 0.1),
                     predicted_scores=None, dsa_sparsity: float = 0.9,
                     dsa_vector: int = 1) -> dict[str, dict[str, float]]:
  """{ticket name: {"density": s, "Q^p": ...}} for DFSS N:M, top-k and (given S~) DSA tickets.

  ``scores``: [batch, heads, L, L] (pre-softmax, scaled); ``mask``: bool [batch, L].
  """
  nm = tuple(pair for pair in (tuple(x) for x in nm) if scores.shape[-1] % pair[1] == 0)
  arrays = _ticket_arrays(scores, mask, predicted_scores, p=tuple(p), nm=nm,
                          topk_densities=tuple(topk_densities), dsa_sparsity=dsa_sparsity,
                          dsa_vector=dsa_vector)
  return {name: {key: float(value) for key, value in entry.items()}
          for name, entry in arrays.items()}


@functools.partial(jax.jit, static_argnames=("p", "nm", "topk_densities", "dsa_sparsity",
                                             "dsa_vector"))
def _ticket_arrays(scores, mask, predicted_scores, *, p, nm, topk_densities, dsa_sparsity,
                   dsa_vector):
  probs = dense_probabilities(scores, mask)
  tickets = {}
  for n, m in nm:
    tickets[f"dfss_{n}:{m}"] = dfss_ticket(scores, n, m, mask)
  for density in topk_densities:
    tickets[f"topk_{density:g}"] = topk_ticket(scores, density, mask)
  if predicted_scores is not None:
    tickets[f"dsa_{dsa_sparsity:g}"] = dsa_ticket(predicted_scores, mask, sparsity=dsa_sparsity,
                                                  vector=dsa_vector)
  report = {}
  for name, keep in tickets.items():
    entry = {"density": ticket_density(keep, mask)}
    for power in p:
      entry[f"Q^{power:g}"] = lp_quality(probs, keep, p=power, mask=mask)
    report[name] = entry
  return report


def capture_attention(model: nn.Module, variables: Any, *args, method=None,
                      **kwargs) -> list[dict[str, Any]]:
  """Runs ``model.apply(variables, *args, **kwargs)`` (jitted) and returns, for every attention
  core in call order: {"path", "kind", "sparsity" and "vector" (DSA), "q", "k", "mask",
  "predicted_scores" (DSA) or None}.

  ``kwargs`` are passed as static (e.g. deterministic=True).
  """
  def run(variables, *args):
    captured = []

    def interceptor(next_fun, call_args, call_kwargs, context):
      module = context.module
      if (context.method_name == "__call__" and len(call_args) >= 3
          and isinstance(getattr(module, "dims", None), AttentionDims)):
        q, k = call_args[0], call_args[1]
        kind_config = getattr(module, "config", None)
        captured.append({"path": "/".join(module.scope.path), "kind": type(module).__name__,
                         "sparsity": getattr(kind_config, "sparsity", None),
                         "vector": getattr(kind_config, "vector", 1),
                         "q": q, "k": k, "mask": call_kwargs.get("mask")})
      return next_fun(*call_args, **call_kwargs)

    with nn.intercept_methods(interceptor):
      _, state = model.apply(variables, *args, method=method,
                             mutable=["intermediates", "aux_loss", "aux_metrics"], **kwargs)
    sown = traverse_util.flatten_dict(dict(state.get("intermediates", {})), sep="/")
    for entry in captured:
      value = sown.get(f"{entry['path']}/predicted_scores") if entry["path"] else sown.get(
          "predicted_scores")
      entry["predicted_scores"] = None if value is None else value[0]
    meta = [{k: e[k] for k in ("path", "kind", "sparsity", "vector")} for e in captured]
    arrays = [{k: e[k] for k in ("q", "k", "mask", "predicted_scores")} for e in captured]
    return arrays, meta

  holder = {}

  def run_arrays(variables, *args):
    arrays, meta = run(variables, *args)
    holder["meta"] = meta
    return arrays

  arrays = jax.jit(run_arrays)(variables, *args)
  return [dict(**meta, **a) for meta, a in zip(holder["meta"], arrays)]


def qualities_from_captures(captured: Sequence[dict[str, Any]],
                            dsa_sparsity: Optional[float] = None,
                            p: Sequence[float] = (1.0, 2.0)) -> dict[str, Any]:
  """Per attention layer ``ticket_qualities`` of ``capture_attention``'s output, plus the mean.

  DSA tickets appear for layers whose core sowed predicted scores (``dsa_sparsity`` defaults
  to that core's configured sparsity). Layer keys are "<index>:<module path>".
  """
  layers = {}
  for index, entry in enumerate(captured):
    scores = attention_scores(entry["q"], entry["k"], entry["mask"])
    sparsity = dsa_sparsity if dsa_sparsity is not None else (entry["sparsity"] or 0.9)
    layers[f"{index}:{entry['path']}"] = ticket_qualities(
        scores, mask=entry["mask"], p=p, predicted_scores=entry["predicted_scores"],
        dsa_sparsity=sparsity, dsa_vector=entry["vector"])
  mean = {}
  for report in layers.values():
    for ticket, entry in report.items():
      for key, value in entry.items():
        mean.setdefault(ticket, {}).setdefault(key, []).append(value)
  mean = {t: {k: float(np.mean(v)) for k, v in e.items()} for t, e in mean.items()}
  return {"layers": layers, "mean": mean}


def model_ticket_qualities(model: nn.Module, variables: Any, *args, method=None,
                           dsa_sparsity: Optional[float] = None, **kwargs) -> dict[str, Any]:
  """``qualities_from_captures(capture_attention(model, variables, *args, **kwargs))``."""
  return qualities_from_captures(
      capture_attention(model, variables, *args, method=method, **kwargs), dsa_sparsity)


def plot_attention_maps(path: str, q, k, *, mask=None, example: int = 0, head: int = 0,
                        n: int = 2, m: int = 4, predicted_scores=None,
                        dsa_sparsity: float = 0.9, max_tokens: int = 128,
                        title: str = "") -> str:
  """Writes a PNG with dense, DFSS n:m and DSA attention maps of one example and head.

  The DSA panel uses the predictor's scores S~ when given, else the oracle top-k mask at the
  same density (labelled as such). Only the first ``max_tokens`` real tokens are drawn.
  Returns ``path``.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  q, k = jnp.asarray(q)[example:example + 1], jnp.asarray(k)[example:example + 1]
  mask = None if mask is None else jnp.asarray(mask, bool)[example:example + 1]
  scores = attention_scores(q, k, mask)[:, head:head + 1]
  dense = dense_probabilities(scores, mask)
  keep_dfss = dfss_ticket(scores, n, m, mask)
  if predicted_scores is not None:
    pred = jnp.asarray(predicted_scores)[example:example + 1, head:head + 1]
    keep_dsa = dsa_ticket(pred, mask, sparsity=dsa_sparsity)
    dsa_label = f"DSA (predicted, {100 * dsa_sparsity:g}% sparse)"
  else:
    keep_dsa = topk_ticket(scores, 1.0 - dsa_sparsity, mask)
    dsa_label = f"top-k oracle ({100 * dsa_sparsity:g}% sparse; no DSA predictor)"
  panels = [("dense", dense, None), (f"DFSS {n}:{m}", dense, keep_dfss),
            (dsa_label, dense, keep_dsa)]
  real = int(q.shape[1] if mask is None else np.asarray(mask[0]).sum())
  shown = max(1, min(real, max_tokens))
  fig, axes = plt.subplots(1, 3, figsize=(15, 5.2))
  for axis, (label, probs, keep) in zip(axes, panels):
    if keep is None:
      image = probs[0, 0]
      q_text = ""
    else:
      image = masked_probabilities(scores, keep)[0, 0]
      q_text = (f"\nQ^1={float(lp_quality(dense, keep, p=1.0, mask=mask)):.3f}, "
                f"density={float(ticket_density(keep, mask)):.2f}")
    image = np.asarray(image)[:shown, :shown]
    shown_image = axis.imshow(np.log10(np.maximum(image, 1e-6)), cmap="viridis", vmin=-6,
                              vmax=0, interpolation="nearest")
    axis.set_title(label + q_text, fontsize=10)
    axis.set_xlabel("key")
    axis.set_ylabel("query")
  fig.colorbar(shown_image, ax=axes, shrink=0.8, label="log10 attention probability")
  fig.suptitle(title or f"example {example}, head {head}, first {shown} tokens")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def masked_probabilities(scores, keep):
  """softmax of S over the ticket's entries only (what the sparse kind actually computes)."""
  return masked_softmax(jnp.where(keep, scores, -jnp.inf), keep)


def proposition_4_2(p: float, sigma: float, density: float = 0.5) -> dict[str, float]:
  """DFSS Proposition 4.2 (i.i.d. N(mu, sigma) scores, L -> inf): Q^p of top-k at ``density``
  and of 1:2 (a lower bound for 2:4)."""
  erfinv = _erfinv(1.0 - 2.0 * density)
  return {"topk": (1.0 + math.erf(p * sigma / math.sqrt(2.0) - erfinv)) / 2.0,
          "1:2": (1.0 + math.erf(p * sigma / 2.0)) / 2.0}


def _erfinv(y: float) -> float:
  """Inverse error function by bisection (no scipy dependency)."""
  if not -1.0 < y < 1.0:
    raise ValueError(f"erfinv({y}) is undefined")
  lo, hi = -10.0, 10.0
  for _ in range(200):
    mid = (lo + hi) / 2
    if math.erf(mid) < y:
      lo = mid
    else:
      hi = mid
  return (lo + hi) / 2


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a program, so importing this module adds no flags."""
  flags.DEFINE_string("workdir", None, "A run's workdir (config.json, checkpoints/).")
  flags.DEFINE_string("out", None, "PNG to write the attention maps to.")
  flags.DEFINE_string("json", "", "Also write the quality report here.")
  flags.DEFINE_enum("split", "test", ["train", "val", "test"], "Split to read examples from.")
  flags.DEFINE_string("data_dir", "", "Override config.data.data_dir.")
  flags.DEFINE_integer("num_examples", 4, "Examples to run through the model.")
  flags.DEFINE_integer("example", 0, "Example to plot.")
  flags.DEFINE_integer("layer", 0, "Attention call index to plot.")
  flags.DEFINE_integer("head", 0, "Head to plot.")
  flags.mark_flags_as_required(["workdir", "out"])


def load_run(workdir: str, *, data_dir: str = "", split: str = "test", num_examples: int = 4,
             init_key=None) -> tuple[Any, nn.Module, Any, dict[str, Any], np.ndarray]:
  """(config, model, params, batch, targets): the model rebuilt from ``workdir``'s config.json,
  the parameters of its last checkpoint (``checkpointing.load_params_from``; with
  ``init_key``, the model's initialisation from that key instead) and the first
  ``num_examples`` of ``split`` (of ``data_dir`` when given, else the run's own data)."""
  import os  # pylint: disable=import-outside-toplevel

  import ml_collections  # pylint: disable=import-outside-toplevel

  from lra_sparse import checkpointing  # pylint: disable=import-outside-toplevel
  from lra_sparse import train  # pylint: disable=import-outside-toplevel
  from lra_sparse.data import get_task  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(os.path.join(workdir, workdir_lib.CONFIG_FILE)):
    raise FileNotFoundError(f"--workdir={workdir!r}: no {workdir_lib.CONFIG_FILE} there")
  config = ml_collections.ConfigDict(workdir_lib.read_config(workdir))
  if data_dir:
    config.data.data_dir = data_dir
  task = get_task(config.task)
  spec = task.spec(config)
  model = train.make_model(config, spec)
  arrays = task.load_split(config, split)
  count = min(num_examples, len(arrays["targets"]))
  batch = {name: jnp.asarray(arrays[name][:count]) for name in spec.input_names}
  sample = {name: value[:1] for name, value in batch.items()}
  variables = jax.jit(lambda rng: model.init(rng, sample, deterministic=True))(
      jax.random.key(0) if init_key is None else init_key)
  if init_key is not None:
    return config, model, variables["params"], batch, np.asarray(arrays["targets"][:count])
  params, fresh, _ = checkpointing.load_params_from(workdir, variables["params"],
                                                   what="--workdir")
  if fresh:
    raise ValueError(f"checkpoint in {workdir} lacks parameters {fresh[:5]} of the model "
                     f"its config.json describes")
  return config, model, params, batch, np.asarray(arrays["targets"][:count])


def analyse_run(workdir: str, out: str, *, json_path: str = "", split: str = "test",
                data_dir: str = "", num_examples: int = 4, example: int = 0, layer: int = 0,
                head: int = 0) -> dict[str, Any]:
  """Rebuilds the model from ``workdir``'s config.json, loads the last checkpoint's parameters
  (``checkpointing.load_params_from``), runs the first ``num_examples`` of ``split``, returns
  (and prints) the L^p ticket qualities of every attention layer and plots ``layer`` /
  ``head`` of ``example`` to ``out``.
  """
  import json  # pylint: disable=import-outside-toplevel

  config, model, params, batch, targets = load_run(workdir, data_dir=data_dir, split=split,
                                                   num_examples=num_examples)
  count = len(targets)
  if not 0 <= example < count:
    raise ValueError(f"--example={example} must be in [0, {count})")
  captured = capture_attention(model, {"params": params}, batch, deterministic=True)
  if not 0 <= layer < len(captured):
    raise ValueError(f"--layer={layer} must be in [0, {len(captured)})")
  report = qualities_from_captures(captured)
  bad = sorted(f"{layer}/{ticket}/{key}" for layer, tickets in report["layers"].items()
               for ticket, entry in tickets.items() for key, value in entry.items()
               if not math.isfinite(value))
  if bad:
    raise ValueError(f"--workdir={workdir}: non-finite ticket qualities ({', '.join(bad[:5])}"
                     f"{' ...' if len(bad) > 5 else ''}): the run's attention is not finite")
  entry = captured[layer]
  kind_config = parse_attention_config(config.attention)
  n, m = kind_config.n_m if kind_config.KIND == "dfss" else (2, 4)
  plot_attention_maps(out, entry["q"], entry["k"], mask=entry["mask"], example=example,
                      head=head, n=n, m=m, predicted_scores=entry["predicted_scores"],
                      dsa_sparsity=entry["sparsity"] or 0.9,
                      title=f"{config.task} / {kind_config.KIND}: layer {layer} "
                            f"({entry['path']}), example {example}, head {head}")
  text = json.dumps(report, indent=2, sort_keys=True)
  print(text)
  if json_path:
    with open(json_path, "w") as f:
      f.write(text + "\n")
  return report


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  analyse_run(FLAGS.workdir, FLAGS.out, json_path=FLAGS.json, split=FLAGS.split,
              data_dir=FLAGS.data_dir, num_examples=FLAGS.num_examples, example=FLAGS.example,
              layer=FLAGS.layer, head=FLAGS.head)


if __name__ == "__main__":
  # Through the imported module: ``python -m`` runs this file as __main__, a second copy of it.
  from lra_sparse import analysis as _analysis_module  # pylint: disable=g-import-not-at-top
  _analysis_module.define_flags()
  cli.run(_analysis_module.main)
