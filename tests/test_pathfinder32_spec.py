"""experiments/specs/pathfinder32.py: Pathfinder-32 at LRA's config for every kind."""
from __future__ import annotations

import os

import pytest

from lra_sparse import sweep as sweep_lib
from lra_sparse import tables
from lra_sparse.config import load_config_file
from tests.conftest import pathfinder_dir_with_cue, spec_on_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = "experiments/specs/pathfinder32.py"


def _runs(preset, root):
  return sweep_lib.expand_sweep(sweep_lib.load_sweep(f"{SPEC}:{preset}"), str(root))


def test_every_kind_runs_lras_config_to_its_last_step(tmp_path, monkeypatch):
  """"": seed 0 of dense, DFSS 2:4, Nystromformer and DSA-90, each LRA's Pathfinder-32 config
  (62,400 steps, its attention dropout) in bf16 and nothing else changed; "seeds": seeds 1-2
  of dense and DFSS 2:4; DSA-90's chain starts first on parallel slots; the table pools both
  presets' runs per kind, with LRA's Transformer value beside dense only; a bad preset is one
  clear error."""
  monkeypatch.chdir(REPO)
  config = load_config_file("configs/pathfinder.py", "")
  assert (config.num_train_steps, config.model.attention_dropout_rate) == (62400, 0.1)
  runs = _runs("", tmp_path / "a")
  assert sorted(run.name for run in runs) == [
      f"pathfinder32__pathfinder__{kind}__seed=0"
      for kind in ("dense", "dfss2-4", "dsa90", "nystrom")]
  for run in runs:
    assert run.config_arg == "configs/pathfinder.py"
    assert set(run.overrides) - {"seed", "model.dtype", "data.data_dir"} <= {
        key for key in run.overrides if key.startswith("attention.")}
    assert run.overrides["model.dtype"] == "bfloat16"
    assert run.overrides["data.data_dir"] == "data/pathfinder"   # prepare's, with its cache
  costs = {run.name.split("__")[2]: run.cost for run in runs}
  assert costs["dsa90"] > costs["dfss2-4"] > costs["dense"] > costs["nystrom"]
  assert costs["dfss2-4"] == 62400
  more = _runs("seeds", tmp_path / "b")
  assert sorted(run.name for run in more) == [
      f"pathfinder32__pathfinder__{kind}__seed={seed}"
      for kind in ("dense", "dfss2-4") for seed in (1, 2)]
  every = {run.name: run for run in _runs("all", tmp_path / "c")}   # runs chain per GPU
  assert len(every) == 12
  for run in runs + more:                # the same runs as the other presets name them
    twin = every[run.name]
    assert (run.config_arg, run.overrides, run.cost) == (twin.config_arg, twin.overrides,
                                                         twin.cost)
  table = tables.load_table(SPEC)
  assert [row.label for row in table.rows] == [
      "Transformer (dense)", "DFSS 2:4", "Nystromformer",
      "DSA-90 (sigma 0.25, mean-form L_MSE)"]
  assert [dict(row.paper) for row in table.rows] == [{"Pathfinder-32": 71.40}, {}, {}, {}]
  for run in runs + more:
    config = {"task": "pathfinder", "attention.dfss.nm": None, "attention.nystrom.nm": None,
              "attention.dsa.sparsity": None, **run.overrides}
    held = [row.label for row in table.rows
            if all(config.get(k) == v for k, v in row.match.items())]
    assert len(held) == 1, (run.name, held)
  assert tables.load_table(f"{SPEC}:best_val").split == "test_at_best_val"
  with pytest.raises(ValueError, match="unknown preset 'x'"):
    sweep_lib.load_sweep(f"{SPEC}:x")


def test_tiny_preset_trains_on_pathfinder_end_to_end(tmp_path, monkeypatch):
  """pathfinder32.py:tiny on a small generated Pathfinder set (black pixels masked: key masks
  with holes): Nystromformer and DSA-90, the kinds no other Pathfinder spec trains, run their
  20 steps and land in their own rows (dense and DFSS 2:4 are lra_pixels.py's; the four
  subprocess runs together take about 90 s here, so two)."""
  monkeypatch.chdir(REPO)
  data = pathfinder_dir_with_cue(tmp_path / "pathfinder")
  spec = spec_on_data(tmp_path, SPEC, "tiny", data)
  root = tmp_path / "root"
  states = sweep_lib.run_sweep(spec, str(root), show_progress=False,
                               run_filter="__(nystrom|dsa90)__")
  assert sorted(states.values()) == ["finished", "finished", "pending", "pending"], states
  text = tables.make_table(str(root), spec, "markdown", report=tables.Reporter(echo=False))
  rows = [line.split(" |")[0] for line in text.splitlines() if "(n=1)" in line]
  assert rows == ["| Nystromformer", "| DSA-90 (sigma 0.25, mean-form L_MSE)"], text
