"""Draws a table's plot: the metric against ``Plot.x``, one error-bar line per series."""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from lra_sparse.tables.cells import PLUS_MINUS, CellStats, matches
from lra_sparse.tables.runs import Reporter, RunRecord
from lra_sparse.tables.spec import Plot, Table


def plot_points(plot: Plot, runs: Sequence[RunRecord], scale: float,
                where: Mapping[str, Any] = ()) -> dict[str, list[tuple[Any, CellStats]]]:
  """Per series: [(x, stats of finished runs at that x)], sorted by x; runs without x skipped."""
  points = {}
  for series in plot.series:
    by_x: dict[Any, CellStats] = {}
    for run in runs:
      if not (matches(run.config, dict(where)) and matches(run.config, series.match)):
        continue
      x = plot.x(run.config) if callable(plot.x) else run.config.get(plot.x)
      if x is None:
        continue
      x = round(x, 12) if isinstance(x, float) else x
      cell = by_x.setdefault(x, CellStats([], 0, 0))
      if run.status == "finished":
        cell.values.append(run.value * scale)
    points[series.label] = sorted(((x, c) for x, c in by_x.items() if c.n),
                                  key=lambda item: (isinstance(item[0], str), item[0]))
  return points


def draw_plot(table: Table, runs: Sequence[RunRecord], path: str, report: Reporter) -> None:
  if table.plot is None:
    raise ValueError(f"table {table.title!r} defines no plot (Table.plot)")
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  plot = table.plot
  points = plot_points(plot, runs, table.scale, table.where)
  figure, axes = plt.subplots(figsize=(6.0, 4.0), dpi=120)
  all_x = sorted({x for series in points.values() for x, _ in series},
                 key=lambda x: (isinstance(x, str), x))
  categorical = any(isinstance(x, str) for x in all_x)
  position = {x: i for i, x in enumerate(all_x)} if categorical else None
  drawn = 0
  for label, series in points.items():
    if not series:
      report(f"plot series {label!r}: no finished run with an x value; not drawn")
      continue
    xs = [position[x] if categorical else x for x, _ in series]
    means = [cell.mean for _, cell in series]
    errors = [cell.std or 0.0 for _, cell in series]
    counts = sorted({cell.n for _, cell in series})
    n_text = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    axes.errorbar(xs, means, yerr=errors, marker="o", capsize=4, label=f"{label} (n={n_text})")
    drawn += 1
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, baseline in enumerate(plot.baselines):
    cell = CellStats([], 0, 0)
    for run in runs:
      if (run.status == "finished" and matches(run.config, table.where)
          and matches(run.config, baseline.match)):
        cell.values.append(run.value * table.scale)
    if not cell.n:
      report(f"plot baseline {baseline.label!r}: no finished run; not drawn")
      continue
    color = colors[(drawn + i) % len(colors)]
    axes.axhline(cell.mean, color=color, linestyle="--", label=f"{baseline.label} (n={cell.n})")
    if cell.std:
      axes.axhspan(cell.mean - cell.std, cell.mean + cell.std, color=color, alpha=0.15)
  if categorical:
    axes.set_xticks(range(len(all_x)), [str(x) for x in all_x])
  else:
    axes.set_xscale(plot.xscale)
    if all_x:
      axes.set_xticks(all_x, [f"{x:g}" for x in all_x])
  axes.set_xlabel(plot.xlabel or (plot.x if isinstance(plot.x, str) else "x"))
  axes.set_ylabel(plot.ylabel or f"{table.split} {table.metric}"
                  + (" (%)" if table.scale == 100 else ""))
  axes.set_title(plot.title or table.title, fontsize=10)
  axes.grid(alpha=0.3)
  if axes.get_legend_handles_labels()[0]:
    axes.legend(fontsize=8)
  else:
    axes.text(0.5, 0.5, "no finished runs", ha="center", va="center", transform=axes.transAxes)
  figure.text(0.99, 0.01, f"mean {PLUS_MINUS} sample std over seeds", ha="right", va="bottom",
              fontsize=7, color="gray")
  save_figure(figure, path)


def make_parent(path: str) -> None:
  """Creates the folder an output file goes in (none for a bare file name)."""
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)


def save_figure(figure, path: str) -> None:
  """Lays the figure out, writes it to ``path`` (its folder created) and closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  figure.tight_layout()
  make_parent(path)
  figure.savefig(path)
  plt.close(figure)
