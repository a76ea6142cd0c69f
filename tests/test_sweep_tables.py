"""Sweep runner and table builder on synthetic run directories (no trainer, no JAX).

Standard deviations are SAMPLE standard deviations (numpy ddof=1), as documented in
lra_sparse/tables/ and WORKSPACE.md.
"""
import _thread
import contextlib
import csv
import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time

import numpy as np
import pytest

from lra_sparse import config as config_lib
from lra_sparse import sweep as sweep_lib
from lra_sparse import tables
from tests.conftest import spec_on_data, spec_on_task_data, task_data_overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTOPS_TINY = os.path.join(REPO, "configs", "listops.py") + ":tiny"


# ----------------------------------------------------------------------------- helpers


def write_run(root, name, *, task, kind, seed, accuracy=None, metrics_lines=None,
              result_text=None, error=False, extra=None):
  """A run workdir as the trainer (config.json, metrics.jsonl, result.json) and sweep leave it."""
  workdir = root / name
  workdir.mkdir(parents=True)
  blocks = {"dense": {"implementation": "auto"}, "dfss": {"nm": "2:4"},
            "dsa": {"sparsity": 0.9, "sigma": 0.25}}
  config = {"task": task, "seed": seed, "init_from": "",
            "attention": {"kind": kind, kind: dict(blocks[kind])},
            "model": {"dtype": "float32"}}
  for key, value in (extra or {}).items():
    *sections, field = key.split(".")
    node = config
    for section in sections:
      node = node.setdefault(section, {})
    node[field] = value
  (workdir / "config.json").write_text(json.dumps(config))
  lines = metrics_lines if metrics_lines is not None else [
      json.dumps({"step": 10, "split": "train", "loss": 2.0, "accuracy": 0.1}),
      json.dumps({"step": 20, "split": "val", "loss": 1.9, "accuracy": 0.2})]
  (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  if accuracy is not None:
    (workdir / "result.json").write_text(json.dumps(
        {"step": 20, "test": {"accuracy": accuracy, "loss": 1.0}, "val": {"accuracy": 0.5}}))
  if result_text is not None:
    (workdir / "result.json").write_text(result_text)
  if error:
    (workdir / "sweep_error.txt").write_text("return code 1\n")
  return workdir


TABLE_SPEC = """
from lra_sparse.tables import Plot, Selector, Table

def get_table(preset=""):
  return Table(
      title="synthetic" + (" " + preset if preset else ""),
      rows=[Selector("Dense", {"attention.kind": "dense"}),
            Selector("DFSS 2:4", {"attention.kind": "dfss", "attention.dfss.nm": "2:4"}),
            Selector("DSA-90", {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9})],
      columns=[Selector("ListOps", {"task": "listops"}), Selector("Text", {"task": "text"})],
      average=True,
      plot=Plot(x="attention.dsa.sparsity", series=[Selector("DSA", {"attention.kind": "dsa"})],
                baselines=[Selector("Dense", {"attention.kind": "dense"})]),
  )
"""

DENSE_LISTOPS = [0.3712, 0.3655, 0.3801]
DENSE_TEXT = [0.6504]
DFSS_LISTOPS_RESULT = [0.3690, 0.3744]
DFSS_LISTOPS_FROM_METRICS = 0.3598     # result.json corrupt; last test record of metrics.jsonl


@pytest.fixture
def synthetic_root(tmp_path):
  root = tmp_path / "runs"
  for seed, acc in enumerate(DENSE_LISTOPS):
    write_run(root, f"dense_listops_{seed}", task="listops", kind="dense", seed=seed,
              accuracy=acc)
  write_run(root, "dense_text_0", task="text", kind="dense", seed=0, accuracy=DENSE_TEXT[0])
  # Unfinished (no result.json) and with a corrupt metrics line (line 2).
  write_run(root, "dense_text_1", task="text", kind="dense", seed=1, metrics_lines=[
      json.dumps({"step": 10, "split": "train", "loss": 2.0, "accuracy": 0.1}),
      '{"step": 20, "split": "val", "loss": 1.9, "accur',
      json.dumps({"step": 30, "split": "train", "loss": 1.8, "accuracy": 0.3})])
  for seed, acc in enumerate(DFSS_LISTOPS_RESULT):
    write_run(root, f"dfss_listops_{seed}", task="listops", kind="dfss", seed=seed,
              accuracy=acc)
  write_run(root, "dfss_listops_2", task="listops", kind="dfss", seed=2, error=True)
  write_run(root, "dfss_listops_3", task="listops", kind="dfss", seed=3,
            result_text='{"step": 20, "test": {"accuracy": 0.', metrics_lines=[
                json.dumps({"step": 20, "split": "test", "loss": 1.1, "accuracy": 0.1}),
                json.dumps({"step": 40, "split": "test", "loss": 1.0,
                            "accuracy": DFSS_LISTOPS_FROM_METRICS})])
  # DSA: one run whose result.json is unreadable and has no test record -> unfinished.
  write_run(root, "dsa_listops_0", task="listops", kind="dsa", seed=0, result_text="[1, 2")
  # DFSS x Text: no run at all (missing). A stray dense run nested deeper is still found.
  write_run(root / "nested", "dense_listops_9", task="listops", kind="dense", seed=9,
            accuracy=0.40)
  spec = tmp_path / "table_spec.py"
  spec.write_text(TABLE_SPEC)
  return root, spec


def expected_cell(values_fraction, unfinished=0, failed=0):
  values = np.asarray(values_fraction, np.float64) * 100.0
  notes = ([f"{unfinished} unfinished"] if unfinished else []) + (
      [f"{failed} failed"] if failed else [])
  if values.size == 0:
    return "—" + (f" ({', '.join(notes)})" if notes else "")
  text = f"{values.mean():.2f}"
  if values.size > 1:
    text += f" ± {values.std(ddof=1):.2f}"
  return text + f" ({', '.join([f'n={values.size}'] + notes)})"


# ----------------------------------------------------------------------------- tables


def test_markdown_table_exact_cells_and_marks(synthetic_root):
  root, spec = synthetic_root
  report = tables.Reporter(echo=False)
  text = tables.make_table(str(root), str(spec), "markdown", report=report)
  dense_listops = DENSE_LISTOPS + [0.40]
  dfss_listops = DFSS_LISTOPS_RESULT + [DFSS_LISTOPS_FROM_METRICS]
  dense_avg = np.mean([np.mean(dense_listops), np.mean(DENSE_TEXT)]) * 100
  expected_rows = [
      f"| Dense | {expected_cell(dense_listops)} | {expected_cell(DENSE_TEXT, unfinished=1)} "
      f"| {dense_avg:.2f} |",
      f"| DFSS 2:4 | {expected_cell(dfss_listops, failed=1)} | — | — |",
      "| DSA-90 | — (1 unfinished) | — | — |",
  ]
  lines = text.splitlines()
  assert lines[0] == "### synthetic"
  assert lines[2] == "| Model | ListOps | Text | Avg |"
  assert lines[4:7] == expected_rows
  # Spot-check against hand-computed numbers too (sample std of 37.12, 36.55, 38.01, 40.00).
  assert expected_rows[0].startswith("| Dense | 37.92 ± 1.51 (n=4) | 65.04 (n=1, 1 unfinished)")
  assert "sample std (ddof=1)" in text

  corrupt_metrics = os.path.join(root, "dense_text_1", "metrics.jsonl")
  assert any(m.startswith(f"{corrupt_metrics}:2: invalid JSON") for m in report.messages)
  fallback = os.path.join(root, "dfss_listops_3", "result.json")
  assert any(m.startswith(f"{fallback}:1: using ") and "metrics.jsonl:2" in m
             for m in report.messages)
  unusable = os.path.join(root, "dsa_listops_0", "result.json")
  assert any(m.startswith(unusable) and "counted as unfinished" in m for m in report.messages)


def test_cells_that_pool_unlike_runs_are_marked(tmp_path):
  """Two runs of one seed, or runs whose configs differ outside the table's axes (here the
  step count), are not averaged silently: the cell says why, and a warning names the runs."""
  root = tmp_path / "runs"
  write_run(root, "a", task="listops", kind="dense", seed=0, accuracy=0.30,
            extra={"num_train_steps": 100})
  write_run(root, "b", task="listops", kind="dense", seed=0, accuracy=0.32,
            extra={"num_train_steps": 100})
  write_run(root, "c", task="text", kind="dense", seed=0, accuracy=0.60,
            extra={"num_train_steps": 100})
  write_run(root, "d", task="text", kind="dense", seed=1, accuracy=0.62,
            extra={"num_train_steps": 300})
  # Differences in seed, init_from (one pretrain per seed) and what a run records besides its
  # metrics (a profile trace, W&B) are expected and not marked.
  write_run(root, "e", task="listops", kind="dfss", seed=0, accuracy=0.31,
            extra={"init_from": "/runs/pre0"})
  write_run(root, "f", task="listops", kind="dfss", seed=1, accuracy=0.33,
            extra={"init_from": "/runs/pre1", "profile_steps": "10:20", "wandb.project": "lra"})
  spec = tmp_path / "spec.py"
  spec.write_text(TABLE_SPEC)
  report = tables.Reporter(echo=False)
  text = tables.make_table(str(root), str(spec), "markdown", report=report)
  assert "| Dense | 31.00 ± 1.41 (n=2, ! seed 0 repeated) | 61.00 ± 1.41 (n=2, ! configs " \
         "differ in num_train_steps) |" in text
  assert "| DFSS 2:4 | 32.00 ± 1.41 (n=2) |" in text
  assert any("pools unlike runs: seed 0 repeated" in m and str(root / "a") in m
             for m in report.messages)
  assert any("configs differ in num_train_steps" in m for m in report.messages)
  # A column that is the step count makes the same runs poolable.
  by_steps = tmp_path / "by_steps.py"
  by_steps.write_text(TABLE_SPEC.replace(
      'columns=[Selector("ListOps", {"task": "listops"}), Selector("Text", {"task": "text"})]',
      'columns=[Selector("100", {"task": "text", "num_train_steps": 100}), '
      'Selector("300", {"task": "text", "num_train_steps": 300})]'))
  text = tables.make_table(str(root), str(by_steps), "markdown",
                           report=tables.Reporter(echo=False))
  assert "| Dense | 60.00 (n=1) | 62.00 (n=1) |" in text


def test_csv_table_exact_numbers(synthetic_root):
  root, spec = synthetic_root
  text = tables.make_table(str(root), str(spec), "csv", report=tables.Reporter(echo=False))
  rows = list(csv.DictReader(io.StringIO(text)))
  assert [(r["row"], r["column"]) for r in rows] == [
      ("Dense", "ListOps"), ("Dense", "Text"), ("DFSS 2:4", "ListOps"), ("DFSS 2:4", "Text"),
      ("DSA-90", "ListOps"), ("DSA-90", "Text")]
  by_cell = {(r["row"], r["column"]): r for r in rows}
  dense = np.asarray(DENSE_LISTOPS + [0.40]) * 100
  cell = by_cell[("Dense", "ListOps")]
  assert (cell["n"], cell["unfinished"], cell["failed"]) == ("4", "0", "0")
  assert cell["mean"] == f"{dense.mean():.6f}" and cell["std"] == f"{dense.std(ddof=1):.6f}"
  cell = by_cell[("Dense", "Text")]
  assert (cell["n"], cell["mean"], cell["std"], cell["unfinished"]) == (
      "1", f"{DENSE_TEXT[0] * 100:.6f}", "", "1")
  dfss = np.asarray(DFSS_LISTOPS_RESULT + [DFSS_LISTOPS_FROM_METRICS]) * 100
  cell = by_cell[("DFSS 2:4", "ListOps")]
  assert (cell["n"], cell["failed"]) == ("3", "1")
  assert cell["mean"] == f"{dfss.mean():.6f}" and cell["std"] == f"{dfss.std(ddof=1):.6f}"
  assert cell["cell"] == expected_cell(DFSS_LISTOPS_RESULT + [DFSS_LISTOPS_FROM_METRICS],
                                       failed=1)
  missing = by_cell[("DFSS 2:4", "Text")]
  assert (missing["n"], missing["mean"], missing["std"], missing["cell"]) == ("0", "", "", "—")
  assert by_cell[("DSA-90", "ListOps")]["cell"] == "— (1 unfinished)"


def test_interrupted_runs_count_as_unfinished_not_failed(tmp_path):
  """A run stopped by Ctrl-C (exit code 130: checkpoint saved, the sweep resumes it) is
  unfinished; any other error file marks a failure."""
  for name, code in (("stopped", 130), ("crashed", 1), ("killed", -9)):
    workdir = write_run(tmp_path, name, kind="dense", task="listops", seed=0)
    (workdir / "sweep_error.txt").write_text(f"return code {code}\ntime: x\n")
  status = {os.path.basename(r.workdir): r.status
            for r in tables.find_runs(str(tmp_path), report=tables.Reporter(echo=False))}
  assert status == {"stopped": "unfinished", "crashed": "failed", "killed": "failed"}


def test_latex_marks(synthetic_root):
  root, spec = synthetic_root
  text = tables.make_table(str(root), str(spec), "latex", report=tables.Reporter(echo=False))
  assert r"\begin{tabular}{lccc}" in text
  assert r"DFSS 2:4 & " in text and r"$\pm$" in text
  assert r"DSA-90 & -- (1 unfinished) & -- & -- \\" in text


def test_cli_writes_table_plot_and_reports_corrupt_line(synthetic_root, tmp_path):
  root, spec = synthetic_root
  out, png = tmp_path / "t.md", tmp_path / "plots" / "t.png"
  proc = subprocess.run(
      [sys.executable, "-m", "lra_sparse.tables", f"--root={root}", f"--spec={spec}",
       "--format=markdown", f"--out={out}", f"--plot={png}"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "| DSA-90 | — (1 unfinished) | — | — |" in out.read_text()
  assert f"warning: {root}/dense_text_1/metrics.jsonl:2: invalid JSON" in proc.stderr
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_points_mean_std_per_x(tmp_path):
  root = tmp_path / "runs"
  values = {0.5: [0.30, 0.34], 0.9: [0.28, 0.25, 0.27]}
  for sparsity, accs in values.items():
    for seed, acc in enumerate(accs):
      write_run(root, f"dsa_{sparsity}_{seed}", task="listops", kind="dsa", seed=seed,
                accuracy=acc, extra={"attention.dsa.sparsity": sparsity})
  write_run(root, "dsa_0.9_unfinished", task="listops", kind="dsa", seed=7,
            extra={"attention.dsa.sparsity": 0.9})
  runs = tables.find_runs(str(root), report=tables.Reporter(echo=False))
  plot = tables.Plot(x="attention.dsa.sparsity",
                     series=[tables.Selector("DSA", {"task": "listops"})])
  points = tables.plot_points(plot, runs, 100.0)["DSA"]
  assert [x for x, _ in points] == [0.5, 0.9]
  for (x, cell), expected in zip(points, values.values()):
    assert cell.n == len(expected)
    np.testing.assert_allclose(cell.mean, np.mean(expected) * 100, rtol=1e-12)
    np.testing.assert_allclose(cell.std, np.std(np.asarray(expected) * 100, ddof=1), rtol=1e-12)
  # x as a function of the config (here: percent kept); None leaves a run out.
  kept = tables.Plot(x=lambda c: None if c["attention.dsa.sparsity"] > 0.8
                     else round(100 * (1 - c["attention.dsa.sparsity"])),
                     series=[tables.Selector("DSA", {})])
  points = tables.plot_points(kept, runs, 100.0)["DSA"]
  assert [(x, cell.n) for x, cell in points] == [(50, 2)]


def test_table_bad_inputs(tmp_path, synthetic_root):
  root, spec = synthetic_root
  with pytest.raises(FileNotFoundError, match="not a directory"):
    tables.make_table(str(tmp_path / "nope"), str(spec), "markdown")
  with pytest.raises(ValueError, match="unknown format"):
    tables.make_table(str(root), str(spec), "html")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tables.make_table(str(root), str(tmp_path / "missing.py"), "markdown")
  no_table = tmp_path / "no_table.py"
  no_table.write_text("x = 1\n")
  with pytest.raises(ValueError, match="defines no get_table"):
    tables.make_table(str(root), str(no_table), "markdown")
  # A matcher key that no config has is reported (a typo would silently match nothing).
  typo = tmp_path / "typo.py"
  typo.write_text(TABLE_SPEC.replace('"attention.dsa.sparsity": 0.9',
                                     '"attention.dsa.sparsty": 0.9'))
  report = tables.Reporter(echo=False)
  tables.make_table(str(root), str(typo), "markdown", report=report)
  assert any("'attention.dsa.sparsty' is in no run's config.json" in m for m in report.messages)
  # A key of the old flat layout is reported with its new name.
  old_key = tmp_path / "old_key.py"
  old_key.write_text(TABLE_SPEC.replace('"attention.dsa.sparsity": 0.9',
                                        '"attention.sparsity": 0.9'))
  report = tables.Reporter(echo=False)
  tables.make_table(str(root), str(old_key), "markdown", report=report)
  assert any("'attention.sparsity' is in no run's config.json" in m
             and "use config.attention.dsa.sparsity" in m for m in report.messages)


def test_runs_written_before_per_kind_attention_blocks_are_read(tmp_path):
  """Old config.json files (flat attention fields, every kind's defaults) still land in the
  cells of current specs; the fields of other kinds are dropped, n/m become nm."""
  root = tmp_path / "old_runs"
  old_attention = {"n": 1, "m": 2, "sparsity": 0.9, "sigma": 0.25, "implementation": "auto",
                   "backend": "auto", "num_landmarks": 64, "nm": ""}
  for seed, (kind, acc) in enumerate([("dense", 0.36), ("dfss", 0.35), ("dsa", 0.34)]):
    workdir = root / f"{kind}_{seed}"
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps(
        {"task": "listops", "seed": 0, "init_from": "",
         "attention": {"kind": kind, **old_attention}}))
    (workdir / "result.json").write_text(json.dumps({"step": 1, "test": {"accuracy": acc}}))
  runs = {os.path.basename(r.workdir): r for r in tables.find_runs(
      str(root), report=tables.Reporter(echo=False))}
  assert runs["dfss_1"].config["attention.dfss.nm"] == "1:2"
  assert "attention.dsa.sparsity" not in runs["dfss_1"].config
  assert runs["dsa_2"].config["attention.dsa.sparsity"] == 0.9
  assert runs["dense_0"].config["attention.dense.implementation"] == "auto"
  assert not any(key in runs["dense_0"].config for key in
                 ("attention.n", "attention.sparsity", "attention.nystrom.nm"))
  spec = tmp_path / "spec.py"
  spec.write_text(TABLE_SPEC.replace('"attention.dfss.nm": "2:4"', '"attention.dfss.nm": "1:2"'))
  text = tables.make_table(str(root), str(spec), "markdown", report=tables.Reporter(echo=False))
  assert "| Dense | 36.00 (n=1) | — | — |" in text
  assert "| DFSS 2:4 | 35.00 (n=1) | — | — |" in text
  assert "| DSA-90 | 34.00 (n=1) | — | — |" in text


# ----------------------------------------------------------------------------- sweeps

SWEEP_SPEC = """
from lra_sparse.sweep import Group, Ref, Sweep, Variant

def get_sweep(preset=""):
  steps = {{"num_train_steps": 5}} if preset == "tiny" else {{"num_train_steps": 100}}
  return Sweep(name="synthetic", groups=[
      Group(name="pre", config={config!r}, overrides={{"attention.kind": "dense", **steps}},
            seeds=[0, 1]),
      Group(name="ft", config={config!r},
            overrides={{"init_from": Ref("pre"), **steps}},
            variants=[Variant("dfss2-4", {{"attention.kind": "dfss",
                                           "attention.dfss.nm": "2:4"}}),
                      {{"attention.kind": "dsa"}}],
            product={{"model.dtype": ["float32", "bfloat16"]}},
            seeds=[0, 1]),
  ])
"""

EXPECTED_NAMES = [
    "pre__listops-tiny__seed=0",
    "pre__listops-tiny__seed=1",
    "ft__listops-tiny__dfss2-4__dtype=float32__seed=0",
    "ft__listops-tiny__dfss2-4__dtype=float32__seed=1",
    "ft__listops-tiny__dfss2-4__dtype=bfloat16__seed=0",
    "ft__listops-tiny__dfss2-4__dtype=bfloat16__seed=1",
    "ft__listops-tiny__kind=dsa__dtype=float32__seed=0",
    "ft__listops-tiny__kind=dsa__dtype=float32__seed=1",
    "ft__listops-tiny__kind=dsa__dtype=bfloat16__seed=0",
    "ft__listops-tiny__kind=dsa__dtype=bfloat16__seed=1",
]

# Stands in for ``python -m lra_sparse.main``: writes config.json/result.json like the trainer,
# fails (exit 1) for seed 1 of the dense pretrain, resumes when checkpoints/ exists.
FAKE_MAIN = """
import json, os, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
workdir = args.pop("workdir")
config = {"task": "listops", "seed": int(args["config.seed"]), "attention": {}}
for key, value in args.items():
  if key.startswith("config."):
    parts = key[len("config."):].split(".")
    node = config
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = value
os.makedirs(workdir, exist_ok=True)
json.dump(config, open(os.path.join(workdir, "config.json"), "w"))
time.sleep(float(os.environ.get("FAKE_MAIN_SLEEP", "0")))
failing = config["attention"].get("kind") == "dense" and int(config["seed"]) == 1
if failing and os.environ.get("FAKE_FAIL"):
  print("Traceback: boom for seed 1", file=sys.stderr)
  sys.exit(int(os.environ.get("FAKE_EXIT", "1")))
resumed = os.path.isdir(os.path.join(workdir, "checkpoints"))
json.dump({"step": 5, "test": {"accuracy": 0.5, "loss": 1.0}, "resumed": resumed,
           "init_from": config.get("init_from", ""),
           "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")},
          open(os.path.join(workdir, "result.json"), "w"))
"""


@pytest.fixture
def sweep_spec(tmp_path):
  spec = tmp_path / "sweep_spec.py"
  spec.write_text(SWEEP_SPEC.format(config=LISTOPS_TINY))
  fake_main = tmp_path / "fake_main.py"
  fake_main.write_text(FAKE_MAIN)
  return spec, sweep_lib.Launcher([sys.executable, str(fake_main)])


def test_dry_run_lists_expected_runs(sweep_spec, tmp_path):
  spec, _ = sweep_spec
  runs = sweep_lib.expand_sweep(sweep_lib.load_sweep(f"{spec}:tiny"), str(tmp_path / "root"))
  assert [run.name for run in runs] == EXPECTED_NAMES
  assert all(run.workdir == str(tmp_path / "root" / run.name) for run in runs)
  ft = runs[EXPECTED_NAMES.index("ft__listops-tiny__kind=dsa__dtype=bfloat16__seed=1")]
  assert ft.overrides == {"attention.kind": "dsa", "model.dtype": "bfloat16", "seed": 1,
                          "num_train_steps": 5,
                          "init_from": str(tmp_path / "root" / "pre__listops-tiny__seed=1")}
  assert ft.depends_on == ["pre__listops-tiny__seed=1"]
  assert ft.command(["main"]) == [
      "main", f"--config={LISTOPS_TINY}", f"--workdir={ft.workdir}",
      "--config.attention.kind=dsa",
      f"--config.init_from={tmp_path / 'root' / 'pre__listops-tiny__seed=1'}",
      "--config.model.dtype=bfloat16", "--config.num_train_steps=5", "--config.seed=1"]
  # The CLI prints the same runs, all pending, and launches nothing.
  proc = subprocess.run([sys.executable, "-m", "lra_sparse.sweep", f"--sweep={spec}:tiny",
                         f"--root={tmp_path / 'root'}", "--dry_run"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  listed = [line.split()[1] for line in proc.stdout.splitlines()[1:-1]]
  assert listed == EXPECTED_NAMES
  assert all(line.split()[0] == "pending" for line in proc.stdout.splitlines()[1:-1])
  assert "init_from=<pre__listops-tiny__seed=0>" in proc.stdout
  assert proc.stdout.splitlines()[-1] == "10 runs: 10 pending"
  assert not (tmp_path / "root").exists()


def test_names_do_not_depend_on_dict_order(tmp_path):
  def sweep(reverse):
    order = (lambda d: dict(reversed(list(d.items())))) if reverse else dict
    return sweep_lib.Sweep("s", [sweep_lib.Group(
        config=LISTOPS_TINY,
        variants=[order({"attention.kind": "dsa", "attention.dsa.vector": 4})],
        product=order({"attention.dsa.sigma": [0.1, 0.2],
                       "model.dtype": ["float32", "bfloat16"]}),
        zip=order({"attention.dsa.sparsity": [0.9, 0.95], "attention.dsa.quant_bits": [2, 4]}))])
  names = [r.name for r in sweep_lib.expand_sweep(sweep(False), str(tmp_path))]
  assert names == [r.name for r in sweep_lib.expand_sweep(sweep(True), str(tmp_path))]
  assert len(names) == 8 and len(set(names)) == 8
  assert names[0] == ("listops-tiny__quant_bits=2__sigma=0.1__sparsity=0.9__vector=4__"
                      "kind=dsa__dtype=float32__seed=0")


def test_sweep_spec_errors(tmp_path):
  group = lambda **kw: sweep_lib.Sweep("s", [sweep_lib.Group(config=LISTOPS_TINY, **kw)])
  dsa = {"attention.kind": "dsa"}
  with pytest.raises(ValueError, match=r"config.attention.dsa.sparsty is not a field .*did you "
                                       r"mean config.attention.dsa.sparsity"):
    sweep_lib.expand_sweep(group(overrides=dsa, product={"attention.dsa.sparsty": [0.9]}),
                           str(tmp_path))
  with pytest.raises(ValueError, match=r"config.attention.sparsity no longer exists: use "
                                       r"config.attention.dsa.sparsity"):
    sweep_lib.expand_sweep(group(overrides=dsa, product={"attention.sparsity": [0.9]}),
                           str(tmp_path))
  with pytest.raises(ValueError, match=r"config.attention.n no longer exists.*"
                                       r"config.attention.dfss.nm"):
    sweep_lib.expand_sweep(group(overrides={"attention.n": 1}), str(tmp_path))
  with pytest.raises(ValueError, match=r"config.attention.dsa.sparsity is set, but "
                                       r"config.attention.kind='dense'"):
    sweep_lib.expand_sweep(group(variants=[{"attention.kind": "dense"}],
                                 overrides={"attention.dsa.sparsity": 0.9}), str(tmp_path))
  with pytest.raises(ValueError, match="zip lists have different lengths"):
    sweep_lib.expand_sweep(group(zip={"attention.dsa.sigma": [0.1, 0.2],
                                      "attention.dsa.sparsity": [0.9]}), str(tmp_path))
  with pytest.raises(ValueError, match="set by more than one"):
    sweep_lib.expand_sweep(group(overrides={"attention.dsa.sigma": 0.1},
                                 product={"attention.dsa.sigma": [0.2]}), str(tmp_path))
  with pytest.raises(ValueError, match="two runs get the name"):
    sweep_lib.expand_sweep(group(overrides={"attention.kind": "nystrom"},
                                 product={"attention.nystrom.nm": ["1:2", "1-2"]}),
                           str(tmp_path))
  with pytest.raises(ValueError, match="unknown preset"):
    sweep_lib.expand_sweep(sweep_lib.Sweep("s", [sweep_lib.Group(
        config=LISTOPS_TINY.replace(":tiny", ":huge"))]), str(tmp_path))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    sweep_lib.expand_sweep(sweep_lib.Sweep("s", [sweep_lib.Group(
        config=str(tmp_path / "configs" / "nope.py"))]), str(tmp_path))
  with pytest.raises(ValueError, match="names no earlier group"):
    sweep_lib.expand_sweep(group(overrides={"init_from": sweep_lib.Ref("pre")}), str(tmp_path))
  two = sweep_lib.Sweep("s", [
      sweep_lib.Group(name="pre", config=LISTOPS_TINY, seeds=[0]),
      sweep_lib.Group(name="ft", config=LISTOPS_TINY, seeds=[0, 1],
                      overrides={"init_from": sweep_lib.Ref("pre")})])
  with pytest.raises(ValueError, match="must match exactly one run of group 'pre', matched 0"):
    sweep_lib.expand_sweep(two, str(tmp_path))


def test_rerunning_finished_sweep_launches_nothing(sweep_spec, tmp_path, monkeypatch):
  spec, launcher = sweep_spec
  root = tmp_path / "root"
  for run in sweep_lib.expand_sweep(sweep_lib.load_sweep(f"{spec}:tiny"), str(root)):
    os.makedirs(run.workdir)
    with open(os.path.join(run.workdir, "result.json"), "w") as f:
      json.dump({"step": 5, "test": {"accuracy": 0.5}}, f)

  def no_launch(*args, **kwargs):
    raise AssertionError("a finished sweep must not start any process")
  monkeypatch.setattr(sweep_lib.Launcher, "start", no_launch)
  monkeypatch.setattr(subprocess, "Popen", no_launch)
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), launcher=launcher,
                               show_progress=False)
  assert states == {name: "finished" for name in EXPECTED_NAMES}
  manifest = json.loads((root / "sweep.json").read_text())
  assert manifest["sweep"] == "synthetic"
  assert [r["name"] for r in manifest["runs"]] == EXPECTED_NAMES
  assert manifest["counts"]["finished"] == 10


# A trainer that runs until Ctrl-C and then exits as lra_sparse.main does after saving (130).
STOPPABLE_MAIN = """
import os, signal, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
os.makedirs(args["workdir"], exist_ok=True)
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
open(os.path.join(args["workdir"], "started"), "w").close()
time.sleep(60)
sys.exit(1)
"""


def test_ctrl_c_of_the_sweep_records_its_trainers_as_interrupted(sweep_spec, tmp_path, request):
  """Ctrl-C (or ``timeout -s INT``) to the sweep forwards SIGINT; the trainers it stopped are
  recorded "interrupted" with their exit code in sweep.json and sweep_error.txt, not left
  "pending" as if they had never started."""
  # Ctrl-C handled as in a terminal: a suite started in the background without job control
  # (`cmd &` in a script) inherits SIGINT ignored, Python leaves it ignored, and then no
  # simulated Ctrl-C reaches the sweep (seen: "DID NOT RAISE" in such a run).
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
  spec, _ = sweep_spec
  main = tmp_path / "stoppable_main.py"
  main.write_text(STOPPABLE_MAIN)
  root = tmp_path / "root"

  fired = {}

  def interrupt_once_started():
    deadline = time.time() + 60
    while not list(root.glob("*/started")) and time.time() < deadline:
      time.sleep(0.02)
    fired.update(at=time.time(), handler=repr(signal.getsignal(signal.SIGINT)),
                 started=[p.parent.name for p in root.glob("*/started")])
    _thread.interrupt_main()

  began = time.time()
  threading.Thread(target=interrupt_once_started, daemon=True).start()
  try:
    with pytest.raises(KeyboardInterrupt):
      sweep_lib.run_sweep(f"{spec}:tiny", str(root),
                          launcher=sweep_lib.Launcher([sys.executable, str(main)]),
                          poll_seconds=0.01, show_progress=False)
  except pytest.fail.Exception:   # say when the interrupt was sent, and to which handler
    pytest.fail(f"the sweep returned {time.time() - began:.1f} s in without the interrupt "
                f"sent at {fired.get('at', began) - began:.1f} s: {fired}")
  started = [path.parent.name for path in root.glob("*/started")]
  assert len(started) == 1, started
  runs = {r["name"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
  assert runs[started[0]]["state"] == "interrupted"
  assert runs[started[0]]["returncode"] == 130
  assert (root / started[0] / "sweep_error.txt").read_text().startswith("return code 130")
  assert not (root / started[0] / "sweep_running.json").exists()
  others = {r["state"] for name, r in runs.items() if name != started[0]}
  assert others <= {"pending", "blocked"}, others   # blocked: fine-tunes of the stopped run


def test_interrupted_run_is_not_failed_and_resumes(sweep_spec, tmp_path, monkeypatch):
  """A trainer stopped by Ctrl-C (exit code 130) leaves the run "interrupted", not failed: its
  dependents wait (blocked), the sweep exits non-zero, tables count it unfinished, and the
  next call launches it again."""
  spec, launcher = sweep_spec
  root = tmp_path / "root"
  monkeypatch.setenv("FAKE_FAIL", "1")
  monkeypatch.setenv("FAKE_EXIT", "130")
  stopped = "pre__listops-tiny__seed=1"
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), launcher=launcher,
                               poll_seconds=0.01, show_progress=False)
  assert states[stopped] == "interrupted"
  assert sorted(set(states.values())) == ["blocked", "finished", "interrupted"]
  proc = subprocess.run([sys.executable, "-m", "lra_sparse.sweep", f"--sweep={spec}:tiny",
                         f"--root={root}", "--status"], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  lines = proc.stdout.splitlines()
  assert any(line.startswith(f"interrupted {stopped}") and "return code 130" in line
             for line in lines), proc.stdout
  assert lines[-1] == "10 runs: 5 finished, 1 interrupted, 4 blocked", lines[-1]
  records = tables.find_runs(str(root), report=tables.Reporter(echo=False))
  assert {os.path.basename(r.workdir): r.status for r in records}[stopped] == "unfinished"
  monkeypatch.delenv("FAKE_FAIL")
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), launcher=launcher,
                               poll_seconds=0.01, show_progress=False)
  assert set(states.values()) == {"finished"}


def test_failed_run_is_recorded_others_run_and_dependents_blocked(sweep_spec, tmp_path,
                                                                   monkeypatch):
  spec, launcher = sweep_spec
  root = tmp_path / "root"
  monkeypatch.setenv("FAKE_FAIL", "1")
  # An interrupted run (checkpoints/, stale error file) is resumed in its own workdir.
  interrupted = root / "pre__listops-tiny__seed=0"
  (interrupted / "checkpoints").mkdir(parents=True)
  (interrupted / "sweep_error.txt").write_text("return code -9\n")
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), launcher=launcher,
                               poll_seconds=0.01, show_progress=False)

  failed = "pre__listops-tiny__seed=1"
  assert states[failed] == "failed"
  error = (root / failed / "sweep_error.txt").read_text()
  assert error.startswith("return code 1\n")
  assert "Traceback: boom for seed 1" in error
  assert f"--workdir={root / failed}" in error
  assert not (root / failed / "result.json").exists()

  resumed = json.loads((interrupted / "result.json").read_text())
  assert resumed["resumed"] is True and not (interrupted / "sweep_error.txt").exists()
  for name in EXPECTED_NAMES[2:]:
    if name.endswith("seed=1"):          # depends on the failed pretrain run
      assert states[name] == "blocked" and not (root / name).exists()
    else:
      assert states[name] == "finished"
      result = json.loads((root / name / "result.json").read_text())
      assert result["init_from"] == str(interrupted)
      assert result["gpu"] is None
  manifest = json.loads((root / "sweep.json").read_text())
  by_name = {r["name"]: r for r in manifest["runs"]}
  assert by_name[failed]["state"] == "failed" and by_name[failed]["returncode"] == 1
  assert by_name[EXPECTED_NAMES[3]]["blocked_by"] == [failed]
  status = sweep_lib.describe_runs(sweep_lib.expand_sweep(
      sweep_lib.load_sweep(f"{spec}:tiny"), str(root)), show_overrides=False)
  assert status.splitlines()[1].startswith(f"failed    {failed}")
  assert "return code 1" in status.splitlines()[1]
  assert status.splitlines()[-1] == "10 runs: 5 finished, 1 failed, 4 blocked"

  # Fixed failure: running again launches exactly the failed and blocked runs.
  monkeypatch.delenv("FAKE_FAIL")
  launched = []
  original_start = sweep_lib.Launcher.start
  def counting_start(self, run, env, log_file):
    launched.append(run.name)
    return original_start(self, run, env, log_file)
  monkeypatch.setattr(sweep_lib.Launcher, "start", counting_start)
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), launcher=launcher,
                               poll_seconds=0.01, show_progress=False)
  assert launched == [failed] + [n for n in EXPECTED_NAMES[2:] if n.endswith("seed=1")]
  assert set(states.values()) == {"finished"}
  by_name = {r["name"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
  assert by_name[failed]["returncode"] == 0                    # this call's launch
  assert by_name[EXPECTED_NAMES[2]]["returncode"] == 0         # kept from the first call
  assert "seconds" in by_name[EXPECTED_NAMES[2]]


def test_launcher_that_cannot_start_is_recorded(sweep_spec, tmp_path):
  spec, _ = sweep_spec
  root = tmp_path / "root"
  states = sweep_lib.run_sweep(
      f"{spec}:tiny", str(root), launcher=sweep_lib.Launcher([str(tmp_path / "no_python")]),
      poll_seconds=0.01, show_progress=False)
  assert [states[name] for name in EXPECTED_NAMES] == ["failed"] * 2 + ["blocked"] * 8
  error = (root / EXPECTED_NAMES[0] / "sweep_error.txt").read_text()
  assert error.startswith("could not start: ") and "no_python" in error


def test_parallel_gpus_assigns_one_device_per_run(sweep_spec, tmp_path, monkeypatch):
  spec, launcher = sweep_spec
  monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, "2")
  monkeypatch.setenv("FAKE_MAIN_SLEEP", "0.3")
  root = tmp_path / "root"
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), parallel="gpus", launcher=launcher,
                               poll_seconds=0.01, show_progress=False)
  assert set(states.values()) == {"finished"}
  gpus = [json.loads((root / name / "result.json").read_text())["gpu"] for name in EXPECTED_NAMES]
  assert set(gpus) == {"0", "1"}
  # The two pretrain runs start together, one per device.
  assert sorted(gpus[:2]) == ["0", "1"]
  assert sweep_lib.detect_gpus() == ["0", "1"]
  monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, "3,5")
  assert sweep_lib.detect_gpus() == ["3", "5"]
  monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, "0,0,1")      # two runs share GPU 0
  assert sweep_lib.detect_gpus() == ["0", "0", "1"]
  monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, "0, 1; 2,3")  # two runs, two GPUs each
  assert sweep_lib.detect_gpus() == ["0,1", "2,3"]
  monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, "0,1;")       # one slot of two GPUs
  assert sweep_lib.detect_gpus() == ["0,1"]
  monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, "2;")         # GPU 2 alone ("2" is a count)
  assert sweep_lib.detect_gpus() == ["2"]
  for bad in ("0,,1", "a,b", "0;;1", ";", "0,1;;", "gpu0"):
    monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, bad)
    with pytest.raises(ValueError, match="slots of GPU ids"):
      sweep_lib.detect_gpus()


def test_a_new_run_goes_to_the_least_busy_gpu():
  """With several runs per GPU, a run starts on the free slot whose GPUs run the fewest runs
  (ties: the earliest free slot), not on the first free slot, which may share a busy GPU."""
  from lra_sparse.sweep.local import pick_slot  # pylint: disable=import-outside-toplevel
  assert pick_slot(["0", "1"], ["0"]) == 1            # GPU 0 still runs one; GPU 1 is idle
  assert pick_slot(["0", "1"], []) == 0
  assert pick_slot(["0", "1", "1"], ["0", "1"]) == 0  # a tie: the earliest
  assert pick_slot(["0,1", "2,3"], ["2"]) == 0        # slots of several GPUs
  assert pick_slot(["0,1", "2,3"], ["0", "1"]) == 1
  assert pick_slot([None], [None]) == 0               # no GPU: one at a time


_COST_SPEC = """
from lra_sparse.sweep import Group, Ref, Sweep, Variant

def get_sweep(preset=""):
  kinds = [("dense", {{"attention.kind": "dense"}}, 1), ("dsa", {{"attention.kind": "dsa"}}, 4)]
  groups = [Group(name="pre", config={config!r}, overrides={{"num_train_steps": 10}},
                  variants=[Variant(label, o, step_cost=c) for label, o, c in kinds])]
  for label, o, c in kinds:
    groups.append(Group(name=f"ft-{{label}}", config={config!r},
                        overrides={{**o, "num_train_steps": 100,
                                   "init_from": Ref("pre", same=(), match=o)}}, step_cost=c))
    groups.append(Group(name=f"scratch-{{label}}", config={config!r},
                        overrides={{**o, "num_train_steps": STEPS}}, step_cost=c))
  return Sweep(name="costs", groups=groups)
"""


def test_parallel_slots_launch_the_longest_chain_first(tmp_path, monkeypatch):
  """With several GPU slots the ready run with the most work on its chain of dependents
  (num_train_steps x step_cost, plus its dependents') starts first: the slow kind's
  pretraining before the fast kind's, then its fine-tune and from-scratch runs; ties keep the
  spec's order; one run at a time keeps the spec's order; a bad step_cost is one clear error."""
  from lra_sparse.sweep.local import critical_path_work  # pylint: disable=import-outside-toplevel
  def launch_order(steps, parallel, gpus="2"):
    spec = tmp_path / f"cost_spec_{steps}.py"
    spec.write_text(_COST_SPEC.format(config=LISTOPS_TINY).replace("STEPS", str(steps)))
    fake_main = tmp_path / "fake_main.py"
    fake_main.write_text(FAKE_MAIN)
    started = []

    def short(name):  # "pre__cost_spec_100__dsa__seed=0" -> "pre/dsa"
      parts = name.split("__")
      return parts[0] + ("/" + parts[2] if parts[0] == "pre" else "")

    class Recording(sweep_lib.Launcher):
      def start(self, run, env, log_file):
        started.append(short(run.name))
        return super().start(run, env, log_file)

    monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, gpus)
    root = tmp_path / f"root_{steps}_{parallel}_{gpus}"
    states = sweep_lib.run_sweep(f"{spec}", str(root), parallel=parallel,
                                 launcher=Recording([sys.executable, str(fake_main)]),
                                 poll_seconds=0.01, show_progress=False)
    assert set(states.values()) == {"finished"}, states
    runs = sweep_lib.expand_sweep(sweep_lib.load_sweep(str(spec)), str(root))
    work = critical_path_work(runs)
    return started, {short(run.name): (run.cost, work[run.name]) for run in runs}

  started, costs = launch_order(100, "gpus")
  assert costs == {"pre/dense": (10.0, 110.0), "pre/dsa": (40.0, 440.0),
                   "ft-dense": (100.0, 100.0), "scratch-dense": (100.0, 100.0),
                   "ft-dsa": (400.0, 400.0), "scratch-dsa": (400.0, 400.0)}
  # Both slots fill at once (which run comes third depends on which of them ends first).
  assert started[:2] == ["pre/dsa", "scratch-dsa"], started
  assert started.index("pre/dense") < started.index("ft-dense")
  # From-scratch runs of 1000 steps (dsa 4000, dense 1000) outweigh either pretrain chain.
  assert launch_order(1000, "gpus")[0][:2] == ["scratch-dsa", "scratch-dense"]
  # One run at a time (no parallel slots): the spec's order.
  assert launch_order(100, "none")[0] == ["pre/dense", "pre/dsa", "ft-dense", "scratch-dense",
                                          "ft-dsa", "scratch-dsa"]
  for bad in ("0", "-1.0", "float('nan')", "'2'", "True"):   # as the spec's source writes them
    spec = tmp_path / "bad_cost.py"
    spec.write_text(_COST_SPEC.format(config=LISTOPS_TINY).replace("STEPS", "5")
                    .replace("step_cost=c)", f"step_cost={bad})", 1))
    with pytest.raises(ValueError, match="step_cost must be a positive finite number"):
      sweep_lib.expand_sweep(sweep_lib.load_sweep(str(spec)), str(tmp_path / "bad_root"))


def test_parallel_gpus_gives_a_slot_of_several_gpus_to_each_run(sweep_spec, tmp_path,
                                                                 monkeypatch):
  """LRA_SWEEP_GPUS="0,1;2,3": each run sees one slot's two GPUs (data parallel)."""
  spec, launcher = sweep_spec
  monkeypatch.setenv(sweep_lib.GPU_ENV_VAR, "0,1;2,3")
  root = tmp_path / "root"
  states = sweep_lib.run_sweep(f"{spec}:tiny", str(root), parallel="gpus", launcher=launcher,
                               poll_seconds=0.01, show_progress=False)
  assert set(states.values()) == {"finished"}
  gpus = {json.loads((root / name / "result.json").read_text())["gpu"] for name in EXPECTED_NAMES}
  assert gpus == {"0,1", "2,3"}


def test_root_of_another_sweep_is_refused(sweep_spec, tmp_path):
  spec, launcher = sweep_spec
  root = tmp_path / "root"
  root.mkdir()
  (root / "sweep.json").write_text(json.dumps({"sweep": "other", "runs": []}))
  with pytest.raises(ValueError, match="holds sweep 'other'"):
    sweep_lib.run_sweep(f"{spec}:tiny", str(root), launcher=launcher, show_progress=False)


@pytest.mark.parametrize("module, flag", [("lra_sparse.sweep", "--sweep"),
                                          ("lra_sparse.tables", "--spec")])
def test_spec_path_from_before_the_move_to_experiments_specs_names_the_new_path(
    tmp_path, module, flag):
  """A spec typed as experiments/<name>.py that now lives in experiments/specs/<name>.py is one
  error line naming the new path, in both CLIs; a spec missing from both stays the usual
  error."""
  (tmp_path / "experiments" / "specs").mkdir(parents=True)
  (tmp_path / "experiments" / "specs" / "x.py").write_text("raise AssertionError('loaded')\n")
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-m", module, f"{flag}=experiments/x.py:tiny",
                         f"--root={tmp_path}"], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.splitlines() == [
      "error: experiments/x.py does not exist: the spec moved to experiments/specs/x.py"]
  with pytest.raises(FileNotFoundError, match=r"moved to .*/experiments/specs/x\.py$"):
    sweep_lib.load_sweep(str(tmp_path / "experiments" / "x.py"))
  with pytest.raises(FileNotFoundError, match=r"y\.py' does not exist"):
    tables.load_table(str(tmp_path / "experiments" / "y.py"))


def test_matchers_read_a_missing_key_as_none():
  """A selector's value: None (alone or in a list) matches runs without the key, a list any of
  its options, a callable what it accepts (never a missing key), a number within 1e-9
  (a bool only a bool). A dense run has no attention.dsa.quant_bits: DSA Table 2's FP32 column
  ([0, None]) takes it, as its Dense (base) row needs (it was always empty: a missing key was
  compared with the list as a whole)."""
  from lra_sparse.tables import cells  # pylint: disable=import-outside-toplevel
  dense, dsa8 = {"attention.kind": "dense"}, {"attention.dsa.quant_bits": 8}
  fp32 = {"attention.dsa.quant_bits": [0, None]}
  assert cells.matches(dense, fp32) and cells.matches({"attention.dsa.quant_bits": 0}, fp32)
  assert not cells.matches(dsa8, fp32)
  assert cells.matches(dense, {"attention.dsa.quant_bits": None})
  assert not cells.matches(dense, {"attention.dsa.quant_bits": 0})
  assert not cells.matches(dense, {"init_from": bool}) and cells.matches(
      {"init_from": "/runs/a"}, {"init_from": bool})
  assert cells.matches({"lr": 0.1 + 0.2}, {"lr": 0.3}) and not cells.matches({"x": 1}, {"x": True})
  table = tables.load_table("experiments/specs/dsa_table2.py")
  assert [cells.matches({"attention.kind": "dense", "task": "text"}, column.match)
          for column in table.columns] == [False, False, False, True]


# ----------------------------------------------------------------------------- repo specs

EXPERIMENTS = {  # spec -> (runs in full, runs in tiny)
    "dfss_table4": (5 * 4 * 3, 5 * 4 * 2),
    "dfss_table6_nystrom": (3 + 4 * 3, 2 + 4 * 2),
    "dsa_table2": (3 + 5 * 4 * 3, 1 + 5 * 4),
    "dsa_sparsity": (3 * (3 + 3 * 3), 3 * (2 + 3 * 2)),
}


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
@pytest.mark.parametrize("preset", ["", "tiny"])
def test_experiment_specs_expand(name, preset, tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  spec = f"experiments/specs/{name}.py" + (f":{preset}" if preset else "")
  sweep = sweep_lib.load_sweep(spec)
  configs = {config_lib.split_spec_arg(group.config)[0] for group in sweep.groups}
  validate = all(os.path.exists(config) for config in configs)
  runs = sweep_lib.expand_sweep(sweep, str(tmp_path), validate=validate)
  assert len(runs) == EXPERIMENTS[name][1 if preset else 0]
  by_name = {run.name: run for run in runs}
  for run in runs:                 # every fine-tune starts from the same-seed, same-task run
    for dep in run.depends_on:
      assert run.overrides["init_from"] == by_name[dep].workdir
      assert by_name[dep].overrides["seed"] == run.overrides["seed"]
      assert by_name[dep].config_arg == run.config_arg
      assert by_name[dep].overrides.get("init_from", "") == ""     # dependencies are pretrains
  table = tables.load_table(spec)
  assert table.rows and table.columns
  if not validate:
    pytest.skip(f"config files {sorted(c for c in configs if not os.path.exists(c))} not in "
                "the tree yet: names checked, override keys not validated")


# One chain per paper spec (seed 0): each stage of the spec (from-scratch and fine-tune groups)
# and a task loader the others leave out, kept to two short runs a spec for the suite's time.
PAPER_SPEC_CHAINS = {   # spec -> (the runs it trains, the rows whose cell they fill)
    "dfss_table4": ("float-listops__listops-tiny__dense-fp32__seed=0",
                    "bf16-listops__listops-tiny__dfss2-4-bf16__seed=0"),
    "dfss_table6_nystrom": ("pretrain-fmnist-standin__image-tiny__seed=0",
                            "finetune-fmnist-standin__image-tiny__nystrom-dfss2-4-bf16__seed=0"),
    "dsa_table2": ("dense__text-tiny__seed=0",
                   "dsa90__text-tiny__quant_bits=2__sigma=0.1__seed=0"),
    "dsa_sparsity": ("dense-text__text-tiny__seed=0",
                     "dsa-text__text-tiny__sparsity=0.99__seed=0"),
}


@pytest.mark.parametrize("name", sorted(PAPER_SPEC_CHAINS))
def test_paper_spec_tiny_presets_train_end_to_end(name, tmp_path, listops_dir, monkeypatch):
  """Each paper spec's tiny preset trains end to end on small files in the official formats
  (ListOps, IMDB, the Fashion-MNIST stand-in; every task's loader and tiny preset, AAN's
  included, train in test_tiny_presets.py): a from-scratch run, then a fine-tune that loads it,
  both finished; the table fills their two cells and no other."""
  monkeypatch.chdir(REPO)
  base, finetune = PAPER_SPEC_CHAINS[name]
  tasks = {os.path.basename(run.config).removesuffix(".py")
           for run in _spec_runs(f"experiments/specs/{name}.py:tiny", tmp_path / "names")}
  spec = spec_on_task_data(tmp_path, f"experiments/specs/{name}.py", "tiny", {
      task: task_data_overrides(task, tmp_path / task, listops_dir) for task in tasks})
  root = tmp_path / "root"
  states = sweep_lib.run_sweep(spec, str(root), show_progress=False,
                               run_filter=f"^({re.escape(base)}|{re.escape(finetune)})$")
  assert {run: states[run] for run in (base, finetune)} == {base: "finished",
                                                            finetune: "finished"}, states
  assert set(states.values()) == {"finished", "pending"}
  with open(root / finetune / "metrics.jsonl") as f:
    loaded = [json.loads(line) for line in f if '"init_from"' in line]
  assert len(loaded) == 1, "the fine-tune did not load its base run"
  assert json.loads((root / finetune / "config.json").read_text())["init_from"] == str(
      root / base)
  text = tables.make_table(str(root), spec, "markdown", report=tables.Reporter(echo=False))
  assert text.count("(n=1") == 2, text


def test_tiny_listops_spec(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  runs = sweep_lib.expand_sweep(sweep_lib.load_sweep("experiments/specs/tiny_listops.py"),
                                str(tmp_path))
  assert [run.name for run in runs] == [
      f"listops-tiny__{v}__seed={s}" for v in (
          "kind=dense", "nm=2-4__kind=dfss", "sparsity=0.75__kind=dsa",
          "sparsity=0.9__kind=dsa") for s in (0, 1)]


def test_table_of_test_accuracy_at_the_best_validation_step(tmp_path):
  root = tmp_path / "runs"
  for seed, (last, best) in enumerate([(0.30, 0.34), (0.32, 0.36)]):
    workdir = write_run(root, f"dense_{seed}", task="listops", kind="dense", seed=seed,
                        accuracy=last)
    result = json.loads((workdir / "result.json").read_text())
    result["test_at_best_val"] = {"step": 10, "val_accuracy": 0.5, "accuracy": best}
    (workdir / "result.json").write_text(json.dumps(result))
  spec = tmp_path / "spec.py"
  spec.write_text(TABLE_SPEC.replace("average=True,", "average=True, split='test_at_best_val',"))
  text = tables.make_table(str(root), str(spec), "markdown", report=tables.Reporter(echo=False))
  assert "| Dense | 35.00 ± 1.41 (n=2, 2 collapsed) |" in text
  assert "test_at_best_val accuracy" in text
  spec.write_text(TABLE_SPEC)            # the default split: the last step's test accuracy
  last = tables.make_table(str(root), str(spec), "markdown", report=tables.Reporter(echo=False))
  assert "| Dense | 31.00 ± 1.41 (n=2, 2 collapsed) |" in last   # 4 points under their best


def _spec_runs(spec, tmp_path):
  return sweep_lib.expand_sweep(sweep_lib.load_sweep(spec), str(tmp_path))


@pytest.mark.parametrize("name", ["dfss_table4", "dfss_table6_nystrom", "dsa_sparsity"])
def test_paper_specs_read_cifar10_and_name_the_tiny_stand_in(name, tmp_path, monkeypatch):
  """Image runs read CIFAR-10 (data.source="tfds") in the full specs; the tiny variants ask for
  Fashion-MNIST, and say so in every such run's name and in the table."""
  monkeypatch.chdir(REPO)
  for preset in ("", "tiny"):
    spec = f"experiments/specs/{name}.py" + (f":{preset}" if preset else "")
    image_runs = [run for run in _spec_runs(spec, tmp_path / (preset or "full"))
                  if os.path.basename(run.config) == "image.py"]
    assert image_runs
    table = tables.load_table(spec)
    labels = [s.label for s in table.columns] + [table.title]
    if preset:
      assert all(run.overrides["data.source"] == "fashion_mnist" for run in image_runs)
      assert all("fmnist-standin" in run.name for run in image_runs)
      assert any("Fashion-MNIST stand-in" in label for label in labels)
    else:
      assert all(run.overrides.get("data.source", "tfds") == "tfds" for run in image_runs)
      assert config_lib.load_config_file("configs/image.py").data.source == "tfds"
      assert not any("stand-in" in label or "fmnist" in run.name
                     for label in labels for run in image_runs)


def test_dfss_table4_bf16_rows_finetune_the_float_dense_run(tmp_path, monkeypatch):
  """DFSS Sec. 5.1: bf16 models are fine-tuned from the float model and tested with bf16
  parameters; the float rows train from scratch."""
  monkeypatch.chdir(REPO)
  runs = _spec_runs("experiments/specs/dfss_table4.py", tmp_path)
  by_name = {run.name: run for run in runs}
  bf16 = [run for run in runs if run.overrides.get("model.dtype") == "bfloat16"]
  assert len(bf16) == 5 * 2 * 3
  for run in bf16:
    source = by_name[run.depends_on[0]]
    assert len(run.depends_on) == 1 and run.overrides["init_from"] == source.workdir
    assert run.overrides["eval_dtype"] == "bfloat16"
    assert (source.overrides["attention.kind"], source.overrides["model.dtype"]) == (
        "dense", "float32")
    assert source.overrides["seed"] == run.overrides["seed"] and source.config == run.config
    assert run.overrides.get("data.max_length") == source.overrides.get("data.max_length")
    assert run.overrides["num_train_steps"] * 10 == config_lib.load_config_file(
        run.config).num_train_steps
  float_runs = [run for run in runs if run.overrides.get("model.dtype") == "float32"]
  assert len(float_runs) == 5 * 2 * 3 and all(not run.depends_on for run in float_runs)
  # The table's bf16 rows take fine-tuned runs only.
  table = tables.load_table("experiments/specs/dfss_table4.py")
  rows = {row.label: row.match for row in table.rows}
  assert rows["Transformer (bfloat16)"]["init_from"]("runs/x") is True
  assert rows["Transformer (bfloat16)"]["init_from"]("") is False


def test_dfss_table4_listops_preset_is_the_full_sweeps_listops_column(tmp_path, monkeypatch):
  """`:listops` runs the full sweep's 12 ListOps runs (same names, configs and overrides, so
  its records sit beside a full run's) and renders the ListOps column alone."""
  monkeypatch.chdir(REPO)
  full = {run.name: (run.config_arg, run.overrides)
          for run in _spec_runs("experiments/specs/dfss_table4.py", tmp_path / "full")
          if "-listops__" in run.name}
  listops = {run.name: (run.config_arg, run.overrides)
             for run in _spec_runs("experiments/specs/dfss_table4.py:listops", tmp_path / "full")}
  assert len(listops) == 12 and listops == full
  for preset, split in (("listops", "test"), ("listops_best_val", "test_at_best_val")):
    table = tables.load_table(f"experiments/specs/dfss_table4.py:{preset}")
    assert [c.label for c in table.columns] == ["ListOps"] and table.split == split
    assert not table.average
    assert {row.label: row.paper for row in table.rows}["Dfss 2:4 (bfloat16)"] == {
        "ListOps": 37.19}
  with pytest.raises(ValueError, match="unknown sweep preset 'best_val'"):
    sweep_lib.load_sweep("experiments/specs/dfss_table4.py:best_val")
  with pytest.raises(ValueError, match="unknown table preset 'x'"):
    tables.load_table("experiments/specs/dfss_table4.py:x")


def test_paper_specs_train_with_lras_attention_dropout_and_the_committed_tables_keep_0(
    tmp_path, monkeypatch):
  """The paper specs' full-size runs resolve to LRA's attention dropout of their task (the
  task configs' defaults: 0.1, Image 0.2); the specs of the committed tables (trained with 0)
  keep 0, so their runs resume and the tables stay what they measured; tiny presets have 0."""
  monkeypatch.chdir(REPO)
  want = {"listops.py": 0.1, "text.py": 0.1, "retrieval.py": 0.1, "image.py": 0.2,
          "pathfinder.py": 0.1}

  def rates(spec, where):
    out = set()
    for run in _spec_runs(spec, tmp_path / where):
      config = config_lib.load_config_file(run.config, run.preset)
      rate = run.overrides.get("model.attention_dropout_rate",
                               config.model.attention_dropout_rate)
      out.add((os.path.basename(run.config), rate))
    return out

  for spec in ("dfss_table4", "dsa_table2", "dsa_sparsity"):
    got = rates(f"experiments/specs/{spec}.py", spec)
    assert got and all(rate == want[name] for name, rate in got), (spec, got)
    assert {rate for _, rate in rates(f"experiments/specs/{spec}.py:tiny", spec + "_tiny")} == {0.0}
  for spec in ("lra_listops", "lra_pixels"):
    assert {rate for _, rate in rates(f"experiments/specs/{spec}.py", spec)} == {0.0}


def test_paper_specs_run_text_at_the_papers_lengths(tmp_path, monkeypatch):
  """Text at the length each paper states (configs/text.py quotes them): DSA l=2000, DFSS
  2048; LRA's own config keeps 1000."""
  monkeypatch.chdir(REPO)
  for spec, length in (("experiments/specs/dsa_table2.py", 2000),
                       ("experiments/specs/dsa_sparsity.py", 2000),
                       ("experiments/specs/dfss_table4.py", 2048)):
    text = [run for run in _spec_runs(spec, tmp_path / os.path.basename(spec))
            if os.path.basename(run.config) == "text.py"]
    assert text and all(run.overrides["data.max_length"] == length for run in text), spec
  table = tables.load_table("experiments/specs/dsa_table2.py")
  assert table.where["data.max_length"] == 2000


def test_dfss_table6_pretrains_the_nystromformer_lra_image_config(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  runs = _spec_runs("experiments/specs/dfss_table6_nystrom.py", tmp_path)
  assert {run.config_arg for run in runs} == {"configs/image.py:nystromformer"}
  pretrain = [run for run in runs if not run.depends_on]
  assert len(pretrain) == 3 and all(r.overrides["num_train_steps"] == 35_000 for r in pretrain)
  assert all(run.overrides["num_train_steps"] == 3_500 for run in runs if run.depends_on)
  # The presets for the data these machines have: the Image stand-in and ListOps, labelled as
  # such and without paper values; the full Image table carries DFSS Table 6's.
  standin = _spec_runs("experiments/specs/dfss_table6_nystrom.py:standin", tmp_path / "s")
  assert all(r.overrides["data.source"] == "fashion_mnist" and "fmnist-standin" in r.name
             for r in standin)
  listops = _spec_runs("experiments/specs/dfss_table6_nystrom.py:listops", tmp_path / "l")
  assert {r.config_arg for r in listops} == {"configs/listops.py:stable"}
  assert sorted({r.overrides["num_train_steps"] for r in listops}) == [500, 5_000]
  full = tables.load_table("experiments/specs/dfss_table6_nystrom.py")
  assert full.rows[0].paper == {"Pretraining": 41.17, "Finetuning": 41.52}
  assert full.rows[3].paper == {"Finetuning": 42.54}
  for preset in ("standin", "listops"):
    table = tables.load_table(f"experiments/specs/dfss_table6_nystrom.py:{preset}")
    assert all(not row.paper for row in table.rows)
  assert "ListOps" in tables.load_table(
      "experiments/specs/dfss_table6_nystrom.py:listops").title


def test_configs_written_before_later_fields_read_with_the_behaviour_they_ran():
  """config.json files written before attention.dsa.mse_normalization, model.dual_head and
  data.mask_black_pixels existed ran the earlier behaviour: reading them fills that in (not
  today's default), only where the field belongs, and leaves the caller's dict alone."""
  old = {
      "dsa": {"task": "text", "attention": {"kind": "dsa", "dsa": {"sparsity": 0.9}},
              "model": {"dtype": "float32"}, "data": {"max_length": 4000}},
      "retrieval": {"task": "retrieval", "attention": {"kind": "dense", "dense": {}},
                    "model": {"dtype": "float32"}, "data": {}},
      "image": {"task": "image", "attention": {"kind": "dense", "dense": {}},
                "model": {}, "data": {"source": "fashion_mnist"}},
      "pathx": {"task": "pathx", "attention": {"kind": "nystrom", "nystrom": {}},
                "model": {}, "data": {}},
      "listops": {"task": "listops", "attention": {"kind": "dense", "dense": {}},
                  "model": {}, "data": {}, "optim": {"learning_rate": 0.05}},
      "flat_dsa": {"task": "text", "attention": {"kind": "dsa", "sparsity": 0.9, "n": 2},
                   "model": {}},
  }
  frozen = json.dumps(old, sort_keys=True)
  new = {name: config_lib.flatten_config(config_lib.upgrade_legacy_config(tree))
         for name, tree in old.items()}
  assert json.dumps(old, sort_keys=True) == frozen          # inputs untouched
  assert new["dsa"]["attention.dsa.mse_normalization"] == "scaled_mean"
  assert new["flat_dsa"]["attention.dsa.mse_normalization"] == "scaled_mean"
  assert new["dsa"]["attention.dsa.selection_rule"] == "float"
  assert new["dsa"]["attention.dsa.mse_kernels"] is False
  assert (new["dsa"]["attention.dsa.granularity"], new["dsa"]["attention.dsa.block_size"]) == (
      "fine", 64)                     # runs before block DSA: the paper's fine-grained rule
  assert new["dsa"]["attention.dsa.mse_gradient"] == "joint"   # before the option: joint
  assert new["dsa"]["attention.dsa.selection_scores"] == "predictor"   # before the oracle
  assert new["dsa"]["attention.dsa.mse_input_gradient"] is True   # before the option: X too
  assert new["listops"]["optim.trainable"] == ""   # before the option: every parameter
  assert new["flat_dsa"]["attention.dsa.sparsity"] == 0.9
  assert new["retrieval"]["model.dual_head"] == "nli_one_hidden"
  assert new["image"]["data.mask_black_pixels"] is False
  assert new["pathx"]["data.mask_black_pixels"] is False
  added = {"attention.dsa.mse_normalization", "attention.dsa.selection_rule",
           "attention.dsa.mse_kernels", "model.dual_head", "data.mask_black_pixels"}
  for name, keys in (("listops", added), ("retrieval", added - {"model.dual_head"}),
                     ("image", added - {"data.mask_black_pixels"}),
                     ("dsa", added - {"attention.dsa.mse_normalization",
                                      "attention.dsa.selection_rule",
                                      "attention.dsa.mse_kernels"})):
    assert not keys & set(new[name]), name
  # A config written with the fields keeps its values.
  current = {"task": "image", "data": {"mask_black_pixels": True},
             "attention": {"kind": "dsa", "dsa": {"mse_normalization": "eq6",
                                                  "selection_rule": "int8",
                                                  "mse_kernels": True, "granularity": "block",
                                                  "block_size": 32, "mse_gradient": "predictor",
                                                  "mse_input_gradient": False,
                                                  "selection_scores": "oracle"}},
             "optim": {"trainable": "predictor_"},
             "profile_steps": "3:5", "eval_train_mode": True,
             "wandb": {"project": "p", "entity": ""}, "objective": "denoise",
             "denoise": {"mask_rate": 0.3, "mask_share": 1.0, "random_share": 0.0},
             "deterministic": True}
  assert config_lib.upgrade_legacy_config(current) == current
  assert new["listops"]["deterministic"] is False     # before the option: GPU atomics
  # Runs from before self-pretraining classified, with no mask token.
  assert new["listops"]["objective"] == "classify"
  assert new["listops"]["model.mask_token"] is False
  # ... and with no conv skip on V.
  assert new["listops"]["model.value_conv_kernel"] == 0


def test_old_runs_land_apart_from_new_ones_in_tables(tmp_path):
  root = tmp_path / "runs"
  write_run(root, "old", task="text", kind="dsa", seed=0, accuracy=0.60)
  write_run(root, "new", task="text", kind="dsa", seed=0, accuracy=0.64,
            extra={"attention.dsa.mse_normalization": "eq6"})
  spec = tmp_path / "spec.py"
  spec.write_text('''
from lra_sparse.tables import Selector, Table

def get_table():
  return Table(title="t", columns=[Selector("Text", {"task": "text"})],
               rows=[Selector(f"DSA {form}", {"attention.kind": "dsa",
                                                "attention.dsa.mse_normalization": form})
                     for form in ("eq6", "scaled_mean")])
''')
  text = tables.make_table(str(root), str(spec), "markdown", report=tables.Reporter(echo=False))
  assert "| DSA eq6 | 64.00 (n=1) |" in text and "| DSA scaled_mean | 60.00 (n=1) |" in text


def test_lra_listops_spec_and_committed_table(tmp_path, monkeypatch):
  """experiments/specs/lra_listops.py: 6 kinds x 3 seeds in bf16 at LRA's ListOps config, a
  12-run smoke preset, one row per kind; the committed markdown table is what the committed
  logs rebuild (rows and cells), so a table cannot drift from its runs."""
  monkeypatch.chdir(REPO)
  runs = _spec_runs("experiments/specs/lra_listops.py", tmp_path / "full")
  assert len(runs) == 18
  assert all(run.overrides["model.dtype"] == "bfloat16" and run.config_arg ==
             "configs/listops.py" for run in runs)
  assert {run.overrides["attention.kind"] for run in runs} == {"dense", "dfss", "nystrom", "dsa"}
  assert len(_spec_runs("experiments/specs/lra_listops.py:smoke", tmp_path / "smoke")) == 12
  with pytest.raises(ValueError, match="unknown preset 'x'"):
    sweep_lib.load_sweep("experiments/specs/lra_listops.py:x")
  for preset, out in (("", "lra_listops.md"), (":best_val", "lra_listops_best_val.md")):
    text = tables.make_table("experiments/results/lra_listops",
                             f"experiments/specs/lra_listops.py{preset}", "markdown",
                             report=tables.Reporter(echo=False))
    with open(os.path.join(REPO, "experiments", "results", out)) as f:
      committed = f.read()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 6 and all(row in committed for row in rows)


def test_lra_pixels_spec_names_the_image_stand_in(tmp_path, monkeypatch):
  """experiments/specs/lra_pixels.py: dense and DFSS 2:4 on Pathfinder-32 and on Image, one
  seed, bf16 at LRA's configs; every Image run reads Fashion-MNIST and says so in its name, and
  the table's Image column is labelled as the stand-in and takes only Fashion-MNIST runs."""
  monkeypatch.chdir(REPO)
  runs = _spec_runs("experiments/specs/lra_pixels.py", tmp_path / "full")
  assert sorted((os.path.basename(r.config), r.overrides["attention.kind"]) for r in runs) == [
      ("image.py", "dense"), ("image.py", "dfss"), ("pathfinder.py", "dense"),
      ("pathfinder.py", "dfss")]
  for run in runs:
    assert run.overrides["model.dtype"] == "bfloat16" and run.preset == ""
    image = os.path.basename(run.config) == "image.py"
    assert ("fmnist-standin" in run.name) == image
    assert (run.overrides.get("data.source") == "fashion_mnist") == image
  assert len(_spec_runs("experiments/specs/lra_pixels.py:smoke", tmp_path / "smoke")) == 4
  with pytest.raises(ValueError, match="unknown preset 'x'"):
    sweep_lib.load_sweep("experiments/specs/lra_pixels.py:x")
  table = tables.load_table("experiments/specs/lra_pixels.py")
  assert [c.label for c in table.columns] == ["Pathfinder-32", "Image (Fashion-MNIST stand-in)"]
  assert table.columns[1].match["data.source"] == "fashion_mnist"


@contextlib.contextmanager
def _bystander():
  """A process whose command line names lra_sparse.main but that belongs to no sweep of the
  test (another user's run on a shared machine); killed on exit."""
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                           "lra_sparse.main"])
  try:
    yield proc
  finally:
    proc.kill()
    proc.wait()


def _device_sweep_spec(tmp_path, listops_dir, steps: int, every: int, seeds=(0,)):
  spec = tmp_path / "carry_spec.py"
  spec.write_text(
      "from lra_sparse.sweep import Group, Sweep\n"
      "def get_sweep(preset=''):\n"
      f"  return Sweep(name='carry', groups=[Group(config={REPO + '/configs/listops.py:tiny'!r},"
      f" overrides={{'data.data_dir': {listops_dir!r}, 'num_train_steps': {steps},"
      f" 'checkpoint_every_steps': {every}, 'eval_every_steps': {steps},"
      f" 'log_every_steps': {every}, 'num_eval_batches': 1, 'data.max_length': 128,"
      f" 'batch_size': 8}}, seeds={tuple(seeds)!r})])\n")
  env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
             PYTHONPATH=REPO, PREPARE="true")
  return spec, env


def test_device_sweep_deadline_stops_its_own_runs_only(tmp_path, listops_dir):
  """At the deadline scripts/device_sweep.sh sends Ctrl-C to its sweep and the sweep's
  trainer, which saves a checkpoint and stops (the run is left to resume), and the sweep
  starts no further run its REGEX matches (seen on a device: a sweep started with ``&``
  ignored the Ctrl-C and launched seed 1, which ran past the call's limit, so nothing came
  back); a process of the same name outside the batch is not signalled."""
  spec, env = _device_sweep_spec(tmp_path, listops_dir, 100000, 50, seeds=(0, 1))
  root = tmp_path / "r"
  command = ["bash", os.path.join(REPO, "scripts", "device_sweep.sh"), str(spec), str(root),
             "40", "."]
  with _bystander() as other:
    done = subprocess.run(command, env=dict(env, RETURN_CHECKPOINTS="0"), capture_output=True,
                          text=True, timeout=300, check=False)
    assert other.poll() is None, "the deadline signalled a run outside the batch"
  assert done.returncode == 0, done.stdout + done.stderr
  run_dir = os.path.join(str(root) + ".p0", "listops-tiny__seed=0")
  with open(os.path.join(run_dir, "sweep_run.log")) as f:
    log = f.read()
  assert re.search(r"interrupted: interrupted at step \d+; (saved a checkpoint|its checkpoint)",
                   log), log[-2000:]
  assert not os.path.exists(os.path.join(run_dir, "result.json"))
  assert any(n.isdigit() for n in os.listdir(os.path.join(run_dir, "checkpoints")))
  assert not os.path.exists(os.path.join(str(root) + ".p0", "listops-tiny__seed=1"))


def test_device_sweep_deadline_counts_from_its_start(tmp_path, listops_dir):
  """DEADLINE_S counts from the script's start, data preparation included (it once counted
  from the sweeps' launch, so a slow PREPARE pushed the Ctrl-C past the device call's limit and
  nothing came back): a deadline that passes while PREPARE runs is one clear error, and no
  sweep starts."""
  spec, env = _device_sweep_spec(tmp_path, listops_dir, 8, 4)
  root = tmp_path / "r"
  done = subprocess.run(
      ["bash", os.path.join(REPO, "scripts", "device_sweep.sh"), str(spec), str(root), "2",
       "."], env=dict(env, PREPARE="sleep 3"), capture_output=True, text=True, timeout=120,
      check=False)
  assert done.returncode == 1, done.stdout + done.stderr
  assert "the deadline (2 s) passed while preparing the data" in done.stderr, done.stderr
  assert not (tmp_path / "r.p0").exists()


def test_sigterm_stops_the_sweep_like_ctrl_c_even_with_sigint_ignored(tmp_path, listops_dir):
  """``python -m lra_sparse.sweep`` started with SIGINT ignored (as ``cmd &`` in a script
  leaves it) still takes Ctrl-C, and SIGTERM (``timeout``, a batch system) stops it the same
  way: its trainer saves a checkpoint and stops, the run is "interrupted", the next run its
  --runs matches never starts, and the sweep exits 130."""
  spec, env = _device_sweep_spec(tmp_path, listops_dir, 100000, 20, seeds=(0, 1))
  root = tmp_path / "r"
  run_dir = root / "listops-tiny__seed=0"
  for signum in (signal.SIGTERM, signal.SIGINT):
    sweep = subprocess.Popen(   # trap '' INT: SIGINT ignored, and exec keeps it ignored
        ["bash", "-c", "trap '' INT; exec \"$@\"", "bash", sys.executable, "-m",
         "lra_sparse.sweep", f"--sweep={spec}", f"--root={root}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)   # its own process group: the finally below ends its trainers
    metrics = run_dir / "metrics.jsonl"
    logged = metrics.stat().st_size if metrics.exists() else 0
    try:   # Once the trainer (on its first call, or resumed) logs a step, it is training.
      deadline = time.time() + 240
      while time.time() < deadline and not (metrics.exists() and
                                             metrics.stat().st_size > logged):
        time.sleep(0.2)
      sweep.send_signal(signum)
      output, _ = sweep.communicate(timeout=120)
    finally:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 130, (signum, output[-2000:])
    assert not (root / "listops-tiny__seed=1").exists(), (signum, output[-2000:])
    manifest = {r["name"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
    error_file = run_dir / "sweep_error.txt"
    assert manifest["listops-tiny__seed=0"]["state"] == "interrupted", (
        signum, error_file.read_text() if error_file.exists() else "(no sweep_error.txt)")
    log = (run_dir / "sweep_run.log").read_text()
    assert log.count("interrupted: interrupted at step") == (
        1 if signum == signal.SIGTERM else 2), log[-2000:]


def test_device_sweep_carries_checkpoints_to_a_fresh_machine(tmp_path, listops_dir):
  """scripts/device_sweep.sh returns each root as carry parts ($OUT/p0: its runs' records and
  newest checkpoint, ``lra_sparse.sweep.carry``); unpacked from CARRY_IN on a "fresh machine"
  (the root deleted), the run resumes from that checkpoint instead of starting over. With
  GPUS the sweep of each REGEX runs on one of them (its run's slot in sweep.json); bad ids are
  one clear error."""
  from lra_sparse.sweep import carry  # pylint: disable=import-outside-toplevel
  spec, env = _device_sweep_spec(tmp_path, listops_dir, 8, 4)
  root, out1, out2 = tmp_path / "r", tmp_path / "out1", tmp_path / "out2"
  out1.mkdir()
  out2.mkdir()
  command = ["bash", os.path.join(REPO, "scripts", "device_sweep.sh"), str(spec), str(root),
             "600", "."]
  with _bystander() as other:
    done = subprocess.run(command, env=dict(env, OUT=str(out1)), capture_output=True,
                          text=True, timeout=600, check=False)
    time.sleep(1)
    assert other.poll() is None, "a batch that ended before its deadline signalled another run"
  assert done.returncode == 0, done.stdout + done.stderr
  run_dir = os.path.join(str(root) + ".p0", "listops-tiny__seed=0")
  assert os.path.exists(os.path.join(run_dir, "result.json"))
  assert sorted(os.listdir(run_dir + "/checkpoints")) == ["4", "8"]   # nothing deleted here
  with open(os.path.join(str(root) + ".p0", "sweep.json")) as f:
    assert [run.get("slot") for run in json.load(f)["runs"]] == [None]
  # a fresh machine: no root; the carried parts, with the run made unfinished again
  moved = tmp_path / "moved"
  carry.unpack(str(moved), str(out1 / "p0"))
  assert sorted(os.listdir(moved / "listops-tiny__seed=0" / "checkpoints")) == ["8"]
  assert not (moved / "listops-tiny__seed=0" / "run.lock").exists()
  os.remove(moved / "listops-tiny__seed=0" / "result.json")
  # carried as part p3: the run goes to the root of the REGEX that selects it (the first)
  carry.pack(str(moved), str(tmp_path / "carry" / "p3"))
  subprocess.run(["rm", "-rf", str(root) + ".p0"], check=True)
  done = subprocess.run(command, env=dict(env, OUT=str(out2), CARRY_IN=str(tmp_path / "carry"),
                                          GPUS="5,7"),
                        capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  assert f"carry -> {root}.p0: listops-tiny__seed=0: unpacked (checkpoint 8)" in done.stdout
  with open(os.path.join(run_dir, "sweep_run.log")) as f:
    log = f.read()
  assert log.count("sweep launch") == 2 and "at step 8" in log
  assert "sweep launch (slot 5)" in log       # the first REGEX's sweep: the first of GPUS
  assert os.path.exists(os.path.join(run_dir, "result.json"))
  with open(os.path.join(str(root) + ".p0", "sweep.json")) as f:
    assert [run.get("slot") for run in json.load(f)["runs"]] == ["5"]
  # "5+7": one sweep with a slot on each GPU (runs of one root spread over two GPUs)
  done = subprocess.run(command, env=dict(env, GPUS="5+7"), capture_output=True, text=True,
                        timeout=120, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  with open(str(root) + ".p0/sweep.log") as f:
    assert "sweep: GPU slots 5; 7 " in f.read()
  for gpus in ("0,gpu1", "0+", "+1"):
    bad = subprocess.run(command, env=dict(env, GPUS=gpus), capture_output=True, text=True,
                         timeout=120, check=False)
    assert bad.returncode == 2 and f"GPUS={gpus}: give comma-separated GPU ids" in bad.stderr


def test_detached_sweep_outlives_its_start_and_poll_returns_the_records(tmp_path, listops_dir):
  """scripts/detached_sweep.sh: ``start`` returns while its sweep runs on (detached, its pid
  recorded; a second start under the same root is refused while it runs); ``poll`` returns
  when the sweep ends, before its SECONDS, with the run's state and its records in
  $OUT/records.tgz, and no checkpoint."""
  spec, env = _device_sweep_spec(tmp_path, listops_dir, 30, 10)
  env = dict(env, GPUS="0", RUNS_PER_GPU="1")
  root, out = tmp_path / "r", tmp_path / "out"
  out.mkdir()
  script = os.path.join(REPO, "scripts", "detached_sweep.sh")
  started = subprocess.run(["bash", script, "start", str(spec), str(root)], env=env,
                           capture_output=True, text=True, timeout=120, check=False)
  assert started.returncode == 0, started.stdout + started.stderr
  run_dir = root / "listops-tiny__seed=0"
  assert not (run_dir / "result.json").exists()   # start did not wait for the run
  again = subprocess.run(["bash", script, "start", str(spec), str(root)], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
  assert again.returncode == 1 and "already runs" in again.stderr, again.stderr
  began = time.monotonic()
  polled = subprocess.run(["bash", script, "poll", "500", str(spec), str(root)],
                          env=dict(env, OUT=str(out)), capture_output=True, text=True,
                          timeout=600, check=False)
  assert polled.returncode == 0, polled.stdout + polled.stderr
  assert time.monotonic() - began < 400, "poll waited out its seconds after the sweep ended"
  assert "sweep ended" in polled.stdout and "finished" in polled.stdout, polled.stdout
  assert (run_dir / "result.json").exists()
  with tarfile.open(out / "records.tgz") as tar:
    names = sorted(os.path.normpath(n) for n in tar.getnames())
  assert {"listops-tiny__seed=0/config.json", "listops-tiny__seed=0/metrics.jsonl",
          "listops-tiny__seed=0/result.json", "sweep.json"} <= set(names), names
  assert not [n for n in names if "checkpoint" in n], names


_PAPER_SPEC = """
from lra_sparse.tables import Selector, Table

def get_table(preset=""):
  return Table(title="t", paper_source="a paper",
               rows=[Selector("Dense", {"attention.kind": "dense"}, paper=PAPER)],
               columns=[Selector("ListOps", {"task": "listops"}), Selector("Text", {"task": "text"})])
"""


def test_cells_show_the_papers_value_the_delta_and_collapsed_seeds(tmp_path):
  """A row's paper values and our mean minus them in every format; a seed whose last-step test
  is more than 1.5 points under its test at the best validation step counted "collapsed"
  (1.4 under is not); a column without a paper value shows none."""
  root = tmp_path / "runs"
  for seed, (last, best) in enumerate([(0.30, 0.36), (0.35, 0.364), (0.34, 0.35)]):
    workdir = write_run(root, f"d{seed}", task="listops", kind="dense", seed=seed, accuracy=last)
    result = json.loads((workdir / "result.json").read_text())
    result["test_at_best_val"] = {"step": 10, "val_accuracy": 0.5, "accuracy": best}
    (workdir / "result.json").write_text(json.dumps(result))
  write_run(root, "t0", task="text", kind="dense", seed=0, accuracy=0.6)
  spec = tmp_path / "spec.py"
  spec.write_text(_PAPER_SPEC.replace("PAPER", "{'ListOps': 36.37}"))
  report = tables.Reporter(echo=False)
  text = tables.make_table(str(root), str(spec), "markdown", report=report)
  assert "| Dense | 33.00 ± 2.65 (n=3, 1 collapsed, paper 36.37, Δ -3.37) | 60.00 (n=1) |" \
      in text, text
  assert "(a paper)" in text and "'k collapsed'" in text
  rows = list(csv.DictReader(io.StringIO(tables.make_table(str(root), str(spec), "csv",
                                                           report=report))))
  assert [(r["column"], r["collapsed"], r["paper"], r["delta"]) for r in rows] == [
      ("ListOps", "1", "36.370000", "-3.370000"), ("Text", "0", "", "")]
  for paper, message in (("{'Image': 42.0}", r"paper values for \['Image'\]"),
                         ("{'ListOps': '36'}", "must be numbers")):
    spec.write_text(_PAPER_SPEC.replace("PAPER", paper))
    with pytest.raises(ValueError, match=message):
      tables.make_table(str(root), str(spec), "markdown", report=report)


def test_a_gap_of_exactly_the_margin_is_not_a_collapse(tmp_path):
  """Accuracies are counts over a split: 0.30 against 0.285 is 1.5 points exactly (30 of 2000
  examples), whatever 100 * 0.30 - 100 * 0.285 gives in floating point, so it is not "more
  than 1.5 points under"; one example more (0.2845) is."""
  spec = tmp_path / "spec.py"
  spec.write_text(_PAPER_SPEC.replace("PAPER", "{'ListOps': 36.37}"))
  for last, want in ((0.285, ""), (0.2845, "1 collapsed, ")):
    root = tmp_path / f"runs{last}"
    workdir = write_run(root, "d0", task="listops", kind="dense", seed=0, accuracy=last)
    result = json.loads((workdir / "result.json").read_text())
    result["test_at_best_val"] = {"step": 10, "val_accuracy": 0.5, "accuracy": 0.30}
    (workdir / "result.json").write_text(json.dumps(result))
    text = tables.make_table(str(root), str(spec), "markdown", report=tables.Reporter(echo=False))
    assert f"| Dense | {100 * last:.2f} (n=1, {want}paper 36.37" in text, text


def test_cells_count_runs_that_predict_one_class(tmp_path):
  """A finished run whose last-step test put at least 99% of the examples in one predicted
  class is counted "one-class" (at chance on Pathfinder, or at the majority class on ListOps,
  its last step is its best, so no collapse shows); 98.9% is not, nor a run without the
  histogram; the legend defines the mark only where a cell has it, and the csv carries it."""
  spec = tmp_path / "spec.py"
  spec.write_text(_PAPER_SPEC.replace("PAPER", "{}"))
  root = tmp_path / "runs"
  for seed, shares in enumerate([(0.0, 1.0), (0.011, 0.989), None]):
    workdir = write_run(root, f"d{seed}", task="listops", kind="dense", seed=seed,
                        accuracy=0.5)
    if shares is not None:
      result = json.loads((workdir / "result.json").read_text())
      result["test"].update({f"predicted_{c}": v for c, v in enumerate(shares)})
      (workdir / "result.json").write_text(json.dumps(result))
  report = tables.Reporter(echo=False)
  text = tables.make_table(str(root), str(spec), "markdown", report=report)
  assert "| Dense | 50.00 ± 0.00 (n=3, 1 one-class) |" in text, text
  assert "'k one-class' = finished runs whose last-step test put at least 99% of the " \
      "examples in one predicted class" in text
  rows = list(csv.DictReader(io.StringIO(tables.make_table(str(root), str(spec), "csv",
                                                           report=report))))
  assert [(r["column"], r["one_class"]) for r in rows] == [("ListOps", "1"), ("Text", "0")]
  (root / "d0").rename(tmp_path / "away")
  text = tables.make_table(str(root), str(spec), "markdown", report=report)
  assert "one-class" not in text, text


_VERSUS_SPEC = """
from lra_sparse.tables import Selector, Table

def get_table(preset=""):
  return Table(title="t",
               rows=[Selector("Dense", {"attention.kind": "dense"}),
                     Selector("DFSS", {"attention.kind": "dfss"}, versus=VERSUS)],
               columns=[Selector("ListOps", {"task": "listops"}), Selector("Text", {"task": "text"})])
"""


def test_cells_show_their_delta_against_another_row(tmp_path):
  """A row's ``versus``: our mean minus the named row's mean in the same column, in the
  markdown and the csv's cell; no note where either cell has no finished run; a versus that
  names no row, the row itself, or a repeated label is one clear error."""
  root = tmp_path / "runs"
  for seed, accuracy in enumerate([0.30, 0.33]):
    write_run(root, f"d{seed}", task="listops", kind="dense", seed=seed, accuracy=accuracy)
  write_run(root, "f0", task="listops", kind="dfss", seed=0, accuracy=0.40)
  write_run(root, "f1", task="listops", kind="dfss", seed=1, accuracy=0.37)
  write_run(root, "t0", task="text", kind="dfss", seed=0, accuracy=0.6)
  spec = tmp_path / "spec.py"
  spec.write_text(_VERSUS_SPEC.replace("VERSUS", "{'vs dense': 'Dense'}"))
  report = tables.Reporter(echo=False)
  text = tables.make_table(str(root), str(spec), "markdown", report=report)
  assert "| Dense | 31.50 ± 2.12 (n=2) | — |" in text, text
  assert "| DFSS | 38.50 ± 2.12 (n=2, Δ vs dense +7.00) | 60.00 (n=1) |" in text, text
  assert "'Δ vs X D'" in text
  rows = list(csv.DictReader(io.StringIO(tables.make_table(str(root), str(spec), "csv",
                                                           report=report))))
  assert rows[2]["cell"] == "38.50 ± 2.12 (n=2, Δ vs dense +7.00)"
  spec.write_text(_PAPER_SPEC.replace("PAPER", "{}"))   # no versus: the legend says nothing
  assert "'Δ vs X D'" not in tables.make_table(str(root), str(spec), "markdown", report=report)
  for versus, message in (("{'vs x': 'Sparse'}", "names 'Sparse', which is not one row"),
                          ("{'vs x': 'DFSS'}", "the row itself"),
                          ("{'': 'Dense'}", "non-empty strings")):
    spec.write_text(_VERSUS_SPEC.replace("VERSUS", versus))
    with pytest.raises(ValueError, match=message):
      tables.make_table(str(root), str(spec), "markdown", report=report)
  spec.write_text(_VERSUS_SPEC.replace("VERSUS", "{'vs dense': 'Dense'}").replace(
      'Selector("DFSS"', 'Selector("Dense", {"attention.kind": "dsa"}), Selector("DFSS"'))
  with pytest.raises(ValueError, match="repeated"):
    tables.make_table(str(root), str(spec), "markdown", report=report)


def test_dsa_listops_finetunes_each_seeds_dense_run_no_harder_than_it_ended(tmp_path,
                                                                           monkeypatch):
  """experiments/specs/dsa_listops.py: every DSA run fine-tunes the dense run of its seed,
  and its learning rate peaks (at the end of its warmup) at the dense run's last-step rate;
  the untrained-predictor rows have Eq. 6 weight 0; table2 crosses sigma with precision; both
  train with the predictor-only update."""
  monkeypatch.chdir(REPO)
  from lra_sparse.train import rsqrt_schedule  # pylint: disable=import-outside-toplevel
  runs = {run.name: run for run in _spec_runs("experiments/specs/dsa_listops.py",
                                              tmp_path / "full")}
  dense = {run.overrides["seed"]: run for run in runs.values() if not run.depends_on}
  assert sorted(dense) == [0, 1, 2]
  dense_config = config_lib.load_config_file(os.path.join(REPO, "configs", "listops.py"),
                                             "stable")
  dense_end = float(rsqrt_schedule(dense_config.optim.learning_rate,
                                   dense_config.optim.warmup_steps)(
                                       dense_config.num_train_steps - 1))
  finetunes = [run for run in runs.values() if run.depends_on]
  assert len(finetunes) == 18
  for run in finetunes:
    assert run.overrides["init_from"] == dense[run.overrides["seed"]].workdir
    o = run.overrides
    peak = float(rsqrt_schedule(o["optim.learning_rate"], o["optim.warmup_steps"])(
        o["optim.warmup_steps"] - 1))
    assert peak == pytest.approx(dense_end, rel=1e-3), (peak, dense_end)
    assert (o["attention.dsa.mse_weight"] == 0.0) == run.name.endswith("-random__seed="
                                                                       f"{o['seed']}")
  table2 = _spec_runs("experiments/specs/dsa_listops.py:table2", tmp_path / "t2")
  # The update the :mse preset chose: L_MSE trains the predictor alone, X kept out.
  for run in finetunes + [r for r in table2 if r.depends_on]:
    assert (run.overrides["attention.dsa.mse_gradient"],
            run.overrides["attention.dsa.mse_input_gradient"]) == ("predictor", False), run.name
  grid = {(r.overrides["attention.dsa.sigma"], r.overrides["attention.dsa.quant_bits"])
          for r in table2 if r.depends_on}
  assert len(grid) == 20 and {q for _, q in grid} == {0, 2, 4, 8}
  weights = _spec_runs("experiments/specs/dsa_listops.py:weight", tmp_path / "w")
  assert sorted({r.overrides["attention.dsa.mse_weight"] for r in weights if r.depends_on}) == [
      1e-6, 1e-4, 1e-2, 1.0]
  from experiments.specs import dsa_listops  # pylint: disable=import-outside-toplevel
  assert dsa_listops.MSE_WEIGHT in dsa_listops.WEIGHTS
  assert ("not yet measured" in tables.load_table("experiments/specs/dsa_listops.py").title) == (
      not dsa_listops.MSE_WEIGHT_MEASURED)
  # granularity: fine-grained and 64 x 64 block DSA at 90 / 95%, each row its own runs.
  grain = [r for r in _spec_runs("experiments/specs/dsa_listops.py:granularity", tmp_path / "g")
           if r.depends_on]
  assert len(grain) == 12 and {
      (r.overrides["attention.dsa.sparsity"], r.overrides.get("attention.dsa.granularity",
                                                              "fine")) for r in grain} == {
      (0.9, "fine"), (0.9, "block"), (0.95, "fine"), (0.95, "block")}
  table = tables.load_table("experiments/specs/dsa_listops.py:granularity_best_val")
  assert table.split == "test_at_best_val" and len(table.rows) == 5
  for r in grain:
    config = {"attention.kind": "dsa", "attention.dsa.granularity": "fine", **r.overrides}
    hits = [row.label for row in table.rows
            if all(m(config.get(k)) if callable(m) else config.get(k) == m
                   for k, m in row.match.items())]
    assert len(hits) == 1 and ("blocks" in hits[0]) == (
        config["attention.dsa.granularity"] == "block"), (r.name, hits)


def test_dsa_listops_mse_preset_warms_the_predictor_on_dense_attention_first(tmp_path,
                                                                            monkeypatch):
  """dsa_listops.py:mse: a warm stage per seed (DSA at sparsity 0, predictor-only L_MSE, from
  that seed's dense run), the warmed variants start from it and the others from the dense run;
  "predictor" runs keep L_MSE from the block input X, the joint update with and without it;
  every run lands in exactly one row of the table (and every DSA-90 run in one hit-rate row),
  and a run of the first attempt (predictor-only, X not kept out) in none."""
  monkeypatch.chdir(REPO)
  runs = _spec_runs("experiments/specs/dsa_listops.py:mse", tmp_path / "m")
  by_name = {run.name: run for run in runs}
  dense = {r.overrides["seed"]: r.workdir for r in runs if r.name.startswith("dense__")}
  warm = {r.overrides["seed"]: r for r in runs if r.name.startswith("warm__")}
  assert sorted(dense) == sorted(warm) == [0, 1, 2]
  for seed, run in warm.items():
    o = run.overrides
    assert (o["init_from"], o["attention.dsa.sparsity"], o["attention.dsa.mse_gradient"],
            o["num_train_steps"]) == (dense[seed], 0.0, "predictor", 500)
    assert o["attention.dsa.mse_input_gradient"] is False
  finetunes = [r for r in runs if r.name.startswith("dsa__")]
  assert len(finetunes) == 24 and len(by_name) == 30
  joint_weights = sorted(r.overrides["attention.dsa.mse_weight"] for r in finetunes
                         if "joint" in r.name and "no-x-grad" not in r.name)
  assert joint_weights == sorted([1e-12] * 3 + [1e-10] * 3 + [1e-8] * 3 + [1e-6] * 3)
  predictor = next(r for r in finetunes if "__dsa90-predictor__" in r.name)
  runs = [*runs, dataclasses.replace(predictor, name="leaky", overrides={
      **predictor.overrides, "attention.dsa.mse_input_gradient": True})]
  tables_by_preset = {p: tables.load_table(f"experiments/specs/dsa_listops.py:{p}")
                      for p in ("mse", "mse_hit_rate")}
  for run in runs:
    config = {"attention.dsa.granularity": "fine", "attention.dsa.mse_gradient": "joint",
              "attention.dsa.mse_input_gradient": True, "init_from": "", **run.overrides}
    seed = config["seed"]
    if run in finetunes:
      warmed = run.name.endswith(f"warm__seed={seed}")
      assert config["init_from"] == (warm[seed].workdir if warmed else dense[seed])
      assert (config["attention.dsa.mse_gradient"] == "joint") == ("joint" in run.name)
      assert config["attention.dsa.mse_input_gradient"] == (
          "__dsa90-joint" in run.name and "no-x-grad" not in run.name)
    for preset, table in tables_by_preset.items():
      hits = [row.label for row in table.rows
              if all(m(config.get(k)) if callable(m) else config.get(k) == m
                     for k, m in row.match.items())]
      expected = 1 if (preset == "mse" or run in finetunes) and run.name != "leaky" else 0
      assert len(hits) == expected, (preset, run.name, hits)


def test_dsa_listops_sparsity_table2_shares_one_set_of_dense_bases(tmp_path, monkeypatch):
  """dsa_listops.py:sparsity_table2: one set of dense bases, then the sparsity preset's runs
  (config for config) and table2's grid less the cell equal to DSA-90; on its root each
  fine-tune fills exactly one cell of each table it belongs to (DSA-90 one of each), and the
  preset has no table of its own."""
  monkeypatch.chdir(REPO)
  runs = _spec_runs("experiments/specs/dsa_listops.py:sparsity_table2", tmp_path / "st")
  dense = [r for r in runs if not r.depends_on]
  assert sorted(r.overrides["seed"] for r in dense) == [0, 1, 2]
  by_name = {r.name: r.overrides for r in runs}
  sparsity = {r.name: r.overrides for r in _spec_runs("experiments/specs/dsa_listops.py",
                                                      tmp_path / "s")}
  strip = lambda o: {k: v for k, v in o.items() if k != "init_from"}  # noqa: E731
  for name, overrides in sparsity.items():
    assert strip(by_name[name]) == strip(overrides), name
  table2 = {r.name: r.overrides for r in _spec_runs("experiments/specs/dsa_listops.py:table2",
                                                    tmp_path / "t")}
  extra = set(by_name) - set(sparsity)
  assert extra == set(table2) - {f"dsa__listops-stable__sigma0.25-FP32__seed={s}"
                                 for s in (0, 1, 2)} - set(sparsity)
  assert len(runs) == 3 + 18 + 57
  for name in extra:
    assert strip(by_name[name]) == strip(table2[name]), name
  spec_tables = {p: tables.load_table(f"experiments/specs/dsa_listops.py{p}")
                 for p in ("", ":table2")}
  for run in runs:
    config = {"task": "listops", "attention.dsa.granularity": "fine", "init_from": "",
              **run.overrides}
    if run.depends_on:
      config["init_from"] = "runs/dense"
    cells = {}
    for preset, table in spec_tables.items():
      cells[preset] = [(row.label, column.label) for row in table.rows
                       for column in table.columns
                       for m_all in [{**row.match, **column.match}]
                       if all(m(config.get(k)) if callable(m) else config.get(k) == m
                              for k, m in m_all.items())]
    o = run.overrides
    in_table2 = (run.depends_on and o["attention.dsa.sparsity"] == 0.9
                 and o["attention.dsa.mse_weight"] == 1.0)
    in_sparsity = run.name in sparsity
    assert len(cells[""]) == int(in_sparsity), (run.name, cells)
    assert len(cells[":table2"]) == int(bool(in_table2)), (run.name, cells)
  with pytest.raises(ValueError, match="sweep preset"):
    tables.load_table("experiments/specs/dsa_listops.py:sparsity_table2")


def test_dsa_weight_pick_accuracy_first_then_hit_rate_within_the_noise():
  """pick_mse_weight: the best mean validation accuracy wins outright when the others are more
  than VAL_NOISE under it; within VAL_NOISE the predictor's hit rate decides (ties: the
  smaller weight); a weight short of a seed, or one outside WEIGHTS, is an error."""
  from experiments.specs import dsa_listops as spec  # pylint: disable=import-outside-toplevel
  def runs(accuracies, hits):
    return {w: [(a, h)] * len(spec.WEIGHT_SEEDS)
            for w, a, h in zip(spec.WEIGHTS, accuracies, hits)}
  assert spec.WEIGHTS == (1e-6, 1e-4, 1e-2, 1.0)
  assert spec.pick_mse_weight(runs((0.30, 0.36, 0.34, 0.17), (0.9, 0.1, 0.9, 0.9))) == 1e-4
  assert spec.pick_mse_weight(runs((0.355, 0.36, 0.34, 0.17), (0.2, 0.1, 0.9, 0.9))) == 1e-6
  assert spec.pick_mse_weight(runs((0.36, 0.36, 0.36, 0.36), (0.5, 0.5, 0.5, 0.5))) == 1e-6
  mixed = runs((0.35, 0.35, 0.35, 0.35), (0.1, 0.1, 0.1, 0.1))
  mixed[1e-2] = [(0.34, 0.5), (0.37, 0.3)]      # mean 0.355 and 0.4: the means decide
  assert spec.pick_mse_weight(mixed) == 1e-2
  short = runs((0.3,) * 4, (0.1,) * 4)
  short[1.0] = short[1.0][:1]
  with pytest.raises(ValueError, match=r"incomplete: \[1.0\]"):
    spec.pick_mse_weight(short)
  with pytest.raises(ValueError, match=r"not in WEIGHTS: \[0.5\]"):
    spec.pick_mse_weight({**runs((0.3,) * 4, (0.1,) * 4), 0.5: [(0.3, 0.1)] * 2})


def test_pick_dsa_weight_script_reads_only_the_presets_finished_runs(tmp_path):
  """scripts/pick_dsa_weight.py on a root with the weight preset's runs plus runs it must
  ignore (dense, another sparsity, block selection): prints each weight's seeds and the pick,
  writes it into a copy of the spec; an unfinished preset run is an error that names it."""
  from experiments.specs import dsa_listops as spec  # pylint: disable=import-outside-toplevel
  root = tmp_path / "root"
  accuracy = {1e-6: 0.33, 1e-4: 0.352, 1e-2: 0.35, 1.0: 0.20}
  hit = {1e-6: 0.2, 1e-4: 0.4, 1e-2: 0.6, 1.0: 0.7}
  def run(name, weight, seed, *, result=True, **dsa):
    extra = {"init_from": "/base", "attention.dsa.mse_weight": weight,
             "attention.dsa.mse_normalization": "eq6", "attention.dsa.quant_bits": 0,
             **{f"attention.dsa.{k}": v for k, v in dsa.items()}}
    workdir = write_run(root, name, task="listops", kind="dsa", seed=seed, extra=extra)
    if result:
      (workdir / "result.json").write_text(json.dumps({"step": 1000, "val": {
          "accuracy": accuracy[weight] + 0.001 * seed, "dsa_hit_rate": hit[weight]}}))
  for weight in spec.WEIGHTS:
    for seed in spec.WEIGHT_SEEDS:
      run(f"w{weight:g}_{seed}", weight, seed)
  run("other_sparsity", 1e-6, 0, sparsity=0.95)
  run("block", 1e-6, 0, granularity="block")
  run("seed2", 1e-6, 2)
  write_run(root, "dense", task="listops", kind="dense", seed=0, accuracy=0.9)
  spec_copy = tmp_path / "dsa_listops.py"
  spec_copy.write_text(open(os.path.join(REPO, "experiments/specs/dsa_listops.py")).read())
  command = [sys.executable, "-c", "import sys; from scripts import pick_dsa_weight as p; "
             f"p.SPEC_FILE = {str(spec_copy)!r}; sys.argv[0] = 'pick'; "
             "from absl import app; app.run(p.main)", f"--root={root}", "--write_spec"]
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  # 1e-4 and 1e-2 lie within VAL_NOISE of each other, 1e-2's predictor hits more.
  assert "picked Eq. 6 weight: 0.01" in done.stdout, done.stdout
  assert "| 0.0001 | 35.20 / 35.30 | 35.25 |" in done.stdout, done.stdout
  text = spec_copy.read_text()
  assert "\nMSE_WEIGHT = 0.01 " in text and "\nMSE_WEIGHT_MEASURED = True\n" in text
  run("w1_late", 1.0, 1, result=False)
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode != 0 and "unfinished weight runs" in done.stderr
  assert "w1_late" in done.stderr


def test_dsa_listops_tiny_runs_end_to_end(tmp_path, monkeypatch, listops_dir):
  """dsa_listops.py:tiny on a small generated ListOps set: the dense base, then DSA-90 with a
  trained and with an untrained predictor fine-tuned from it; the table has all three."""
  monkeypatch.chdir(REPO)
  spec = spec_on_data(tmp_path, "experiments/specs/dsa_listops.py", "tiny", listops_dir)
  states = sweep_lib.run_sweep(spec, str(tmp_path / "root"), show_progress=False)
  assert len(states) == 3 and set(states.values()) == {"finished"}, states
  text = tables.make_table(str(tmp_path / "root"), spec, "markdown",
                           report=tables.Reporter(echo=False))
  assert sum("(n=1" in line for line in text.splitlines() if line.startswith("| ")) == 3, text
