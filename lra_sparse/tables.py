r"""Rebuilds a results table (and a plot) from run logs alone.

Usage (from the repository root)::

  python -m lra_sparse.tables --root=runs/dfss_table4 --spec=experiments/specs/dfss_table4.py \
      --format=markdown [--out=FILE] [--plot=FILE.png]

The root is searched recursively for run workdirs (a directory with ``config.json``); nothing
else (not the sweep manifest, not directory names) is used to place a run. A table spec is a
python file whose ``get_table(preset="")`` returns a :class:`Table`: rows and columns are
:class:`Selector`\ s, each a label and a matcher on the run's flattened config
(``{"attention.kind": "dfss", "attention.dfss.nm": "1:2"}``; a list value means "any of", a
callable is a predicate, ``None`` matches a run whose config lacks the key, e.g. a field of
another attention kind). A run lands in cell (row, column) when it matches both. Configs
written before each attention kind had its own block are read in the current layout
(``lra_sparse.config.upgrade_legacy_config``), so old roots work with current specs.

A run is
- finished: ``result.json`` holds ``[split][metric]`` (default ``test`` / ``accuracy``). When
  ``result.json`` exists but is unreadable, the last ``split == test`` record of metrics.jsonl
  with the metric stands in (and a warning says so);
- failed: no result, and the sweep wrote ``sweep_error.txt`` (other than for a Ctrl-C, exit
  code 130, after which the run resumes: unfinished);
- unfinished: anything else (running, interrupted, or result.json unusable).

Cells: ``mean ± std (n=K)`` over the K finished runs (std = SAMPLE standard deviation, ddof=1,
which needs K >= 2; with K == 1 the cell is ``mean (n=1)``); ``—`` when no run finished. Runs
that did not finish are appended to the parentheses: ``(n=2, 1 unfinished, 1 failed)`` or
``— (1 unfinished)``. Accuracies are multiplied by ``Table.scale`` (100: percent).

Problems in the logs (invalid JSON lines in metrics.jsonl, unreadable config.json/result.json,
a run matching two rows) are reported as ``warning: FILE:LINE: ...`` on stderr and skipped.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from absl import app
from absl import flags

from lra_sparse import cli
from lra_sparse import config as config_lib
from lra_sparse import workdir as workdir_lib

MISSING_MARK = "—"
PLUS_MINUS = "±"


@dataclasses.dataclass
class Selector:
  """A labelled matcher on flattened config keys (a table row/column or a plot series)."""
  label: str
  match: Mapping[str, Any] = dataclasses.field(default_factory=dict)


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


@dataclasses.dataclass
class RunRecord:
  workdir: str
  config: dict[str, Any]              # flattened: {"attention.kind": ..., "task": ...}
  status: str                         # "finished" | "unfinished" | "failed"
  value: float | None                 # the metric (unscaled) when finished
  last_step: int | None


@dataclasses.dataclass
class CellStats:
  values: list[float]                 # scaled
  unfinished: int
  failed: int
  runs: list = dataclasses.field(default_factory=list)     # the finished RunRecords
  pooling: list = dataclasses.field(default_factory=list)  # why pooling them is suspect

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


class Reporter:
  """Collects warnings (``FILE:LINE: message``) and echoes them to stderr."""

  def __init__(self, echo: bool = True):
    self.messages: list[str] = []
    self.echo = echo

  def __call__(self, message: str) -> None:
    self.messages.append(message)
    if self.echo:
      print(f"warning: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------- reading logs


def _metric_from_result(result: Any, split: str, metric: str) -> float | None:
  try:
    value = result[split][metric]
  except (KeyError, TypeError, IndexError):
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    return None
  return float(value)


def load_run(workdir: str, split: str, metric: str, report: Reporter) -> RunRecord | None:
  config_path = os.path.join(workdir, workdir_lib.CONFIG_FILE)
  try:
    config = workdir_lib.read_config(workdir)
  except (OSError, ValueError) as e:
    report(f"{config_path}:1: unreadable config ({e}); run skipped")
    return None
  metrics_path = os.path.join(workdir, workdir_lib.METRICS_FILE)
  records = workdir_lib.read_metrics(workdir, report)
  last_step = max((int(r["step"]) for _, r in records
                   if isinstance(r["step"], (int, float))), default=None)
  result_path = os.path.join(workdir, workdir_lib.RESULT_FILE)
  value, status = None, "unfinished"
  if os.path.exists(result_path):
    try:
      result = workdir_lib.read_result(workdir)
      value = _metric_from_result(result, split, metric)
      if value is None:
        report(f"{result_path}:1: no numeric [{split!r}][{metric!r}]")
    except (OSError, ValueError) as e:
      report(f"{result_path}:1: unreadable ({e.__class__.__name__}: {e})")
    if value is None:
      fallback = [(n, r) for n, r in records
                  if r.get("split") == split and _metric_from_result({split: r}, split, metric)
                  is not None]
      if fallback:
        line_number, record = fallback[-1]
        value = float(record[metric])
        report(f"{result_path}:1: using {metrics_path}:{line_number} "
               f"(step {record['step']}) instead")
      else:
        report(f"{result_path}:1: no usable {split} {metric} in result.json or metrics.jsonl; "
               "run counted as unfinished")
    if value is not None:
      status = "finished"
  elif os.path.exists(os.path.join(workdir, workdir_lib.ERROR_FILE)):
    status = "unfinished" if workdir_lib.was_interrupted(workdir) else "failed"
  return RunRecord(workdir=workdir, config=config_lib.flatten_config(config), status=status,
                   value=value, last_step=last_step)


def find_runs(root: str, split: str = "test", metric: str = "accuracy",
              report: Reporter | None = None) -> list[RunRecord]:
  """Every run workdir under root (a directory holding config.json), sorted by path."""
  report = report or Reporter()
  if not os.path.isdir(root):
    raise FileNotFoundError(f"run root {root!r} is not a directory")
  runs = []
  for directory, subdirs, files in os.walk(root):
    subdirs.sort()
    if workdir_lib.CONFIG_FILE in files:
      run = load_run(directory, split, metric, report)
      if run is not None:
        runs.append(run)
      subdirs[:] = []       # a workdir's subfolders (checkpoints/) hold no other runs
  return sorted(runs, key=lambda r: r.workdir)


# ----------------------------------------------------------------------------- matching


def _value_matches(actual: Any, expected: Any) -> bool:
  if expected is None or actual is None:
    return expected is None and actual is None
  if callable(expected):
    return bool(expected(actual))
  if isinstance(expected, (list, tuple, set, frozenset)):
    return any(_value_matches(actual, option) for option in expected)
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


def build_cells(table: Table, runs: Sequence[RunRecord],
                report: Reporter) -> dict[tuple[int, int], CellStats]:
  _check_keys(table, runs, report)
  cells = {(r, c): CellStats([], 0, 0)
           for r in range(len(table.rows)) for c in range(len(table.columns))}
  for run in runs:
    if not matches(run.config, table.where):
      continue
    row_hits = [i for i, row in enumerate(table.rows) if matches(run.config, row.match)]
    column_hits = [i for i, col in enumerate(table.columns) if matches(run.config, col.match)]
    if len(row_hits) > 1:
      report(f"{os.path.join(run.workdir, workdir_lib.CONFIG_FILE)}:1: matches rows "
             f"{[table.rows[i].label for i in row_hits]}; counted in each")
    if len(column_hits) > 1:
      report(f"{os.path.join(run.workdir, workdir_lib.CONFIG_FILE)}:1: matches columns "
             f"{[table.columns[i].label for i in column_hits]}; counted in each")
    for r in row_hits:
      for c in column_hits:
        cell = cells[(r, c)]
        if run.status == "finished":
          cell.values.append(run.value * table.scale)
          cell.runs.append(run)
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
  return cells


# ----------------------------------------------------------------------------- formatting


def format_cell(cell: CellStats, decimals: int, plus_minus: str = PLUS_MINUS,
                missing: str = MISSING_MARK) -> str:
  notes = [f"! {problem}" for problem in cell.pooling]
  if cell.unfinished:
    notes.append(f"{cell.unfinished} unfinished")
  if cell.failed:
    notes.append(f"{cell.failed} failed")
  if not cell.n:
    return f"{missing} ({', '.join(notes)})" if notes else missing
  text = f"{cell.mean:.{decimals}f}"
  if cell.std is not None:
    text += f" {plus_minus} {cell.std:.{decimals}f}"
  return f"{text} ({', '.join([f'n={cell.n}', *notes])})"


def _average_columns(table: Table) -> list[int]:
  if table.average is True:
    return list(range(len(table.columns)))
  labels = [column.label for column in table.columns]
  unknown = [label for label in (table.average or ()) if label not in labels]
  if unknown:
    raise ValueError(f"table {table.title!r}: average names unknown columns {unknown}")
  return [labels.index(label) for label in (table.average or ())]


def _row_average(table: Table, cells: Mapping[tuple[int, int], CellStats], r: int) -> float | None:
  means = [cells[(r, c)].mean for c in _average_columns(table)]
  if any(mean is None for mean in means):
    return None
  return math.fsum(means) / len(means)


def legend(table: Table) -> str:
  unit = "%" if table.scale == 100 else f"x{table.scale:g}"
  return (f"Cells: mean {PLUS_MINUS} sample std (ddof=1) of {table.split} {table.metric} ({unit}) "
          f"over finished runs (seeds); n = finished runs; {MISSING_MARK} = no finished run; "
          "'k unfinished' = runs started without result.json; 'k failed' = runs the sweep "
          "recorded as failed; '! ...' = the cell averages runs it should not (a repeated "
          "seed, or configs that differ outside the table's rows and columns)." + (
              f" {table.average_label} = mean of the column means of "
              f"{', '.join(table.columns[c].label for c in _average_columns(table))}, "
              "when each has a finished run." if table.average else ""))


def _grid(table: Table, cells: Mapping[tuple[int, int], CellStats], plus_minus: str,
          missing: str) -> tuple[list[str], list[list[str]]]:
  header = [table.row_header] + [column.label for column in table.columns]
  if table.average:
    header.append(table.average_label)
  body = []
  for r, row in enumerate(table.rows):
    line = [row.label] + [format_cell(cells[(r, c)], table.decimals, plus_minus, missing)
                          for c in range(len(table.columns))]
    if table.average:
      average = _row_average(table, cells, r)
      line.append(missing if average is None else f"{average:.{table.decimals}f}")
    body.append(line)
  return header, body


def markdown_grid(header: Sequence[str], body: Sequence[Sequence[str]], *,
                  center: bool = False) -> str:
  """A markdown table: ``|`` in cells escaped; with ``center``, every column but the first
  centred."""
  escape = lambda text: str(text).replace("|", "\\|")  # noqa: E731
  rule = ["---"] + [":---:" if center else "---"] * (len(header) - 1)
  lines = ["| " + " | ".join(map(escape, header)) + " |", "|" + "|".join(rule) + "|"]
  lines += ["| " + " | ".join(map(escape, line)) + " |" for line in body]
  return "\n".join(lines)


def render_markdown(table: Table, cells: Mapping[tuple[int, int], CellStats]) -> str:
  header, body = _grid(table, cells, PLUS_MINUS, MISSING_MARK)
  return "\n".join([f"### {table.title}", "", markdown_grid(header, body, center=True), "",
                    legend(table), ""])


def _latex_escape(text: str) -> str:
  for char, replacement in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"),
                            ("_", r"\_"), ("#", r"\#"), ("$", r"\$"), ("{", r"\{"),
                            ("}", r"\}")):
    text = text.replace(char, replacement)
  return text


def render_latex(table: Table, cells: Mapping[tuple[int, int], CellStats]) -> str:
  header, body = _grid(table, cells, "@@PM@@", "@@MISSING@@")
  fix = lambda text: (_latex_escape(text).replace("@@PM@@", r"$\pm$")
                      .replace("@@MISSING@@", "--"))
  lines = [f"% {legend(table)}", r"\begin{table}[t]", r"\centering",
           rf"\caption{{{_latex_escape(table.title)}}}",
           r"\begin{tabular}{l" + "c" * (len(header) - 1) + "}", r"\toprule",
           " & ".join(map(fix, header)) + r" \\", r"\midrule"]
  lines += [" & ".join(map(fix, line)) + r" \\" for line in body]
  lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
  return "\n".join(lines)


CSV_HEADER = ("row", "column", "n", "mean", "std", "unfinished", "failed", "cell")


def render_csv(table: Table, cells: Mapping[tuple[int, int], CellStats]) -> str:
  """Long format, one line per cell: mean/std rounded to 6 decimals, empty when undefined."""
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(CSV_HEADER)
  number = lambda value: "" if value is None else f"{value:.6f}"
  for r, row in enumerate(table.rows):
    for c, column in enumerate(table.columns):
      cell = cells[(r, c)]
      writer.writerow([row.label, column.label, cell.n, number(cell.mean), number(cell.std),
                       cell.unfinished, cell.failed,
                       format_cell(cell, table.decimals)])
  return out.getvalue()


RENDERERS: dict[str, Callable[[Table, Mapping[tuple[int, int], CellStats]], str]] = {
    "markdown": render_markdown, "latex": render_latex, "csv": render_csv}


# ----------------------------------------------------------------------------- plotting


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
  figure.tight_layout()
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  figure.savefig(path)
  plt.close(figure)


# ----------------------------------------------------------------------------- entry points


def load_table(spec_arg: str) -> Table:
  table = config_lib.call_spec_function(spec_arg, "get_table")
  if not isinstance(table, Table):
    raise ValueError(f"{spec_arg}: get_table() must return lra_sparse.tables.Table, "
                     f"got {type(table).__name__}")
  if not table.rows or not table.columns:
    raise ValueError(f"{spec_arg}: a table needs at least one row and one column")
  return table


def make_table(root: str, spec_arg: str, fmt: str, plot_path: str = "",
               report: Reporter | None = None) -> str:
  """The rendered table (and the plot written to ``plot_path`` when given)."""
  if fmt not in RENDERERS:
    raise ValueError(f"unknown format {fmt!r}; known: {', '.join(RENDERERS)}")
  report = report or Reporter()
  table = load_table(spec_arg)
  runs = find_runs(root, table.split, table.metric, report)
  if not runs:
    report(f"{root}: no run directory (config.json) found")
  cells = build_cells(table, runs, report)
  if plot_path:
    draw_plot(table, runs, plot_path, report)
  return RENDERERS[fmt](table, cells)


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a program, so importing this module (specs do) adds no flags."""
  flags.DEFINE_string("root", None, "Directory searched recursively for run workdirs.")
  flags.DEFINE_string("spec", None,
                      "Table spec: experiments/specs/<name>.py[:preset] with get_table().")
  flags.DEFINE_enum("format", "markdown", list(RENDERERS), "Output format.")
  flags.DEFINE_string("out", "", "Write the table here instead of stdout.")
  flags.DEFINE_string("plot", "", "Also draw the spec's plot to this PNG file.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS.root or not FLAGS.spec:
    raise app.UsageError("--root and --spec are required")
  text = make_table(FLAGS.root, FLAGS.spec, FLAGS.format, FLAGS.plot)
  if FLAGS.out:
    directory = os.path.dirname(FLAGS.out)
    if directory:
      os.makedirs(directory, exist_ok=True)
    with open(FLAGS.out, "w") as f:
      f.write(text)
  else:
    sys.stdout.write(text)


if __name__ == "__main__":
  # Through the imported module: the spec's Table/Selector classes must be this module's.
  from lra_sparse import tables as _tables_module  # pylint: disable=g-import-not-at-top
  _tables_module.define_flags()
  cli.run(_tables_module.main)
