r"""The table builder's command line.

Usage (from the repository root)::

  python -m lra_sparse.tables --root=runs/dfss_table4 --spec=experiments/specs/dfss_table4.py \
      --format=markdown [--out=FILE] [--plot=FILE.png] \
      [--curves=FILE.png] [--curves_csv=FILE.csv] [--curves_split=val] [--curves_metric=loss]

``--curves`` / ``--curves_csv``: each cell's learning curve (``lra_sparse.tables.curves``).

The table spec is loaded by path (``lra_sparse.tables.spec``); the ``Table`` and ``Selector``
classes it imports from ``lra_sparse.tables`` are the ones checked here, as this file is not
the module that defines them. User errors are one line ``error: ...`` (``lra_sparse.cli``).
"""
from __future__ import annotations

import sys
from typing import Sequence

from absl import app
from absl import flags

from lra_sparse import cli
from lra_sparse.tables.curves import make_curves
from lra_sparse.tables.plot import make_parent
from lra_sparse.tables.render import RENDERERS, make_table
from lra_sparse.tables.runs import Reporter

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a program: importing this module adds no flags."""
  flags.DEFINE_string("root", None, "Directory searched recursively for run workdirs.")
  flags.DEFINE_string("spec", None,
                      "Table spec: experiments/specs/<name>.py[:preset] with get_table().")
  flags.DEFINE_enum("format", "markdown", list(RENDERERS), "Output format.")
  flags.DEFINE_string("out", "", "Write the table here instead of stdout.")
  flags.DEFINE_string("plot", "", "Also draw the spec's plot to this PNG file.")
  flags.DEFINE_string("curves", "", "Also draw each cell's learning curve (the mean over its "
                      "runs against the step, one panel per column) to this PNG file.")
  flags.DEFINE_string("curves_csv", "", "Also write the curves' points to this csv file.")
  flags.DEFINE_string("curves_split", "val", "The split whose records the curves show.")
  flags.DEFINE_string("curves_metric", "", "The metric the curves show (default: the table's).")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS.root or not FLAGS.spec:
    raise app.UsageError("--root and --spec are required")
  report = Reporter()   # one for the table and its curves: a problem in a file warns once
  text = make_table(FLAGS.root, FLAGS.spec, FLAGS.format, FLAGS.plot, report=report)
  if FLAGS.out:
    make_parent(FLAGS.out)
    with open(FLAGS.out, "w") as f:
      f.write(text)
  else:
    sys.stdout.write(text)
  if FLAGS.curves or FLAGS.curves_csv:   # after the table: a table without curves still lands
    make_curves(FLAGS.root, FLAGS.spec, FLAGS.curves, FLAGS.curves_csv, FLAGS.curves_split,
                FLAGS.curves_metric, report=report)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
