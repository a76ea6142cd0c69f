"""Learning curves of a table's cells: a metric of one split against the training step.

``python -m lra_sparse.tables --root=ROOT --spec=SPEC --curves=FILE.png [--curves_split=val]
[--curves_metric=accuracy] [--curves_csv=FILE.csv]`` draws one panel per table column and one
line per row: at each logged step, the mean of the cell's runs that logged it, and a band from
the lowest to the highest of them. Every run of the cell counts, finished or not (a curve shows
how far a cut run got, which the table's cell cannot); the legend gives the cell's runs and
how many did not finish. The points come from each run's ``metrics.jsonl`` only; a step logged
twice (a run resumed from an older checkpoint logs the steps after it again) takes its last
record. The metric is scaled by ``Table.scale`` when it is the table's own metric (accuracy in
percent), else drawn as logged (a loss). The csv holds the same points, one line per (column,
row, step).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
from typing import Sequence

from lra_sparse import workdir as workdir_lib
from lra_sparse.tables.cells import placement
from lra_sparse.tables.plot import make_parent, save_figure
from lra_sparse.tables.runs import Reporter, RunRecord, find_runs
from lra_sparse.tables.spec import Table, load_table

CSV_HEADER = ("column", "row", "step", "mean", "low", "high", "n")


@dataclasses.dataclass(frozen=True)
class CurvePoint:
  step: int
  mean: float
  low: float
  high: float
  n: int            # runs that logged this step


@dataclasses.dataclass
class CellCurve:
  points: list[CurvePoint]
  runs: int         # the cell's runs with at least one point
  unfinished: int   # of those, the ones that did not finish


def run_curve(workdir: str, split: str, metric: str, report: Reporter) -> dict[int, float]:
  """{step: value} of one run's ``split`` records with ``metric``; a step logged twice keeps its
  last record. A record whose value is not a finite number (a diverged run's NaN) or whose step
  is not a number is reported and skipped."""
  path = os.path.join(workdir, workdir_lib.METRICS_FILE)
  curve = {}
  for line_number, record in workdir_lib.read_metrics(workdir, report):
    if record.get("split") != split or metric not in record:
      continue
    value, step = record[metric], record.get("step")
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or not math.isfinite(value)):
      report(f"{path}:{line_number}: {split} {metric} {value!r} is not a finite number; "
             "point skipped")
    elif isinstance(step, bool) or not isinstance(step, (int, float)):
      report(f"{path}:{line_number}: step {step!r} is not a number; point skipped")
    else:
      curve[int(step)] = float(value)
  return curve


def cell_curves(table: Table, runs: Sequence[RunRecord], split: str, metric: str,
                report: Reporter) -> dict[tuple[int, int], CellCurve]:
  """{(row, column): its curve} for the cells with at least one run that logged a point."""
  scale = table.scale if metric == table.metric else 1.0
  by_cell: dict[tuple[int, int], list[tuple[RunRecord, dict[int, float]]]] = {}
  for run in runs:
    rows, columns = placement(table, run.config)
    if not rows or not columns:
      continue
    curve = run_curve(run.workdir, split, metric, report)
    if not curve:
      report(f"{os.path.join(run.workdir, workdir_lib.METRICS_FILE)}:1: no {split} {metric} "
             "record; no curve")
      continue
    for r in rows:
      for c in columns:
        by_cell.setdefault((r, c), []).append((run, curve))
  curves = {}
  for cell, members in sorted(by_cell.items()):
    steps = sorted(set().union(*(curve for _, curve in members)))
    points = []
    for step in steps:
      values = [curve[step] * scale for _, curve in members if step in curve]
      points.append(CurvePoint(step, math.fsum(values) / len(values), min(values), max(values),
                               len(values)))
    curves[cell] = CellCurve(points, len(members),
                             sum(run.status != "finished" for run, _ in members))
  return curves


def _require_curves(table: Table, curves: dict, split: str, metric: str) -> None:
  if not curves:
    raise ValueError(f"no run of table {table.title!r} logged a {split} {metric}: "
                     "no curve to draw or write")


def render_curves_csv(table: Table, curves: dict[tuple[int, int], CellCurve]) -> str:
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(CSV_HEADER)
  for (r, c), curve in sorted(curves.items(), key=lambda item: (item[0][1], item[0][0])):
    for p in curve.points:
      writer.writerow([table.columns[c].label, table.rows[r].label, p.step, f"{p.mean:.6f}",
                       f"{p.low:.6f}", f"{p.high:.6f}", p.n])
  return out.getvalue()


def draw_curves(table: Table, curves: dict[tuple[int, int], CellCurve], path: str,
                split: str, metric: str, report: Reporter) -> None:
  """One panel per column that has a curve, one line (and min-max band) per row."""
  _require_curves(table, curves, split, metric)
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  columns = sorted({c for _, c in curves})
  # the legend sits under the panels (rows' labels are long): room for one line per row
  figure, axes = plt.subplots(1, len(columns), dpi=120, squeeze=False,
                              figsize=(7.0 * len(columns), 4.0 + 0.2 * len(table.rows)))
  for panel, c in zip(axes[0], columns):
    for r, row in enumerate(table.rows):
      curve = curves.get((r, c))
      if curve is None:
        report(f"curves: ({row.label!r}, {table.columns[c].label!r}) has no run with a "
               f"{split} {metric}; not drawn")
        continue
      steps = [p.step for p in curve.points]
      label = f"{row.label} (runs={curve.runs}" + (
          f", {curve.unfinished} unfinished)" if curve.unfinished else ")")
      line, = panel.plot(steps, [p.mean for p in curve.points], label=label)
      panel.fill_between(steps, [p.low for p in curve.points], [p.high for p in curve.points],
                         color=line.get_color(), alpha=0.15, linewidth=0)
    panel.set_title(table.columns[c].label)
    panel.set_xlabel("step")
    panel.set_ylabel(f"{split} {metric}" + (" (%)" if metric == table.metric
                                             and table.scale == 100 else ""))
    panel.grid(alpha=0.3)
    panel.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
  save_figure(figure, path)


def make_curves(root: str, spec_arg: str, png_path: str = "", csv_path: str = "",
                split: str = "val", metric: str = "", report: Reporter | None = None
                ) -> dict[tuple[int, int], CellCurve]:
  """The curves of the table ``spec_arg`` names over the runs under ``root`` (``metric``
  empty: the table's), drawn to ``png_path`` and written to ``csv_path`` where given."""
  report = report or Reporter()
  table = load_table(spec_arg)
  metric = metric or table.metric
  runs = find_runs(root, table.split, table.metric, report)
  curves = cell_curves(table, runs, split, metric, report)
  _require_curves(table, curves, split, metric)
  if png_path:
    draw_curves(table, curves, png_path, split, metric, report)
  if csv_path:
    make_parent(csv_path)
    with open(csv_path, "w") as f:
      f.write(render_curves_csv(table, curves))
  return curves
