"""Renders a table as text (markdown, LaTeX or CSV); ``make_table`` builds it from a root."""
from __future__ import annotations

import csv
import io
import math
from typing import Callable, Mapping, Sequence

from lra_sparse.tables.cells import (MISSING_MARK, PLUS_MINUS, CellStats, build_cells,
                                     format_cell)
from lra_sparse.tables.plot import draw_plot
from lra_sparse.tables.runs import Reporter, find_runs
from lra_sparse.tables.spec import Table, load_table


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


def legend(table: Table, cells: Mapping[tuple[int, int], CellStats]) -> str:
  unit = "%" if table.scale == 100 else f"x{table.scale:g}"
  return (f"Cells: mean {PLUS_MINUS} sample std (ddof=1) of {table.split} {table.metric} ({unit}) "
          f"over finished runs (seeds); n = finished runs; {MISSING_MARK} = no finished run; "
          "'k unfinished' = runs started without result.json; 'k failed' = runs the sweep "
          "recorded as failed; '! ...' = the cell averages runs it should not (a repeated "
          "seed, or configs that differ outside the table's rows and columns); 'k collapsed' "
          f"= finished runs whose last-step test is more than {table.collapse_margin:g} points "
          "under their test at the best validation step; 'paper X, Δ D' = the published value "
          "and our mean minus it" + (f" ({table.paper_source})" if table.paper_source else "")
          + (f"; 'k one-class' = finished runs whose last-step test put at least "
             f"{table.one_class_share:.0%} of the examples in one predicted class"
             if any(cell.one_class for cell in cells.values()) else "")
          + ("; 'Δ vs X D' = our mean minus the mean of the row X names (the spec's "
             "Selector.versus), in the same column" if any(row.versus for row in table.rows)
             else "")
          + "." + (
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
                    legend(table, cells), ""])


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
  lines = [f"% {legend(table, cells)}", r"\begin{table}[t]", r"\centering",
           rf"\caption{{{_latex_escape(table.title)}}}",
           r"\begin{tabular}{l" + "c" * (len(header) - 1) + "}", r"\toprule",
           " & ".join(map(fix, header)) + r" \\", r"\midrule"]
  lines += [" & ".join(map(fix, line)) + r" \\" for line in body]
  lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
  return "\n".join(lines)


CSV_HEADER = ("row", "column", "n", "mean", "std", "unfinished", "failed", "collapsed",
              "one_class", "paper", "delta", "cell")


def render_csv(table: Table, cells: Mapping[tuple[int, int], CellStats]) -> str:
  """Long format, one line per cell: mean/std rounded to 6 decimals, empty when undefined."""
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(CSV_HEADER)
  number = lambda value: "" if value is None else f"{value:.6f}"
  for r, row in enumerate(table.rows):
    for c, column in enumerate(table.columns):
      cell = cells[(r, c)]
      delta = None if cell.paper is None or cell.mean is None else cell.mean - cell.paper
      writer.writerow([row.label, column.label, cell.n, number(cell.mean), number(cell.std),
                       cell.unfinished, cell.failed, cell.collapsed, cell.one_class,
                       number(cell.paper),
                       number(delta), format_cell(cell, table.decimals)])
  return out.getvalue()


RENDERERS: dict[str, Callable[[Table, Mapping[tuple[int, int], CellStats]], str]] = {
    "markdown": render_markdown, "latex": render_latex, "csv": render_csv}


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
