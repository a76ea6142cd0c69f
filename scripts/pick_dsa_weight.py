"""Picks the DSA Eq. 6 weight from the "weight" preset's runs of experiments/specs/dsa_listops.py.

  python -m scripts.pick_dsa_weight --root=ROOT                # prints the measurement
  python -m scripts.pick_dsa_weight --root=ROOT --write_spec   # and writes the pick into
                                                               # the spec's MSE_WEIGHT

Per weight: each seed's validation accuracy and the predictor's validation hit rate at the
last step (result.json), their means, and which weight ``pick_mse_weight`` (in the spec: the
rule and its reasons) takes. Only the preset's runs count: DSA-90 fine-tunes of a dense run with
the spec's sigma and predictor precision, fine-grained selection, seeds WEIGHT_SEEDS. A run that
has not finished, or a weight short of a seed, is an error naming it: the pick needs them all.
"""
from __future__ import annotations

import collections
import os
import re

from absl import flags

from experiments.specs import dsa_listops as spec
from lra_sparse import cli
from lra_sparse import tables

flags.DEFINE_string("root", None, "The sweep root that holds the weight preset's runs.")
flags.DEFINE_bool("write_spec", False, "Write the pick into the spec's MSE_WEIGHT and mark it "
                  "measured.")
FLAGS = flags.FLAGS

SPEC_FILE = os.path.abspath(spec.__file__)


def measure(root: str) -> dict[float, list[tuple[int, float, float]]]:
  """{weight: [(seed, val accuracy, val hit rate), ...]} of the preset's finished runs: those
  in a row of the spec's "weight" table, at a seed of WEIGHT_SEEDS."""
  rows = spec.get_table("weight").rows
  hit_rates = {r.workdir: r for r in tables.find_runs(root, "val", "dsa_hit_rate")}
  found: dict[float, list[tuple[int, float, float]]] = collections.defaultdict(list)
  unfinished = []
  for run in tables.find_runs(root, "val", "accuracy"):
    if (run.config.get("seed") not in spec.WEIGHT_SEEDS
        or not any(tables.matches(run.config, row.match) for row in rows)):
      continue
    hit = hit_rates[run.workdir]
    if run.status != "finished" or hit.status != "finished":
      unfinished.append(os.path.basename(run.workdir))
      continue
    found[run.config["attention.dsa.mse_weight"]].append(
        (run.config["seed"], run.value, hit.value))
  if unfinished:
    raise ValueError(f"unfinished weight runs under {root}: {', '.join(unfinished)}")
  return dict(found)


def report(measured: dict[float, list[tuple[int, float, float]]], pick: float) -> str:
  rows = []
  for weight in spec.WEIGHTS:
    runs = sorted(measured[weight])
    accuracy = [a for _, a, _ in runs]
    hit = [h for _, _, h in runs]
    rows.append((f"{weight:g}", " / ".join(f"{100 * a:.2f}" for a in accuracy),
                 f"{100 * sum(accuracy) / len(accuracy):.2f}",
                 " / ".join(f"{h:.3f}" for h in hit), f"{sum(hit) / len(hit):.3f}",
                 "picked" if weight == pick else ""))
  seeds = ", ".join(map(str, spec.WEIGHT_SEEDS))
  return tables.markdown_grid(
      ("Eq. 6 weight", f"val accuracy % (seeds {seeds})", "mean", "val hit rate", "mean", ""),
      rows)


def write_spec(pick: float, path: str | None = None) -> None:
  path = path or SPEC_FILE
  with open(path) as f:
    text = f.read()
  text, n_weight = re.subn(r"^MSE_WEIGHT = .*$", f"MSE_WEIGHT = {pick!r}          # written by "
                           "scripts/pick_dsa_weight.py --write_spec", text, flags=re.M)
  text, n_flag = re.subn(r"^MSE_WEIGHT_MEASURED = .*$", "MSE_WEIGHT_MEASURED = True", text,
                         flags=re.M)
  if n_weight != 1 or n_flag != 1:
    raise ValueError(f"{path}: expected one MSE_WEIGHT and one MSE_WEIGHT_MEASURED line")
  with open(path, "w") as f:
    f.write(text)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS.root:
    raise ValueError("--root is required")
  measured = measure(FLAGS.root)
  pick = spec.pick_mse_weight({w: [(a, h) for _, a, h in runs]
                               for w, runs in measured.items()})
  print(report(measured, pick))
  print(f"\npicked Eq. 6 weight: {pick:g}")
  if FLAGS.write_spec:
    write_spec(pick)
    print(f"wrote MSE_WEIGHT = {pick!r} into {SPEC_FILE}")


if __name__ == "__main__":
  cli.run(main)
