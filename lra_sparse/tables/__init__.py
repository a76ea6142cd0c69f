r"""Rebuilds a results table (and a plot) from run logs alone.

``python -m lra_sparse.tables --root=ROOT --spec=experiments/specs/<spec>.py[:preset]`` (see
``__main__``); a spec file builds its table from the names exported here
(``from lra_sparse.tables import Selector, Table``). The modules: ``spec`` (the spec types),
``runs`` (reading run workdirs), ``cells`` (placing runs in cells, a cell's text), ``render``
(markdown, LaTeX, CSV; ``make_table``), ``plot``, ``curves`` (each cell's learning curve from
metrics.jsonl; ``make_curves``) and ``__main__`` (the command line).

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
``— (1 unfinished)``. Accuracies are multiplied by ``Table.scale`` (100: percent). A row's
``paper`` values add ``paper X, Δ D`` (our mean minus the published value), its ``versus``
``Δ vs X D`` (our mean minus another row's, same column: a fine-tune against its
from-scratch twin, a sparse kind against dense), and finished runs whose last-step test is
more than ``Table.collapse_margin`` under their best-validation test are counted
``k collapsed``, and those whose last-step test put at least ``Table.one_class_share`` of the
examples in one predicted class ``k one-class`` (a run that never learned shows as a number
otherwise: its last step is its best).

Problems in the logs (invalid JSON lines in metrics.jsonl, unreadable config.json/result.json,
a run matching two rows) are reported as ``warning: FILE:LINE: ...`` on stderr and skipped.
"""
from lra_sparse.tables.cells import (MISSING_MARK, PLUS_MINUS, POOLABLE_KEYS, CellStats,
                                     build_cells, check_pooling, format_cell, matches)
from lra_sparse.tables.curves import CellCurve, CurvePoint, cell_curves, make_curves
from lra_sparse.tables.plot import draw_plot, plot_points
from lra_sparse.tables.render import (CSV_HEADER, RENDERERS, legend, make_table, markdown_grid,
                                      render_csv, render_latex, render_markdown)
from lra_sparse.tables.runs import Reporter, RunRecord, find_runs, load_run
from lra_sparse.tables.spec import Plot, Selector, Table, load_table

__all__ = ["MISSING_MARK", "PLUS_MINUS", "POOLABLE_KEYS", "CellStats", "build_cells",
           "check_pooling", "format_cell", "matches", "draw_plot", "plot_points", "CSV_HEADER",
           "RENDERERS", "legend", "make_table", "markdown_grid", "render_csv", "render_latex",
           "render_markdown", "Reporter", "RunRecord", "find_runs", "load_run", "Plot",
           "Selector", "Table", "load_table", "CellCurve", "CurvePoint", "cell_curves",
           "make_curves"]
