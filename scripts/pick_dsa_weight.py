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
from typing import Any

from absl import flags

from experiments.specs import dsa_listops as spec
from lra_sparse import cli
from lra_sparse import tables
from lra_sparse import workdir as workdir_lib

flags.DEFINE_string("root", None, "The sweep root that holds the weight preset's runs.")
flags.DEFINE_bool("write_spec", False, "Write the pick into the spec's MSE_WEIGHT and mark it "
                  "measured.")
FLAGS = flags.FLAGS

SPEC_FILE = os.path.join(os.path.dirname(os.path.abspath(spec.__file__)), "dsa_listops.py")


def _is_weight_run(config: dict[str, Any]) -> bool:
  dsa = config.get("attention", {}).get("dsa", {})
  return (config.get("attention", {}).get("kind") == "dsa" and bool(config.get("init_from"))
          and dsa.get("sparsity") == 0.9 and dsa.get("granularity", "fine") == "fine"
          and dsa.get("sigma") == spec.DSA["attention.dsa.sigma"]
          and dsa.get("quant_bits") == spec.DSA["attention.dsa.quant_bits"]
          and dsa.get("mse_normalization") == spec.DSA["attention.dsa.mse_normalization"]
          and dsa.get("mse_weight") in spec.WEIGHTS and config.get("seed") in spec.WEIGHT_SEEDS)


def measure(root: str) -> dict[float, list[tuple[int, float, float]]]:
  """{weight: [(seed, val accuracy, val hit rate), ...]} of the preset's finished runs."""
  if not os.path.isdir(root):
    raise FileNotFoundError(f"--root={root} is not a directory")
  found: dict[float, list[tuple[int, float, float]]] = collections.defaultdict(list)
  unfinished = []
  for name in sorted(os.listdir(root)):
    workdir = os.path.join(root, name)
    if not os.path.isfile(os.path.join(workdir, workdir_lib.CONFIG_FILE)):
      continue
    config = workdir_lib.read_config(workdir)
    if not _is_weight_run(config):
      continue
    if not workdir_lib.is_finished(workdir):
      unfinished.append(name)
      continue
    val = workdir_lib.read_result(workdir).get("val", {})
    if "accuracy" not in val or "dsa_hit_rate" not in val:
      raise ValueError(f"{workdir}/{workdir_lib.RESULT_FILE}: no validation accuracy or "
                       "dsa_hit_rate")
    found[config["attention"]["dsa"]["mse_weight"]].append(
        (config["seed"], float(val["accuracy"]), float(val["dsa_hit_rate"])))
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
