"""Learning curves of a table's cells (``lra_sparse.tables.curves``), against numpy."""
from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from lra_sparse import tables
from lra_sparse.tables import curves as curves_lib

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent

SPEC = """
from lra_sparse.tables import Selector, Table

def get_table(preset=""):
  return Table(title="curves",
               rows=[Selector("Dense", {"attention.kind": "dense"}),
                     Selector("DFSS", {"attention.kind": "dfss"}),
                     Selector("DSA", {"attention.kind": "dsa"})],
               columns=[Selector("ListOps", {"task": "listops"}),
                        Selector("Text", {"task": "text"})],
               where={"model.dtype": "float32"})
"""


def _run(root, name, *, kind, task, seed, val, finished=True, dtype="float32", extra_lines=()):
  """A run workdir whose metrics.jsonl logs ``val`` ({step: accuracy} or a list of (step,
  accuracy) in log order) as val records between train records."""
  workdir = root / name
  workdir.mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps(
      {"task": task, "seed": seed, "attention": {"kind": kind}, "model": {"dtype": dtype}}))
  lines = []
  for step, accuracy in (val.items() if isinstance(val, dict) else val):
    lines.append(json.dumps({"step": step, "split": "train", "loss": 9.0, "accuracy": 0.99}))
    lines.append(json.dumps({"step": step, "split": "val", "loss": 2.0 - accuracy,
                             "accuracy": accuracy}))
  lines += list(extra_lines)
  (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  if finished:
    (workdir / "result.json").write_text(json.dumps({"test": {"accuracy": 0.5}}))
  return workdir


@pytest.fixture
def curve_root(tmp_path):
  root = tmp_path / "runs"
  # Dense, ListOps: three seeds; seed 1 resumed from step 20 (steps 30-40 logged twice, the
  # second time with other values: those count); seed 2 cut at step 30 (unfinished), with a
  # bad line, a NaN record and a string step, all skipped.
  _run(root, "d0", kind="dense", task="listops", seed=0,
       val={10: 0.20, 20: 0.30, 30: 0.40, 40: 0.50})
  _run(root, "d1", kind="dense", task="listops", seed=1,
       val=[(10, 0.22), (20, 0.28), (30, 0.90), (40, 0.90), (30, 0.36), (40, 0.46)])
  _run(root, "d2", kind="dense", task="listops", seed=2, finished=False,
       val={10: 0.18, 20: 0.35, 30: 0.41},
       extra_lines=["{not json", json.dumps({"step": 40, "split": "val",
                                             "accuracy": float("nan")}),
                    json.dumps({"step": "40", "split": "val", "accuracy": 0.7})])
  _run(root, "f0", kind="dfss", task="listops", seed=0, val={10: 0.25, 20: 0.33})
  _run(root, "t0", kind="dense", task="text", seed=0, val={100: 0.6, 200: 0.7})
  # outside the table: bf16 (the table's where), and a DSA run with no val record
  _run(root, "bf", kind="dense", task="listops", seed=0, dtype="bfloat16", val={10: 0.99})
  _run(root, "s0", kind="dsa", task="listops", seed=0, val={})
  spec = tmp_path / "spec.py"
  spec.write_text(SPEC)
  return root, spec


def _reference(per_run: list[dict[int, float]], scale: float) -> list[tuple]:
  """(step, mean, low, high, n) per step of any run, numpy over the runs that logged it."""
  steps = sorted(set().union(*per_run))
  out = []
  for step in steps:
    values = np.array([run[step] for run in per_run if step in run], np.float64) * scale
    out.append((step, values.mean(), values.min(), values.max(), len(values)))
  return out


def test_cell_curves_are_the_mean_and_range_of_the_runs_that_logged_each_step(curve_root):
  """Per cell: at each step the mean, lowest and highest of its runs' val accuracy (percent)
  among the runs that logged that step, finished or not; a step logged twice (a resumed run)
  takes its last record; invalid lines, NaN and non-numeric steps are skipped and reported;
  runs outside the table's ``where`` and runs with no val record draw nothing."""
  root, spec = curve_root
  report = tables.Reporter(echo=False)
  table = tables.load_table(str(spec))
  runs = tables.find_runs(str(root), table.split, table.metric, report)
  got = curves_lib.cell_curves(table, runs, "val", "accuracy", report)
  assert set(got) == {(0, 0), (1, 0), (0, 1)}           # dense/listops, dfss/listops, dense/text
  dense = _reference([{10: 0.20, 20: 0.30, 30: 0.40, 40: 0.50},
                      {10: 0.22, 20: 0.28, 30: 0.36, 40: 0.46},
                      {10: 0.18, 20: 0.35, 30: 0.41}], 100.0)
  for want, point in zip(dense, got[(0, 0)].points, strict=True):
    assert point.step == want[0] and point.n == want[4]
    np.testing.assert_allclose([point.mean, point.low, point.high], want[1:4], rtol=1e-12)
  assert (got[(0, 0)].runs, got[(0, 0)].unfinished) == (3, 1)
  assert [(p.step, p.n) for p in got[(0, 0)].points][-1] == (40, 2)
  assert [(p.step, round(p.mean, 9)) for p in got[(0, 1)].points] == [(100, 60.0), (200, 70.0)]
  d2 = root / "d2" / "metrics.jsonl"
  assert [m.split(": ", 1)[1][:40] for m in report.messages if m.startswith(f"{d2}:")] == [
      "invalid JSON (JSONDecodeError: Expecting",         # line 7, reported once
      "val accuracy nan is not a finite number;",         # line 8
      "step '40' is not a number; point skipped"], report.messages   # line 9
  assert [m for m in report.messages if m.startswith(f"{d2}:")][1].startswith(f"{d2}:8: ")
  assert f"{root / 's0' / 'metrics.jsonl'}:1: no val accuracy record; no curve" in \
      report.messages
  # Another metric is drawn as logged (not scaled by the table's 100).
  loss = curves_lib.cell_curves(table, runs, "val", "loss", report)
  assert [round(p.mean, 9) for p in loss[(1, 0)].points] == [1.75, round(2.0 - 0.33, 9)]


def test_curves_cli_writes_the_png_and_the_csv_and_refuses_an_empty_table(curve_root, tmp_path):
  """``python -m lra_sparse.tables ... --curves=F.png --curves_csv=F.csv``: the table on
  stdout as before, a PNG, and a csv whose lines are the cells' points (column, row, step);
  a table none of whose runs logged the split is one clear error."""
  root, spec = curve_root
  png, table_csv = tmp_path / "out" / "c.png", tmp_path / "out" / "c.csv"
  command = [sys.executable, "-m", "lra_sparse.tables", f"--root={root}", f"--spec={spec}",
             f"--curves={png}", f"--curves_csv={table_csv}"]
  proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "| Dense |" in proc.stdout
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  rows = list(csv.DictReader(io.StringIO(table_csv.read_text())))
  assert tuple(rows[0]) == curves_lib.CSV_HEADER
  assert [(r["column"], r["row"], int(r["step"]), int(r["n"])) for r in rows] == [
      ("ListOps", "Dense", 10, 3), ("ListOps", "Dense", 20, 3), ("ListOps", "Dense", 30, 3),
      ("ListOps", "Dense", 40, 2), ("ListOps", "DFSS", 10, 1), ("ListOps", "DFSS", 20, 1),
      ("Text", "Dense", 100, 1), ("Text", "Dense", 200, 1)]
  assert math.isclose(float(rows[3]["mean"]), 48.0) and float(rows[3]["low"]) == 46.0
  for output in (f"--curves={png}", f"--curves_csv={table_csv}"):
    proc = subprocess.run(command[:-2] + [output, "--curves_split=no_such_split"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no run of table 'curves' logged a no_such_split accuracy" in proc.stderr, \
        proc.stderr
    assert "Traceback" not in proc.stderr
    assert "| Dense |" in proc.stdout        # the table was written before the curves failed
