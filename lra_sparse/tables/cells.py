"""Places runs in a table's cells and summarises each cell: ``mean ± std (n=K, ...)``.

A run lands in cell (row, column) when its config matches both selectors (and ``Table.where``).
A cell pools the finished runs' metric; it warns when those runs should not be averaged (a
repeated seed, or configs that differ outside the table's rows and columns).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

from lra_sparse import config as config_lib
from lra_sparse import workdir as workdir_lib
from lra_sparse.tables.runs import Reporter, RunRecord
from lra_sparse.tables.spec import Selector, Table

MISSING_MARK = "—"
PLUS_MINUS = "±"


@dataclasses.dataclass
class CellStats:
  values: list[float]                 # scaled
  unfinished: int
  failed: int
  runs: list = dataclasses.field(default_factory=list)     # the finished RunRecords
  pooling: list = dataclasses.field(default_factory=list)  # why pooling them is suspect
  collapsed: int = 0                  # finished runs far under their best (Table.collapse_margin)
  one_class: int = 0                  # finished runs predicting one class (Table.one_class_share)
  paper: float | None = None          # the published value of this cell, if the spec gives one
  # (name, our mean minus the mean of the row that name stands for): the row's ``versus``
  versus: list = dataclasses.field(default_factory=list)

  @property
  def n(self) -> int:
    return len(self.values)

  @property
  def mean(self) -> float | None:
    return math.fsum(self.values) / self.n if self.values else None

  @property
  def std(self) -> float | None:
    """Sample standard deviation (ddof=1); None with fewer than 2 values."""
    if self.n < 2:
      return None
    mean = self.mean
    return math.sqrt(math.fsum((v - mean) ** 2 for v in self.values) / (self.n - 1))


def _value_matches(actual: Any, expected: Any) -> bool:
  if isinstance(expected, (list, tuple, set, frozenset)):   # before None: [0, None] takes both
    return any(_value_matches(actual, option) for option in expected)
  if expected is None or actual is None:
    return expected is None and actual is None
  if callable(expected):
    return bool(expected(actual))
  if isinstance(expected, bool) or isinstance(actual, bool):
    return type(actual) is type(expected) and actual == expected
  if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
    return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-12)
  return actual == expected


def matches(config: Mapping[str, Any], match: Mapping[str, Any]) -> bool:
  """True when every matcher agrees; a key the config lacks reads as None (so ``None``, alone
  or in a list, matches runs without the key)."""
  return all(_value_matches(config.get(key), expected) for key, expected in match.items())


def _check_keys(table: Table, runs: Sequence[RunRecord], report: Reporter) -> None:
  """Warns about matcher keys that no run's config has (most likely a typo)."""
  if not runs:
    return
  known = set().union(*(run.config for run in runs))
  for selector in _selectors(table, with_plot=True):
    for key in selector.match:
      if key not in known:
        legacy = config_lib.legacy_key_message(key)
        report(f"{selector.label!r}: key {key!r} is in no run's config.json; it matches "
               + ("only runs without it" if _accepts_missing(selector.match[key]) else "nothing")
               + (f" ({legacy})" if legacy else ""))


def _accepts_missing(expected: Any) -> bool:
  return expected is None or (isinstance(expected, (list, tuple, set, frozenset))
                              and any(option is None for option in expected))


# Keys expected to differ between the runs of one cell: the seed, the pretrain a fine-tune
# starts from (one per seed), and what a run records besides its metrics (a profile, W&B).
POOLABLE_KEYS = ("seed", "init_from", "profile_steps", "wandb.project", "wandb.entity")


def _selectors(table: Table, with_plot: bool = False) -> list[Selector]:
  """The table's rows, columns and ``where`` filter (and its plot's series and baselines)."""
  selectors = [*table.rows, *table.columns, Selector("where", table.where)]
  if with_plot and table.plot:
    selectors += [*table.plot.series, *table.plot.baselines]
  return selectors


def _axis_keys(table: Table) -> set[str]:
  return {key for selector in _selectors(table) for key in selector.match}


def check_pooling(cell: CellStats, axis_keys: set[str]) -> list[str]:
  """Why the cell's finished runs should not be averaged: repeated seeds, or configs that
  differ in a key that is not a table axis (nor one of ``POOLABLE_KEYS``)."""
  problems = []
  seeds = [run.config.get("seed") for run in cell.runs]
  repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1}, key=str)
  if repeated:
    problems.append(f"seed {', '.join(map(str, repeated))} repeated")
  keys = set().union(*(run.config for run in cell.runs)) if cell.runs else set()
  missing = object()
  differing = sorted(key for key in keys - axis_keys - set(POOLABLE_KEYS)
                     if len({json.dumps(run.config.get(key, missing), sort_keys=True,
                                        default=repr) for run in cell.runs}) > 1)
  if differing:
    problems.append("configs differ in " + ", ".join(differing))
  return problems


def far_below_best(last: float, best: float, margin: float) -> bool:
  """The collapse rule: a last-step value more than ``margin`` under the value at the best
  validation step (both in the same units). The difference is rounded to 9 decimals first, so
  that a gap of exactly ``margin`` (accuracies are counts over a split: 0.535 - 0.52 is 30
  examples of 2000, 1.5 points) is not called a collapse by floating-point noise."""
  return round(best - last, 9) > margin


def _result(run: RunRecord) -> Mapping[str, Any]:
  """A finished run's ``result.json`` ({} when unreadable: its marks are then not counted)."""
  try:
    result = workdir_lib.read_result(run.workdir)
  except (OSError, ValueError, TypeError):
    return {}
  return result if isinstance(result, dict) else {}


def collapsed(result: Mapping[str, Any], margin: float, scale: float) -> bool:
  """Whether a finished run's last-step test is more than ``margin`` (table units) under its
  test at the best validation step (its ``result.json``; False when either is missing)."""
  try:
    last, best = result["test"]["accuracy"], result["test_at_best_val"]["accuracy"]
  except (KeyError, TypeError):
    return False
  if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (last, best)):
    return False
  return far_below_best(last * scale, best * scale, margin)


def one_class(result: Mapping[str, Any], share: float) -> bool:
  """Whether a finished run's last-step test put at least ``share`` of the examples in one
  predicted class (its ``result.json``'s test ``predicted_<c>``; False for runs that did not
  record them, or for regression metrics)."""
  try:
    shares = [v for k, v in result["test"].items() if k.startswith("predicted_")]
  except (KeyError, TypeError, AttributeError):
    return False
  shares = [v for v in shares if isinstance(v, (int, float)) and math.isfinite(v)]
  return bool(shares) and round(max(shares), 9) >= share


def placement(table: Table, config: Mapping[str, Any]) -> tuple[list[int], list[int]]:
  """(indices of the rows, indices of the columns) a run's config matches; none when it fails
  ``Table.where``. The run counts in every (row, column) pair of them."""
  if not matches(config, table.where):
    return [], []
  return ([i for i, row in enumerate(table.rows) if matches(config, row.match)],
          [i for i, column in enumerate(table.columns) if matches(config, column.match)])


def build_cells(table: Table, runs: Sequence[RunRecord],
                report: Reporter) -> dict[tuple[int, int], CellStats]:
  _check_keys(table, runs, report)
  cells = {(r, c): CellStats([], 0, 0, paper=table.rows[r].paper.get(table.columns[c].label))
           for r in range(len(table.rows)) for c in range(len(table.columns))}
  for run in runs:
    row_hits, column_hits = placement(table, run.config)
    if len(row_hits) > 1:
      report(f"{os.path.join(run.workdir, workdir_lib.CONFIG_FILE)}:1: matches rows "
             f"{[table.rows[i].label for i in row_hits]}; counted in each")
    if len(column_hits) > 1:
      report(f"{os.path.join(run.workdir, workdir_lib.CONFIG_FILE)}:1: matches columns "
             f"{[table.columns[i].label for i in column_hits]}; counted in each")
    if run.status == "finished" and row_hits and column_hits:   # read once, in every cell
      result = _result(run)
      marks = (collapsed(result, table.collapse_margin, table.scale),
               one_class(result, table.one_class_share))
    for r in row_hits:
      for c in column_hits:
        cell = cells[(r, c)]
        if run.status == "finished":
          cell.values.append(run.value * table.scale)
          cell.runs.append(run)
          cell.collapsed += marks[0]
          cell.one_class += marks[1]
        elif run.status == "failed":
          cell.failed += 1
        else:
          cell.unfinished += 1
  axis_keys = _axis_keys(table)
  for (r, c), cell in cells.items():
    cell.pooling = check_pooling(cell, axis_keys)
    if cell.pooling:
      report(f"cell ({table.rows[r].label!r}, {table.columns[c].label!r}) pools unlike runs: "
             f"{'; '.join(cell.pooling)} ({', '.join(run.workdir for run in cell.runs)})")
  row_index = {row.label: r for r, row in enumerate(table.rows)}
  for (r, c), cell in cells.items():
    for name, other in table.rows[r].versus.items():
      theirs = cells[(row_index[other], c)].mean
      if cell.mean is not None and theirs is not None:
        cell.versus.append((name, cell.mean - theirs))
  return cells


def format_cell(cell: CellStats, decimals: int, plus_minus: str = PLUS_MINUS,
                missing: str = MISSING_MARK) -> str:
  notes = [f"! {problem}" for problem in cell.pooling]
  if cell.collapsed:
    notes.append(f"{cell.collapsed} collapsed")
  if cell.one_class:
    notes.append(f"{cell.one_class} one-class")
  if cell.unfinished:
    notes.append(f"{cell.unfinished} unfinished")
  if cell.failed:
    notes.append(f"{cell.failed} failed")
  if cell.paper is not None:
    notes.append(f"paper {cell.paper:.{decimals}f}")
    if cell.n:
      notes.append(f"Δ {cell.mean - cell.paper:+.{decimals}f}")
  notes += [f"Δ {name} {delta:+.{decimals}f}" for name, delta in cell.versus]
  if not cell.n:
    return f"{missing} ({', '.join(notes)})" if notes else missing
  text = f"{cell.mean:.{decimals}f}"
  if cell.std is not None:
    text += f" {plus_minus} {cell.std:.{decimals}f}"
  return f"{text} ({', '.join([f'n={cell.n}', *notes])})"
