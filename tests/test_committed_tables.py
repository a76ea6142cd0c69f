"""The committed accuracy tables against their committed runs, recomputed without the table code.

Each row of a committed markdown table is matched to run folders by run name (the mapping is
written out here by hand, not read from the spec), and its cell is recomputed from the runs'
``result.json`` with numpy: the mean and sample std (ddof=1) of test accuracy (%) at the last
step or at the best validation step, n = finished runs, the runs whose last-step test is more
than 1.5 points under their best-validation test ("k collapsed"), those whose last-step test
put at least 99% of the examples in one predicted class ("k one-class"), the runs without a
result ("k unfinished"), and the paper's value with our mean minus it. A table edited by hand,
or rebuilt from other runs, fails here.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "experiments", "results")

_RECIPE_ARMS = {
    "LRA's recipe (the default config)": "lra",
    "model's earlier parameters (biases, lecun_normal, CLS N(0, 0.02))": "earlier-model",
    "attention dropout 0": "attn-dropout0",
    "gradient clipping at norm 1": "clip1",
    "peak learning rate halved (0.025 rsqrt)": "lr0.025",
    "Adam b2 0.999, eps 1e-6": "adam-b2-0.999",
    "evaluation on XLA too (not cuDNN)": "xla-eval",
}
_RECIPE_ROWS = {f"{dtype}: {label}": rf"{dtype}__listops__{re.escape(arm)}__seed=\d+"
                for dtype in ("fp32", "bf16") for label, arm in _RECIPE_ARMS.items()}
_RECIPE_5000_ROWS = dict(_RECIPE_ROWS, **{
    "bf16: DFSS 1:2, lra_listops's config, Mosaic GPU kernels": r"dfss__listops__dfss1-2-mosaic__seed=\d+",
    "bf16: DFSS 1:2, lra_listops's config, Triton kernels": r"dfss__listops__dfss1-2-triton__seed=\d+",
    "bf16: DFSS 1:2, peak learning rate halved (0.025 rsqrt)": r"dfss__listops__dfss1-2-lr0\.025__seed=\d+",
})
_PROTOCOL_ROWS = {f"fp32: {label}": _RECIPE_ROWS[f"fp32: {label}"]
                  for label in ("LRA's recipe (the default config)",
                                "peak learning rate halved (0.025 rsqrt)")}
_LRA_LISTOPS_ROWS = {
    "Transformer (dense, cuDNN)": r"listops__dense__seed=\d+",
    "DFSS 1:2": r"listops__dfss1-2__seed=\d+",
    "DFSS 2:4": r"listops__dfss2-4__seed=\d+",
    "Nystromformer": r"listops__nystrom__seed=\d+",
    "Nystromformer + DFSS 2:4": r"listops__nystrom-dfss2-4__seed=\d+",
    "DSA-90 (sigma 0.25, mean-form L_MSE)": r"listops__dsa90__seed=\d+",
}
_DFSS_TABLE4_LISTOPS_ROWS = {
    "Transformer (float)": r"float-listops__listops-stable__dense-fp32__seed=\d+",
    "Transformer (bfloat16)": r"bf16-listops__listops-stable__dense-bf16__seed=\d+",
    "Dfss 1:2 (float)": r"float-listops__listops-stable__dfss1-2-fp32__seed=\d+",
    "Dfss 2:4 (bfloat16)": r"bf16-listops__listops-stable__dfss2-4-bf16__seed=\d+",
}
_PATHFINDER32_ROWS = {
    "Transformer (dense)": r"pathfinder32__pathfinder__dense__seed=\d+",
    "DFSS 2:4": r"pathfinder32__pathfinder__dfss2-4__seed=\d+",
    "Nystromformer": r"pathfinder32__pathfinder__nystrom__seed=\d+",
    "DSA-90 (sigma 0.25, mean-form L_MSE)": r"pathfinder32__pathfinder__dsa90__seed=\d+",
    "Transformer (LRA's transformer_base.py model: 1 layer, 128/64/128)":
        r"pathfinder32-lra-model__pathfinder__dense__seed=\d+",
    "DSA-90 fine-tuned from dense (predictor-only L_MSE)":
        r"pathfinder32-ft__pathfinder__dsa90-ft__seed=\d+",
    "DSA-90 fine-tuned from dense, predictor fitted first":
        r"pathfinder32-ft-fitted__pathfinder__dsa90-ft__seed=\d+",
    "DSA-90 fine-tuned from dense, keys from the real scores (oracle ablation)":
        r"pathfinder32-ft-oracle__pathfinder__dsa90-oracle-ft__seed=\d+",
    "DSA-90 (sigma 1.0) fine-tuned from dense, predictor fitted first":
        r"pathfinder32-ft-fitted-sigma1__pathfinder__dsa90-ft__seed=\d+",
}
_DSA_MSE_ROWS = {
    "Dense (the base runs)": r"dense__listops-stable__seed=\d+",
    "Predictor warm-up (500 steps on dense attention)": r"warm__listops-stable__seed=\d+",
    "DSA-90, joint update (Eq. 6 weight 1e-06)": r"dsa__listops-stable__dsa90-joint__seed=\d+",
    **{f"DSA-90, joint update (Eq. 6 weight {w})":
       rf"dsa__listops-stable__dsa90-joint-w{w}__seed=\d+" for w in ("1e-12", "1e-10", "1e-08")},
    "DSA-90, joint update, L_MSE kept from the block input X":
        r"dsa__listops-stable__dsa90-joint-no-x-grad__seed=\d+",
    "DSA-90, predictor-only L_MSE": r"dsa__listops-stable__dsa90-predictor__seed=\d+",
    "DSA-90, predictor-only, after a 500-step predictor warm-up":
        r"dsa__listops-stable__dsa90-warm__seed=\d+",
    "DSA-90 64 x 64 blocks, predictor-only, after the warm-up":
        r"dsa__listops-stable__dsa90-block-warm__seed=\d+",
}
_DSA_GRANULARITY_ROWS = {
    "Dense (the base runs)": r"dense__listops-stable__seed=\d+",
    "DSA-90, fine-grained": r"dsa__listops-stable__dsa90__seed=\d+",
    "DSA-90, 64 x 64 blocks": r"dsa__listops-stable__dsa90-block__seed=\d+",
    "DSA-95, fine-grained": r"dsa__listops-stable__dsa95__seed=\d+",
    "DSA-95, 64 x 64 blocks": r"dsa__listops-stable__dsa95-block__seed=\d+",
}
_DSA_WEIGHT_ROWS = {f"weight {w}": rf"dsa__listops-stable__w{w}__seed=\d+"
                    for w in ("1e-06", "0.0001", "0.01", "1")}
_SPT_KINDS = {"Transformer (dense)": "dense", "DFSS 2:4": "dfss2-4",
              "DSA-90 (sigma 0.25, mean-form L_MSE)": "dsa90", "Nystromformer": "nystrom"}


def _spt_kind_rows(kinds: dict) -> tuple[dict, dict]:
  """The per-kind SPT tables' rows (label -> run-name pattern) for ``kinds`` (row label ->
  run-name kind): the accuracy table's "from scratch" and "+ SPT" rows, and the pretrain_val
  table's rows."""
  accuracy, pretrain = {}, {}
  for label, kind in kinds.items():
    accuracy[f"{label}, from scratch"] = rf"scratch-listops-{kind}__listops-stable__seed=\d+"
    accuracy[f"{label} + SPT"] = rf"finetune-listops-{kind}__listops-stable__seed=\d+"
    pretrain[label] = rf"pretrain-listops__listops__{kind}__seed=\d+"
  return accuracy, pretrain


_SPT_ROWS, _SPT_PRETRAIN_ROWS = _spt_kind_rows(_SPT_KINDS)
_SPT_CURVE_ROWS = {f"pretrained {steps} steps":
                   rf"finetune-dense-after-{steps}__listops-stable__seed=0"
                   for steps in (1000, 2500, 5000, 10000)}
_SPT_RECIPE_PRETRAIN_ROWS = {
    "dense as the first runs (sinusoidal positions, LRA's 0.05 rsqrt)": "first",
    "dense, rotary positions": "rotary",
    "dense, learned positions": "learned",
    "dense, peak learning rate / 5 (0.01 rsqrt)": "lr0.01",
    "dense, rotary, 0.01 rsqrt": "rotary-lr0.01",
    "dense, rotary, 0.2 rsqrt (x4)": "rotary-lr0.2",
    "dense, rotary, no dropout": "rotary-nodropout",
    "Nystromformer (conv skip of 35, as the first runs)": "nystrom",
    "Nystromformer without its conv skip": "nystrom-noconv",
}
_SPT_RECIPE_SCRATCH = {
    "dense, sinusoidal positions": "sinusoidal", "dense, rotary positions": "rotary",
    "dense, learned positions": "learned", "Nystromformer (conv skip of 35)": "nystrom",
    "Nystromformer without its conv skip": "nystrom-noconv"}


def _spt_recipe_finetune_rows(variants, archs):
  rows = {f"{label}, from scratch": rf"scratch-{re.escape(arch)}__listops-stable__seed=0"
          for label, arch in _SPT_RECIPE_SCRATCH.items() if arch in archs}
  rows.update({f"{label} + SPT": rf"finetune-{re.escape(variant)}__listops-stable__seed=0"
               for label, variant in _SPT_RECIPE_PRETRAIN_ROWS.items() if variant in variants})
  return rows


_SPT_RECIPE_FINETUNE_ROWS = _spt_recipe_finetune_rows(_SPT_RECIPE_PRETRAIN_ROWS.values(),
                                                      _SPT_RECIPE_SCRATCH.values())
_SPT_LONG_ROWS = _spt_recipe_finetune_rows(("rotary", "nystrom"), ("rotary", "nystrom"))
_SPT_CONV_PROBE_ARCHS = {"dense, sinusoidal positions, conv skip of 35 on V": "conv",
                         "dense, rotary positions, conv skip of 35 on V": "rotary-conv"}
_SPT_CONV_PROBE_ROWS = {}
for _label, _arch in _SPT_CONV_PROBE_ARCHS.items():
  _SPT_CONV_PROBE_ROWS[f"{_label}, from scratch"] = rf"scratch-{_arch}__listops-stable__seed=0"
  _SPT_CONV_PROBE_ROWS[f"{_label} + SPT"] = rf"finetune-{_arch}__listops-stable__seed=0"
# The rotary_long preset: the softmax kinds' rows name their rotary positions.
_SPT_ROTARY_LONG_ROWS, _SPT_ROTARY_LONG_PRETRAIN_ROWS = _spt_kind_rows(
    {(label if kind == "nystrom" else f"{label}, rotary positions"): kind
     for label, kind in _SPT_KINDS.items()})
# The conv_long preset: the softmax kinds' rows also name the conv skip on V.
_SPT_CONV_LONG_ROWS, _SPT_CONV_LONG_PRETRAIN_ROWS = _spt_kind_rows(
    {(label if kind == "nystrom" else f"{label}, rotary positions, conv skip of 35 on V"): kind
     for label, kind in _SPT_KINDS.items()})
# Each "+ SPT" row's gain is shown against its architecture's from-scratch row ("vs scratch"),
# and in the per-kind tables each other kind's against dense with SPT ("vs dense + SPT"). The
# recipe tables' pretraining variants and the architecture each fine-tunes:
_SPT_VARIANT_ARCH = {"first": "sinusoidal", "rotary": "rotary", "learned": "learned",
                     "lr0.01": "sinusoidal", "rotary-lr0.01": "rotary", "rotary-lr0.2": "rotary",
                     "rotary-nodropout": "rotary", "nystrom": "nystrom",
                     "nystrom-noconv": "nystrom-noconv"}
_SPT_KIND_FOLDERS = ("self_pretraining", "self_pretraining_rotary_long",
                     "self_pretraining_conv_long")
_SPT_VARIANT_FOLDERS = ("self_pretraining_recipe", "self_pretraining_long_finetune",
                        "self_pretraining_conv_probe")


def _versus(folder: str, label: str, labels) -> dict[str, str]:
  """{note name: the row label it compares ``label`` with} for a committed table's row."""
  if not label.endswith(" + SPT"):
    return {}
  if folder in _SPT_KIND_FOLDERS:
    versus = {"vs scratch": label.removesuffix(" + SPT") + ", from scratch"}
    if not label.startswith("Transformer (dense)"):
      versus["vs dense + SPT"] = next(l for l in labels if l.startswith("Transformer (dense)")
                                      and l.endswith(" + SPT"))
    return versus
  if folder in _SPT_VARIANT_FOLDERS:
    variant = _SPT_RECIPE_PRETRAIN_ROWS.get(label.removesuffix(" + SPT"))
    if variant is None:                       # conv_probe: one variant per architecture
      return {"vs scratch": label.removesuffix(" + SPT") + ", from scratch"}
    scratch = {arch: l for l, arch in _SPT_RECIPE_SCRATCH.items()}
    return {"vs scratch": f"{scratch[_SPT_VARIANT_ARCH[variant]]}, from scratch"}
  return {}


# Runs of a folder that no table of it shows (the pretraining stage of the curve and of the
# long fine-tunes).
_UNTABLED = {"self_pretraining_curve": r"pretrain__listops__dense-\d+__seed=0",
             "self_pretraining_long_finetune": r"pretrain__listops__(rotary|nystrom)__seed=0",
             # DSA's predictor fitted on the frozen dense model (a stage, not a table row)
             "pathfinder32":
                 r"pathfinder32-predictor(-sigma1)?__pathfinder__dsa-predictor__seed=\d+"}
# Published values beside the rows, written out here from the papers (LRA: Tay et al. 2021;
# DFSS Table 4): label -> value; rows not named have none.
_PAPER = {label: 36.37 for label in _RECIPE_5000_ROWS}
_PAPER.update({"Transformer (dense, cuDNN)": 36.37, "DFSS 1:2": 36.85, "DFSS 2:4": 37.19})
_PAPER.update({"Transformer (float)": 35.91, "Transformer (bfloat16)": 35.92,
               "Dfss 1:2 (float)": 36.85, "Dfss 2:4 (bfloat16)": 37.19})
# Tables of another task than ListOps: folder -> {label: value} (Pathfinder-32: LRA's
# Transformer only; DFSS and DSA left Pathfinder out).
_PAPER_BY_FOLDER = {"pathfinder32": {
    "Transformer (dense)": 71.40,
    "Transformer (LRA's transformer_base.py model: 1 layer, 128/64/128)": 71.40}}


def _last_and_best_val(stem: str, folder: str, rows: dict) -> list:
  """A table's two committed files: ``stem``.md (last-step test) and ``stem``_best_val.md."""
  return [(f"{stem}.md", folder, "test", rows),
          (f"{stem}_best_val.md", folder, "test_at_best_val", rows)]


# (table file, runs folder, result.json split, rows: label -> run-name pattern); the cell is
# the table's first data column (ListOps where a table has more).
TABLES = [
    *_last_and_best_val("lra_listops", "lra_listops", _LRA_LISTOPS_ROWS),
    *_last_and_best_val("listops_recipe_short", "listops_recipe", _RECIPE_ROWS),
    *_last_and_best_val("listops_recipe_5000", "listops_recipe_5000", _RECIPE_5000_ROWS),
    *_last_and_best_val("listops_protocol", "listops_protocol", _PROTOCOL_ROWS),
    *_last_and_best_val("dfss_table4_listops", "dfss_table4", _DFSS_TABLE4_LISTOPS_ROWS),
    *_last_and_best_val("pathfinder32", "pathfinder32", _PATHFINDER32_ROWS),
    *_last_and_best_val("dsa_listops_mse", "dsa_listops_mse", _DSA_MSE_ROWS),
    *_last_and_best_val("dsa_listops_granularity", "dsa_listops", _DSA_GRANULARITY_ROWS),
    ("dsa_listops_weight.md", "dsa_listops_weight", "val", _DSA_WEIGHT_ROWS),
    *_last_and_best_val("self_pretraining_listops", "self_pretraining", _SPT_ROWS),
    ("self_pretraining_listops_pretrain_val.md", "self_pretraining", "val", _SPT_PRETRAIN_ROWS),
    *_last_and_best_val("self_pretraining_curve", "self_pretraining_curve", _SPT_CURVE_ROWS),
    ("self_pretraining_recipe_pretrain_val.md", "self_pretraining_recipe", "val",
     {label: rf"pretrain__listops__{re.escape(variant)}__seed=0"
      for label, variant in _SPT_RECIPE_PRETRAIN_ROWS.items()}),
    *_last_and_best_val("self_pretraining_recipe_finetune", "self_pretraining_recipe",
                        _SPT_RECIPE_FINETUNE_ROWS),
    *_last_and_best_val("self_pretraining_long_finetune", "self_pretraining_long_finetune",
                        _SPT_LONG_ROWS),
    *_last_and_best_val("self_pretraining_conv_probe", "self_pretraining_conv_probe",
                        _SPT_CONV_PROBE_ROWS),
    ("self_pretraining_conv_probe_pretrain_val.md", "self_pretraining_conv_probe", "val",
     {label: rf"pretrain__listops__{arch}__seed=0"
      for label, arch in _SPT_CONV_PROBE_ARCHS.items()}),
    *_last_and_best_val("self_pretraining_rotary_long", "self_pretraining_rotary_long",
                        _SPT_ROTARY_LONG_ROWS),
    ("self_pretraining_rotary_long_pretrain_val.md", "self_pretraining_rotary_long", "val",
     _SPT_ROTARY_LONG_PRETRAIN_ROWS),
    *_last_and_best_val("self_pretraining_conv_long", "self_pretraining_conv_long",
                        _SPT_CONV_LONG_ROWS),
    ("self_pretraining_conv_long_pretrain_val.md", "self_pretraining_conv_long", "val",
     _SPT_CONV_LONG_PRETRAIN_ROWS),
]


def _table_rows(path: str) -> dict[str, str]:
  """Row label -> its first data cell, from a markdown table."""
  rows = {}
  for line in open(path, encoding="utf-8"):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| ") and len(cells) >= 2 and cells[0] != "Model":
      rows[cells[0]] = cells[1]
  return rows


def _cell_values(folder: str, pattern: str, split: str) -> tuple[list, int, int, int]:
  """(finished runs' values, unfinished runs, collapsed runs, one-class runs) of the runs
  ``pattern`` names."""
  values, unfinished, collapsed, one_class = [], 0, 0, 0
  for name in sorted(os.listdir(folder)):
    if not re.fullmatch(pattern, name):
      continue
    result = os.path.join(folder, name, "result.json")
    if not os.path.exists(result):
      unfinished += 1
      continue
    with open(result) as f:
      record = json.load(f)
    values.append(100.0 * record[split]["accuracy"])
    # Accuracies are counts over a split: a gap of exactly 1.5 points (30 of 2000) is not a
    # collapse, whatever the last bits of 100 * (0.535 - 0.52) say.
    gap = 100.0 * (record["test_at_best_val"]["accuracy"] - record["test"]["accuracy"])
    collapsed += round(gap, 6) > 1.5
    # One-class: the last-step test put at least 99% of the examples in one predicted class.
    shares = [v for k, v in record["test"].items() if k.startswith("predicted_")]
    one_class += bool(shares) and max(shares) >= 0.99
  return values, unfinished, collapsed, one_class


def _expected_cell(cell: tuple[list, int, int, int], paper, versus: dict) -> str:
  """The cell recomputed: value, then (n, collapsed, one-class, unfinished, paper, delta,
  versus) notes; ``versus``: {name: the other row's values}."""
  values, unfinished, collapsed, one_class = cell
  notes = [f"n={len(values)}"] if values else []
  notes += [f"{collapsed} collapsed"] * bool(collapsed)
  notes += [f"{one_class} one-class"] * bool(one_class)
  notes += [f"{unfinished} unfinished"] * bool(unfinished)
  if paper is not None:
    notes.append(f"paper {paper:.2f}")
    if values:
      notes.append(f"Δ {np.mean(values) - paper:+.2f}")
  notes += [f"Δ {name} {np.mean(values) - np.mean(other):+.2f}"
            for name, other in versus.items() if values and other]
  if not values:
    return f"— ({', '.join(notes)})" if notes else "—"
  value = (f"{values[0]:.2f}" if len(values) == 1 else
           f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}")
  return f"{value} ({', '.join(notes)})"


@pytest.mark.parametrize("table,folder,split,rows", TABLES, ids=[t[0] for t in TABLES])
def test_committed_table_is_its_runs(table, folder, split, rows):
  committed = _table_rows(os.path.join(RESULTS, table))
  assert set(committed) == set(rows), (set(committed) ^ set(rows))
  cells = {label: _cell_values(os.path.join(RESULTS, folder), pattern, split)
           for label, pattern in rows.items()}
  for label in rows:
    # Self-pretraining has no published ListOps value (its row labels reuse kinds' names).
    if folder in _PAPER_BY_FOLDER:
      paper = _PAPER_BY_FOLDER[folder].get(label)
    else:
      paper = None if folder.startswith("self_pretraining") else _PAPER.get(label)
    versus = {name: cells[other][0] for name, other in _versus(folder, label, rows).items()}
    want = _expected_cell(cells[label], paper, versus)
    assert committed[label] == want, (table, label, committed[label], want)


def test_every_committed_run_belongs_to_a_row():
  """No committed run folder is left out of every table of its folder (a run the patterns miss
  would make the check above vacuous for it), but the runs _UNTABLED names."""
  patterns = {}
  for _, folder, _, rows in TABLES:
    patterns.setdefault(folder, [_UNTABLED[folder]] if folder in _UNTABLED else [])
    patterns[folder] += rows.values()
  for folder, folder_patterns in patterns.items():
    path = os.path.join(RESULTS, folder)
    names = [n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))]
    orphans = [n for n in names if not any(re.fullmatch(p, n) for p in folder_patterns)]
    assert not orphans, (folder, orphans)


# Committed learning curves (csv, beside their PNG): (csv file, run folder, split, rows).
CURVES = [
    ("self_pretraining_conv_long_curves.csv", "self_pretraining_conv_long", "val",
     _SPT_CONV_LONG_ROWS),
    ("self_pretraining_conv_long_pretrain_curves.csv", "self_pretraining_conv_long", "val",
     _SPT_CONV_LONG_PRETRAIN_ROWS),
]


def _metric_points(path: str, split: str) -> dict[int, float]:
  """{step: val accuracy} of one metrics.jsonl, the last record of a step winning."""
  points = {}
  for line in open(path):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if record.get("split") == split and isinstance(record.get("accuracy"), float):
      points[int(record["step"])] = record["accuracy"]
  return points


@pytest.mark.parametrize("curves,folder,split,rows", CURVES, ids=[c[0] for c in CURVES])
def test_committed_curves_are_their_runs(curves, folder, split, rows):
  """Each line of a committed curves csv (column, row, step, mean, low, high, n) recomputed
  with numpy from the metrics.jsonl of the runs its row's pattern names, finished or not: the
  mean, lowest and highest val accuracy (%) of the runs that logged the step."""
  with open(os.path.join(RESULTS, curves)) as f:
    header, *lines = [line.rstrip("\n") for line in f]
  assert header == "column,row,step,mean,low,high,n"
  want = []
  for label, pattern in rows.items():
    runs = [_metric_points(os.path.join(RESULTS, folder, name, "metrics.jsonl"), split)
            for name in sorted(os.listdir(os.path.join(RESULTS, folder)))
            if re.fullmatch(pattern, name)]
    for step in sorted(set().union(*runs)):
      values = 100.0 * np.array([run[step] for run in runs if step in run])
      want.append((label, step, values.mean(), values.min(), values.max(), len(values)))
  got = []
  for line in lines:
    column, rest = line.split(",", 1)
    assert column == "ListOps"
    label, step, mean, low, high, n = rest.rsplit(",", 5)
    got.append((label.strip('"'), int(step), float(mean), float(low), float(high), int(n)))
  assert sorted(r[:2] for r in got) == sorted(r[:2] for r in want)
  by_key = {r[:2]: r for r in want}
  for row in got:
    expected = by_key[row[:2]]
    np.testing.assert_allclose(row[2:5], expected[2:5], atol=1e-6, err_msg=str(row[:2]))
    assert row[5] == expected[5], row
