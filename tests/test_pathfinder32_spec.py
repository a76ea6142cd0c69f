"""experiments/specs/pathfinder32.py: Pathfinder-32 at LRA's config for every kind."""
from __future__ import annotations

import json
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
  of dense and DFSS 2:4; the dense Transformer also with the model of LRA's
  transformer_base.py (its own group, seeds as dense's); DSA-90's chain starts first on
  parallel slots; DSA-90 also fine-tuned after a predictor fit on the frozen dense model; the
  table pools both presets' runs per kind, with LRA's Transformer value beside the two dense
  rows only; a bad preset is one clear error."""
  monkeypatch.chdir(REPO)
  config = load_config_file("configs/pathfinder.py", "")
  assert (config.num_train_steps, config.model.attention_dropout_rate) == (62400, 0.1)
  runs = _runs("", tmp_path / "a")
  assert sorted(run.name for run in runs) == [
      "pathfinder32-ft-fitted-sigma1__pathfinder__dsa90-ft__seed=0",
      "pathfinder32-ft-fitted__pathfinder__dsa90-ft__seed=0",
      "pathfinder32-ft-oracle__pathfinder__dsa90-oracle-ft__seed=0",
      "pathfinder32-ft__pathfinder__dsa90-ft__seed=0",
      "pathfinder32-lra-model__pathfinder__dense__seed=0",
      "pathfinder32-predictor-sigma1__pathfinder__dsa-predictor__seed=0",
      "pathfinder32-predictor__pathfinder__dsa-predictor__seed=0"] + [
      f"pathfinder32__pathfinder__{kind}__seed=0"
      for kind in ("dense", "dfss2-4", "dsa90", "nystrom")]
  by_group = {run.name.split("__")[0]: run for run in runs}
  finetune, lra_model = by_group["pathfinder32-ft"], by_group["pathfinder32-lra-model"]
  fit, fitted = by_group["pathfinder32-predictor"], by_group["pathfinder32-ft-fitted"]
  oracle = by_group["pathfinder32-ft-oracle"]
  fit1, fitted1 = by_group["pathfinder32-predictor-sigma1"], by_group[
      "pathfinder32-ft-fitted-sigma1"]
  for run in (finetune, lra_model, fit, fitted, oracle, fit1, fitted1):
    runs.remove(run)
  # The predictor fitted first: the dense run's model frozen, every key kept, only W~
  # trained; then the same fine-tune as finetune's, from that run.
  assert fit.depends_on == [next(r.name for r in runs if "__dense__" in r.name)]
  assert {key: fit.overrides[key] for key in (
      "attention.kind", "attention.dsa.sparsity", "optim.trainable", "num_train_steps")} == {
          "attention.kind": "dsa", "attention.dsa.sparsity": 0.0,
          "optim.trainable": "predictor_", "num_train_steps": 1560}
  assert fitted.depends_on == [fit.name] and fitted.overrides["init_from"] == fit.workdir
  assert {**fitted.overrides, "init_from": None} == {**finetune.overrides, "init_from": None}
  # The probes: the fine-tune with M from the real scores; the fit and fine-tune at sigma 1.0.
  assert {**oracle.overrides, "attention.dsa.selection_scores": None} == {
      **finetune.overrides, "attention.dsa.selection_scores": None}
  assert oracle.overrides["attention.dsa.selection_scores"] == "oracle"
  assert oracle.depends_on == finetune.depends_on
  assert {**fit1.overrides, "attention.dsa.sigma": 0.25} == fit.overrides
  assert fitted1.depends_on == [fit1.name] and fitted1.overrides["init_from"] == fit1.workdir
  assert {**fitted1.overrides, "attention.dsa.sigma": 0.25, "init_from": None} == {
      **finetune.overrides, "init_from": None}
  assert fitted1.overrides["attention.dsa.sigma"] == 1.0
  assert lra_model.overrides == {   # transformer_base.py's model; the rest is the config's
      "seed": 0, "model.dtype": "bfloat16", "data.data_dir": "data/pathfinder",
      "attention.kind": "dense", "model.num_layers": 1, "model.emb_dim": 128,
      "model.qkv_dim": 64, "model.mlp_dim": 128, "model.classifier_dim": 128,
      "model.dropout_rate": 0.2}
  assert 0 < lra_model.cost < min(run.cost for run in runs)
  dense = next(run for run in runs if "__dense__" in run.name)
  assert finetune.overrides["init_from"] == dense.workdir
  assert finetune.depends_on == [dense.name]
  assert {key: finetune.overrides[key] for key in (
      "num_train_steps", "optim.learning_rate", "attention.kind", "attention.dsa.sparsity",
      "attention.dsa.mse_gradient", "model.dtype")} == {
          "num_train_steps": 6240, "optim.learning_rate": 1e-4, "attention.kind": "dsa",
          "attention.dsa.sparsity": 0.9, "attention.dsa.mse_gradient": "predictor",
          "model.dtype": "bfloat16"}
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
      f"pathfinder32-lra-model__pathfinder__dense__seed={seed}" for seed in (1, 2)] + [
      f"pathfinder32__pathfinder__{kind}__seed={seed}"
      for kind in ("dense", "dfss2-4") for seed in (1, 2)]
  every = {run.name: run for run in _runs("all", tmp_path / "c")}   # runs chain per GPU
  assert len(every) == 21
  # The same runs as the other presets name them.
  probes = [oracle, fit1, fitted1]
  for run in runs + more + [finetune, lra_model, fit, fitted] + probes:
    twin = every[run.name]
    assert (run.config_arg, run.cost) == (twin.config_arg, twin.cost)
    assert {**run.overrides, "init_from": None} == {**twin.overrides, "init_from": None}
  table = tables.load_table(SPEC)
  assert [row.label for row in table.rows] == [
      "Transformer (dense)", "DFSS 2:4", "Nystromformer",
      "DSA-90 (sigma 0.25, mean-form L_MSE)",
      "Transformer (LRA's transformer_base.py model: 1 layer, 128/64/128)",
      "DSA-90 fine-tuned from dense (predictor-only L_MSE)",
      "DSA-90 fine-tuned from dense, predictor fitted first",
      "DSA-90 fine-tuned from dense, keys from the real scores (oracle ablation)",
      "DSA-90 (sigma 1.0) fine-tuned from dense, predictor fitted first"]
  assert [dict(row.paper) for row in table.rows] == [
      {"Pathfinder-32": 71.40}, {}, {}, {}, {"Pathfinder-32": 71.40}, {}, {}, {}, {}]
  for run in runs + more + [finetune, lra_model, fit, fitted] + probes:
    config = {"task": "pathfinder", "attention.dfss.nm": None, "attention.nystrom.nm": None,
              "attention.dsa.sparsity": None, "attention.dsa.mse_gradient": "joint",
              "attention.dsa.selection_scores": "predictor",
              "init_from": "", "model.emb_dim": 32, **run.overrides}
    held = [row.label for row in table.rows
            if all(v(config.get(k)) if callable(v) else config.get(k) == v
                   for k, v in row.match.items())]
    assert len(held) == (run not in (fit, fit1)), (run.name, held)   # the fits have no row
    if run in (fit, fit1):
      continue
    if run is oracle:
      assert held == ["DSA-90 fine-tuned from dense, keys from the real scores (oracle "
                      "ablation)"]
    elif run is fitted1:
      assert held == ["DSA-90 (sigma 1.0) fine-tuned from dense, predictor fitted first"]
    elif run is fitted:
      assert held == ["DSA-90 fine-tuned from dense, predictor fitted first"]
    elif run is finetune:
      assert held == ["DSA-90 fine-tuned from dense (predictor-only L_MSE)"]
    elif run.name.startswith("pathfinder32-lra-model"):
      assert held == ["Transformer (LRA's transformer_base.py model: 1 layer, 128/64/128)"]
    else:
      assert held == [{"dense": "Transformer (dense)", "dfss2-4": "DFSS 2:4",
                       "nystrom": "Nystromformer", "dsa90": "DSA-90 (sigma 0.25, mean-form "
                       "L_MSE)"}[run.name.split("__")[2]]], (run.name, held)
  assert tables.load_table(f"{SPEC}:best_val").split == "test_at_best_val"
  with pytest.raises(ValueError, match="unknown preset 'x'"):
    sweep_lib.load_sweep(f"{SPEC}:x")


def test_tiny_preset_trains_on_pathfinder_end_to_end(tmp_path, monkeypatch):
  """pathfinder32.py:tiny on a small generated Pathfinder set (black pixels masked: key masks
  with holes): dense runs its 20 steps and DSA-90 fine-tunes from it (after it, loading its
  parameters, the predictor fresh); each lands in its own row. The other rows' runs are left
  out to save their subprocess runs (about 40 s each on 2 cores): the test above matches every
  run of the spec to its row, lra_pixels.py's spec trains DFSS 2:4 on Pathfinder, and
  tests/test_models.py runs Nystromformer and DSA on black-pixel masks."""
  monkeypatch.chdir(REPO)
  data = pathfinder_dir_with_cue(tmp_path / "pathfinder")
  spec = spec_on_data(tmp_path, SPEC, "tiny", data)
  root = tmp_path / "root"
  states = sweep_lib.run_sweep(
      spec, str(root), show_progress=False,
      run_filter="^pathfinder32(-ft)?__.*__(dense|dsa90-ft)__")
  for name in ("pathfinder32__pathfinder-tiny__dfss2-4__seed=0",           # covered above
               "pathfinder32__pathfinder-tiny__nystrom__seed=0",
               "pathfinder32__pathfinder-tiny__dsa90__seed=0",
               "pathfinder32-lra-model__pathfinder-tiny__dense__seed=0",
               "pathfinder32-predictor__pathfinder-tiny__dsa-predictor__seed=0",
               "pathfinder32-ft-fitted__pathfinder-tiny__dsa90-ft__seed=0",
               "pathfinder32-ft-oracle__pathfinder-tiny__dsa90-oracle-ft__seed=0",
               "pathfinder32-predictor-sigma1__pathfinder-tiny__dsa-predictor__seed=0",
               "pathfinder32-ft-fitted-sigma1__pathfinder-tiny__dsa90-ft__seed=0"):
    assert states.pop(name) == "pending"
  assert set(states.values()) == {"finished"}, states
  with open(root / "pathfinder32-ft__pathfinder-tiny__dsa90-ft__seed=0" / "metrics.jsonl") as f:
    init = [json.loads(line) for line in f if '"init_from"' in line]
  assert len(init) == 1 and init[0]["fresh_params"] > 0, init   # the predictor starts fresh
  text = tables.make_table(str(root), spec, "markdown", report=tables.Reporter(echo=False))
  rows = [line.split(" |")[0] for line in text.splitlines() if "(n=1)" in line]
  assert rows == ["| Transformer (dense)",
                  "| DSA-90 fine-tuned from dense (predictor-only L_MSE)"], text
