"""Where a classifier run that sits at chance has lost its input: per-stage spread across examples.

  python -m scripts.collapse_probe --workdir=RUN [--workdir=RUN ...] [--data_dir=DIR]
      [--split=val] [--num_examples=256] [--init_seed=S]

Rebuilds each run's model from its config.json, loads its newest checkpoint's parameters and
runs the first ``num_examples`` of ``split`` (evaluation mode: no dropout). It prints, for the
pooled encoder features, the classifier head's hidden layer (before its ReLU) and the logits,
how much they vary across examples (the standard deviation over examples, averaged over
features), and for the hidden layer how many units are positive for at least one example:
a head whose hidden units are all at or below zero for every input (dead ReLUs) gives the
same logits for every example, so no gradient reaches the encoder and the run stays where it
is whatever its attention does. ``--init_seed=S`` probes the model as the trainer initialises
it at seed S (step 0) instead of the checkpoint.
"""
from __future__ import annotations

import json
from typing import Sequence

from absl import app, flags

import numpy as np

from lra_sparse import analysis
from lra_sparse import train
from lra_sparse.sweep import carry

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("workdir", [], "A run directory (config.json and checkpoints/).")
flags.DEFINE_string("data_dir", "", "The task's data directory (default: the run's own).")
flags.DEFINE_string("split", "val", "The split whose first examples run.")
flags.DEFINE_integer("num_examples", 256, "How many examples of the split run.")
flags.DEFINE_integer("init_seed", None, "Probe the run's model as the trainer initialises it "
                     "at this seed (step 0) instead of its checkpoint.")


def _spread(x) -> float:
  """The standard deviation over examples (axis 0), averaged over the other axes."""
  return float(np.asarray(x, np.float64).std(axis=0).mean())


def load_run(workdir: str, *, data_dir: str = "", split: str = "val",
             num_examples: int = 256, init_seed: int | None = None):
  """(model, params, batch, targets, step) of ``workdir``'s newest checkpoint (or, with
  ``init_seed``, of the trainer's initialisation at that seed: step 0) on the first
  ``num_examples`` of ``split``."""
  if num_examples < 2:
    raise ValueError(f"--num_examples={num_examples}: a spread needs at least 2 examples")
  init_key = None if init_seed is None else train.seed_keys(init_seed)[0]
  _, model, params, batch, targets = analysis.load_run(workdir, data_dir=data_dir, split=split,
                                                       num_examples=num_examples,
                                                       init_key=init_key)
  if init_seed is not None:
    return model, params, batch, targets, 0
  return model, params, batch, targets, carry.newest_checkpoint_step(workdir)


def head_report(model, params, batch, targets) -> dict:
  """The spreads across examples and the live hidden units of the classifier head (module
  docstring), ``mean_logit_gap`` (the mean over examples of the largest logit minus the
  smallest: how confident the head is) and the accuracy on ``targets``."""
  logits, state = model.apply({"params": params}, batch, deterministic=True,
                              capture_intermediates=True, mutable=["intermediates"])
  captured = state["intermediates"]
  head = captured.get("head", {})
  if "Dense_0" not in head or "encoder" not in captured:
    raise ValueError(f"the model has no encoder and classifier head with a hidden layer "
                     f"(intermediates: {sorted(captured)})")
  features = np.asarray(captured["encoder"]["__call__"][0], np.float64)
  hidden = np.asarray(head["Dense_0"]["__call__"][0], np.float64)
  logits = np.asarray(logits, np.float64)
  return {"examples": int(len(targets)), "features_spread": _spread(features),
          "hidden_spread": _spread(hidden), "hidden_units": int(hidden.shape[-1]),
          "hidden_units_live": int((hidden > 0).any(axis=0).sum()),
          "hidden_max": float(hidden.max()), "logits_spread": _spread(logits),
          "mean_logit_gap": float((logits.max(-1) - logits.min(-1)).mean()),
          "accuracy": float((logits.argmax(-1) == targets).mean())}


def probe(workdir: str, *, data_dir: str = "", split: str = "val", num_examples: int = 256,
          init_seed: int | None = None) -> dict:
  """The report of one run (see the module docstring)."""
  model, params, batch, targets, step = load_run(workdir, data_dir=data_dir, split=split,
                                                 num_examples=num_examples,
                                                 init_seed=init_seed)
  return {"workdir": workdir, "checkpoint": step,
          **({} if init_seed is None else {"init_seed": init_seed}),
          **head_report(model, params, batch, targets)}


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS.workdir:
    raise app.UsageError("give at least one --workdir")
  for workdir in FLAGS.workdir:
    print(json.dumps(probe(workdir, data_dir=FLAGS.data_dir, split=FLAGS.split,
                           num_examples=FLAGS.num_examples, init_seed=FLAGS.init_seed)))


if __name__ == "__main__":
  app.run(main)
