"""A table spec: the table's rows and columns, and its plot.

A table spec is a python file whose ``get_table(preset="")`` returns a :class:`Table`; rows and
columns are :class:`Selector` objects (a label and a matcher on a run's flattened config), and
``Table.plot`` an optional :class:`Plot`. The spec is loaded by path (:func:`load_table`); it
imports these classes from ``lra_sparse.tables``, the very ones checked here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from lra_sparse import config as config_lib


@dataclasses.dataclass
class Selector:
  """A labelled matcher on flattened config keys (a table row/column or a plot series).

  ``paper`` (rows): the published value of this row per column label, in the table's units
  (e.g. ``{"ListOps": 36.37}``); the rendered cell shows it and our mean minus it.
  ``versus`` (rows): ``{name: label of another row}``; each cell also shows ``Δ name D``, our
  mean minus that row's mean in the same column (e.g. a fine-tune against its from-scratch
  twin), where both have finished runs."""
  label: str
  match: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  paper: Mapping[str, float] = dataclasses.field(default_factory=dict)
  versus: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Plot:
  """Metric against ``x``: one error-bar line per series, dashed lines (± std band) for baselines.

  ``x`` is a flattened config key (``"attention.dsa.sparsity"``) or a function of the flattened
  config (e.g. the fraction of attention scores a kind drops); runs where it is missing/None are
  left out of the series.
  """
  x: str | Callable[[Mapping[str, Any]], Any]
  series: Sequence[Selector]
  baselines: Sequence[Selector] = ()
  xlabel: str = ""
  ylabel: str = ""
  title: str = ""
  xscale: str = "linear"


@dataclasses.dataclass
class Table:
  title: str
  rows: Sequence[Selector]
  columns: Sequence[Selector]
  metric: str = "accuracy"
  split: str = "test"
  scale: float = 100.0
  decimals: int = 2
  row_header: str = "Model"
  # An "Avg" column: mean of the column means; True = all columns, or a list of column labels.
  average: bool | Sequence[str] = False
  average_label: str = "Avg"
  where: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # filter on every run
  plot: Plot | None = None
  # A finished run "collapsed" when its last-step test is more than this many points (table
  # units) under its test at the best validation step; cells count such runs.
  collapse_margin: float = 1.5
  # A finished run is "one-class" when its last-step test predictions put at least this share
  # of the examples in one class (``predicted_<c>`` in result.json; a model that never learned,
  # or fell back to the majority class); cells count such runs.
  one_class_share: float = 0.99
  paper_source: str = ""      # where the rows' paper values come from (shown in the legend)


def load_table(spec_arg: str) -> Table:
  table = config_lib.call_spec_function(spec_arg, "get_table")
  if not isinstance(table, Table):
    raise ValueError(f"{spec_arg}: get_table() must return lra_sparse.tables.Table, "
                     f"got {type(table).__name__}")
  if not table.rows or not table.columns:
    raise ValueError(f"{spec_arg}: a table needs at least one row and one column")
  labels = {column.label for column in table.columns}
  for row in table.rows:
    unknown = sorted(set(row.paper) - labels)
    if unknown:
      raise ValueError(f"{spec_arg}: row {row.label!r} gives paper values for {unknown}, "
                       f"which are not columns ({sorted(labels)})")
    bad = {k: v for k, v in row.paper.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v}
    if bad:
      raise ValueError(f"{spec_arg}: row {row.label!r}: paper values must be numbers, got {bad}")
  row_labels = [row.label for row in table.rows]
  for row in table.rows:
    for name, other in row.versus.items():
      if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{spec_arg}: row {row.label!r}: versus names must be non-empty "
                         f"strings, got {name!r}")
      if other == row.label or row_labels.count(other) != 1:
        raise ValueError(
            f"{spec_arg}: row {row.label!r}: versus {name!r} names {other!r}, which is "
            + ("the row itself" if other == row.label else
               "not one row of the table" + (f" (rows: {row_labels})"
                                             if other not in row_labels else " (repeated)")))
  return table
