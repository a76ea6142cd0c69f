"""Two short ListOps runs for `lra_sparse.sweep --parallel=gpus` on a machine with two GPUs.

  python -m lra_sparse.generators.listops --output_dir=data/listops_dp --num_train=8000 \
      --num_val=500 --num_test=500 --seed=0
  python -m lra_sparse.sweep --sweep=experiments/specs/data_parallel_sweep.py --root=ROOT \
      --parallel=gpus
  python -m lra_sparse.tables --root=ROOT --spec=experiments/specs/data_parallel_sweep.py

The sweep places one run per GPU (CUDA_VISIBLE_DEVICES), so both run at once; each run's
``slot``, start and end are in the sweep manifest (``<ROOT>/sweep.json``), and the table is
rebuilt from the runs' logs. LRA's ListOps model in bf16, 300 steps: a check of the placement,
not an accuracy result. Preset "smoke": the tiny CPU model for 6 steps (used by the tests).
"""
from lra_sparse.config import EARLIER_MODEL
from lra_sparse.sweep import Group, Sweep, Variant
from lra_sparse.tables import Selector, Table

DATA_DIR = "data/listops_dp"
KINDS = (("Transformer (dense)", "dense", {"attention.kind": "dense"}),
         ("DFSS 2:4", "dfss2-4", {"attention.kind": "dfss", "attention.dfss.nm": "2:4"}))


def _steps(preset: str) -> dict:
  if preset not in ("", "smoke"):
    raise ValueError(f"unknown preset {preset!r} for experiments/specs/data_parallel_sweep.py; "
                     "known: '', 'smoke'")
  steps = 6 if preset else 300
  return {"num_train_steps": steps, "eval_every_steps": steps, "checkpoint_every_steps": steps,
          "log_every_steps": max(1, steps // 6), "num_eval_batches": 4}


def get_sweep(preset: str = "") -> Sweep:
  overrides = dict(_steps(preset), **{"data.data_dir": DATA_DIR})
  if not preset:     # the committed runs: bf16, the model's earlier parameters
    overrides.update({"model.dtype": "bfloat16", **EARLIER_MODEL})
  return Sweep(name="data_parallel" + (f"_{preset}" if preset else ""),
               groups=[Group(config="configs/listops.py" + (":tiny" if preset else ""),
                             overrides=overrides,
                             variants=[Variant(name, match) for _, name, match in KINDS])])


def get_table(preset: str = "") -> Table:
  _steps(preset)
  return Table(title="ListOps, two runs placed one per GPU by --parallel=gpus: test accuracy (%)",
               rows=[Selector(label, match) for label, _, match in KINDS],
               columns=[Selector("ListOps (300 steps)", {"task": "listops"})])
