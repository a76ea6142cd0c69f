"""benchmarks/bench_memory.py: one process per (config, variant) cell, its table on a CPU."""
from __future__ import annotations

import os
import subprocess
import sys

from benchmarks import bench_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ("model.num_layers=1,model.emb_dim=32,model.qkv_dim=32,model.mlp_dim=32,"
         "model.num_heads=2,batch_size=2,data.max_length=64")


def test_cells_run_in_their_own_processes_and_fill_the_table(tmp_path):
  """Two cells, each its own process: time and 'n/a' memory on a CPU (no memory statistics),
  a bad variant's error in its cell while the other still measures, the note, and the table
  written to --out; a config that is not a file is one clear error."""
  out = tmp_path / "table.md"
  command = [sys.executable, "-m", "benchmarks.bench_memory", "--configs=configs/listops.py",
             "--variants=fp32:kind=nystrom,bf16:kind=nope", f"--overrides={SMALL}",
             "--warmup=1", "--reps=2", f"--out={out}"]
  proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  text = out.read_text()
  rows = [line for line in text.splitlines() if line.startswith("| ")]
  assert rows[0] == "| variant | listops |"
  cells = {row.split(" | ")[0][2:]: row.strip("| ").split(" | ")[1:] for row in rows[1:]}
  for variant in ("fp32:kind=nystrom",):
    for cell in cells[variant]:
      ms, peak = cell.split(", ")
      assert ms.endswith(" ms") and float(ms[:-3]) > 0 and peak == "n/a", cell
  assert all(cell.startswith("failed: ValueError: unknown attention kind 'nope'")
             for cell in cells["bf16:kind=nope"])
  assert "Cells above 40 GiB: none. Devices: cpu." in text
  assert "one process per cell" in text and "attention dropout each config's own" in text
  bad = subprocess.run(command[:3] + ["--configs=configs/nope.py"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "configs/nope.py is not a file" in bad.stderr


def test_a_cell_that_runs_out_of_memory_or_time_says_so():
  """What a cell's process left: its CELL line; an out-of-memory error with the allocation
  XLA names; a timeout; any other failure's last stderr line."""
  assert bench_memory.read_cell(0, 'x\nCELL {"ms": 1.5, "peak_gib": 2.0}\n', "", 9) == {
      "ms": 1.5, "peak_gib": 2.0}
  oom = ("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
         "trying to allocate 137.94GiB.")
  assert bench_memory.read_cell(1, "", oom, 9) == {"error": "out of memory (asked 137.94GiB)"}
  assert bench_memory.read_cell(1, "", "RESOURCE_EXHAUSTED: no size here", 9) == {
      "error": "out of memory"}
  assert bench_memory.read_cell(None, "", "", 540) == {"error": "stopped after 540 s"}
  assert bench_memory.read_cell(2, "", "Traceback\n  ...\nKeyError: 'x'\n", 9) == {
      "error": "failed: KeyError: 'x'"}
  assert bench_memory.cell_text({"ms": 12.345, "peak_gib": 1.5}) == "12.3 ms, 1.50 GiB"
  assert bench_memory.cell_text({"ms": 2.0, "peak_gib": None}) == "2.0 ms, n/a"
