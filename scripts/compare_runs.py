"""Compares runs of one config from their logs: loss curves, and what each workdir holds.

  python -m scripts.compare_runs WORKDIR [WORKDIR ...]   # the first is the reference
  python -m scripts.compare_runs --manifest=ROOT/sweep.json
  python -m scripts.compare_runs --plot=curves.png WORKDIR [WORKDIR ...]

Workdirs: the train loss at a few logged steps, the largest difference to the first workdir's
curve over the steps they share, steps/s, and what was written: train records per step (1 =
logged once), the checkpoint steps, the TensorBoard event files. Used to show that a run
trained by two processes (``jax.distributed``) matches one process with two devices and writes
its logs and checkpoints once.
Plot: validation accuracy and train loss against the step, one line per workdir (a step logged
more than once, as a run restarted from an older checkpoint logs it, takes its last record).
Manifest: each run's GPU slot, start, end and wall time, and whether the runs overlapped (ran
at once), from a sweep's ``sweep.json``.
"""
from __future__ import annotations

import collections
import datetime
import json
import os
from typing import Sequence

from absl import flags
import numpy as np

from lra_sparse import cli
from lra_sparse import tables
from lra_sparse import workdir as workdir_lib

flags.DEFINE_string("manifest", "", "A sweep's sweep.json: report its runs' slots and times.")
flags.DEFINE_string("plot", "", "Also draw the workdirs' validation accuracy and train loss "
                    "curves to this PNG file.")
FLAGS = flags.FLAGS

MARKS = (10, 50, 100, 150, 200)


def train_records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: {workdir} is not a run directory")
  with open(path) as f:
    return [r for r in map(json.loads, f) if r.get("split") == "train"]


def workdir_rows(workdirs: Sequence[str]) -> list[tuple]:
  curves = []
  for workdir in workdirs:
    records = train_records(workdir)
    if not records:
      raise ValueError(f"{workdir}: metrics.jsonl holds no train records")
    curves.append(records)
  reference = {r["step"]: r["loss"] for r in curves[0]}
  rows = []
  for workdir, records in zip(workdirs, curves):
    loss = {r["step"]: r["loss"] for r in records}
    shared = sorted(set(loss) & set(reference))
    diff = max(abs(loss[s] - reference[s]) for s in shared)
    per_step = collections.Counter(r["step"] for r in records)
    checkpoints = os.path.join(workdir, "checkpoints")
    saved = sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit()) \
        if os.path.isdir(checkpoints) else []
    events = [f for f in os.listdir(workdir) if f.startswith("events.out.tfevents")]
    speed = [r["steps_per_sec"] for r in records if "steps_per_sec" in r]
    rows.append((os.path.basename(os.path.normpath(workdir)),
                 *(f"{loss[m]:.4f}" if m in loss else "-" for m in MARKS),
                 f"{diff:.2e} ({len(shared)} steps)",
                 f"{np.median(speed):.2f}" if speed else "-",
                 f"{min(per_step.values())}-{max(per_step.values())}",
                 ",".join(map(str, saved)) or "none", str(len(events))))
  return rows


def _curve(workdir: str, split: str, key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of ``key`` in the ``split`` records, the last record of each step."""
  last = {r["step"]: r[key] for _, r in workdir_lib.read_metrics(workdir)
          if r["split"] == split and key in r}
  steps = sorted(last)
  return steps, [last[s] for s in steps]


def plot_curves(workdirs: Sequence[str], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for workdir in workdirs:
    label = os.path.basename(os.path.normpath(workdir))
    axes[0].plot(*_curve(workdir, "val", "accuracy"), label=label)
    axes[1].plot(*_curve(workdir, "train", "loss"), label=label, linewidth=0.8)
  for ax, title in zip(axes, ("validation accuracy", "train loss")):
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


def _time(stamp: str) -> datetime.datetime:
  return datetime.datetime.fromisoformat(stamp)


def manifest_rows(path: str) -> tuple[list[tuple], str]:
  with open(path) as f:
    runs = [r for r in json.load(f)["runs"] if "started" in r]
  if not runs:
    raise ValueError(f"{path}: no run of this sweep has started")
  rows = [(r["name"], str(r.get("slot")), r["started"], r.get("ended", "-"), r.get("state", "-"),
           str(r.get("seconds", "-"))) for r in runs]
  spans = [(_time(r["started"]), _time(r["ended"])) for r in runs if "ended" in r]
  overlap = max(0.0, (min(end for _, end in spans) - max(start for start, _ in spans))
                .total_seconds()) if len(spans) > 1 else 0.0
  slots = {r.get("slot") for r in runs}
  summary = (f"{len(runs)} runs on slots {sorted(map(str, slots))}; all of them ran at once "
             f"for {overlap:.0f} s")
  return rows, summary


def main(argv):
  workdirs = argv[1:]
  if FLAGS.manifest:
    if workdirs:
      raise ValueError("give either --manifest or workdirs, not both")
    rows, summary = manifest_rows(FLAGS.manifest)
    print(tables.markdown_grid(("run", "slot (GPU)", "started", "ended", "state", "seconds"),
                               rows))
    print(f"\n{summary}")
    return
  if not workdirs:
    raise ValueError("no workdirs given (or --manifest=ROOT/sweep.json)")
  header = ("workdir", *(f"loss @{m}" for m in MARKS), "max |diff| vs first",
            "steps/s (median)", "train records per step", "checkpoints", "event files")
  print(tables.markdown_grid(header, workdir_rows(workdirs)))
  if FLAGS.plot:
    plot_curves(workdirs, FLAGS.plot)


if __name__ == "__main__":
  cli.run(main)
