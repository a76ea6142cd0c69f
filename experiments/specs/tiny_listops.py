"""Tiny ListOps on CPU: dense vs. DFSS 2:4 vs. DSA-90 (trained from scratch), 2 seeds.

Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/tiny_listops.py \
          --root=runs/tiny_listops
Table:  python -m lra_sparse.tables --root=runs/tiny_listops \
          --spec=experiments/specs/tiny_listops.py \
          --format=markdown --out=experiments/results/tiny_listops.md \
          --plot=experiments/results/tiny_listops.png

Presets: "" = the ``tiny`` ListOps preset (2 layers, width 64, length 100) for 400 steps;
"smoke" = 20 steps, a check that the whole pipeline (sweep -> trainer -> tables) works.
The plot puts each kind at the fraction of attention scores it drops (dense 0, DFSS 2:4 0.5,
DSA its sparsity; DSA-75 is there so that the DSA line has two points), dense also as a band.
"""
from lra_sparse.config import EARLIER_MODEL
from lra_sparse.ops.nm import parse_nm
from lra_sparse.sweep import Group, Sweep
from lra_sparse.tables import Plot, Selector, Table

SEEDS = (0, 1)
VARIANTS = (
    ("Dense", {"attention.kind": "dense"}),
    ("DFSS 2:4", {"attention.kind": "dfss", "attention.dfss.nm": "2:4"}),
    ("DSA-75", {"attention.kind": "dsa", "attention.dsa.sparsity": 0.75}),
    ("DSA-90", {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9}),
)


def _steps(preset: str) -> dict:
  if preset == "smoke":
    return {"num_train_steps": 20, "eval_every_steps": 10, "checkpoint_every_steps": 10,
            "log_every_steps": 5, "num_eval_batches": 2}
  if preset:
    raise ValueError(f"unknown preset {preset!r} for experiments/specs/tiny_listops.py; "
                     "known: '', 'smoke'")
  # Half of the preset's 800 steps: 8 runs fit in minutes on a 2-core CPU.
  # The committed table ran the model's earlier parameters (LRA_DIFFERENCES.md).
  return {"num_train_steps": 400, "eval_every_steps": 200, "checkpoint_every_steps": 200,
          "log_every_steps": 20, **EARLIER_MODEL}


def get_sweep(preset: str = "") -> Sweep:
  return Sweep(
      name="tiny_listops" + (f"_{preset}" if preset else ""),
      groups=[Group(config="configs/listops.py:tiny", overrides=_steps(preset),
                    variants=[match for _, match in VARIANTS], seeds=SEEDS)])


def dropped_fraction(config) -> float | None:
  """Fraction of a query's attention scores the kind drops: dense 0, N:M 1 - N/M, DSA sparsity."""
  kind = config.get("attention.kind")
  if kind == "dense":
    return 0.0
  if kind == "dfss":
    n, m = parse_nm(config["attention.dfss.nm"])
    return 1.0 - n / m
  if kind == "dsa":
    return config["attention.dsa.sparsity"]
  return None


def get_table(preset: str = "") -> Table:
  _steps(preset)  # validates the preset
  rows = [Selector(label, match) for label, match in VARIANTS]
  return Table(
      title="Tiny ListOps (CPU, tiny preset" + (", 20 steps" if preset else ", 400 steps")
            + "): test accuracy (%)",
      rows=rows,
      columns=[Selector("ListOps (tiny)", {"task": "listops"})],
      plot=Plot(x=dropped_fraction, xlabel="fraction of attention scores dropped per query",
                series=[rows[0], rows[1], Selector("DSA", {"attention.kind": "dsa"})],
                baselines=[Selector("Dense mean ± std", rows[0].match)],
                title="Tiny ListOps: test accuracy vs. attention sparsity"),
  )
