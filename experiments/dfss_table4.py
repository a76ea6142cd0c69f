"""DFSS paper, Table 4: LRA accuracy of dense vs. DFSS attention, plus Pathfinder.

Sweep:  python -m lra_sparse.sweep --sweep=experiments/dfss_table4.py --root=runs/dfss_table4
Table:  python -m lra_sparse.tables --root=runs/dfss_table4 --spec=experiments/dfss_table4.py \
          --format=markdown --out=experiments/results/dfss_table4.md
Tiny (CPU): the same with ``experiments/dfss_table4.py:tiny`` and ``--root=runs/dfss_table4_tiny``.

Rows as in the paper: Transformer (float), Transformer (bfloat16), Dfss 1:2 (float), Dfss 2:4
(bfloat16), each trained from scratch with the task's LRA config ("trained from scratch under
the default configurations", Sec. 5). bfloat16 rows compute in bf16 (model.dtype) and evaluate
with params cast to bf16 (eval_dtype), as the paper tests its bf16 models. Sequence lengths as
in the paper's header: ListOps and Text 2048 (data.max_length), Retrieval 4000, Image 1024.
Pathfinder (1K) is added; the paper could not reproduce it. The Avg column averages the four
tasks of the paper. 3 seeds (the paper reports one number per cell).
"""
from experiments._tiny import TINY_SEEDS, check_preset, tiny_steps
from lra_sparse.sweep import Group, Sweep, Variant
from lra_sparse.tables import Selector, Table

SEEDS = (0, 1, 2)
TASKS = (  # (config file stem, column label, full-size overrides)
    ("listops", "ListOps", {"data.max_length": 2048}),
    ("text", "Text", {"data.max_length": 2048}),
    ("retrieval", "Retrieval", {}),
    ("image", "Image", {}),
    ("pathfinder", "Pathfinder", {}),
)
BF16 = {"model.dtype": "bfloat16", "eval_dtype": "bfloat16"}
VARIANTS = (  # (run-name label, row label, overrides)
    ("dense-fp32", "Transformer (float)", {"attention.kind": "dense", "model.dtype": "float32"}),
    ("dense-bf16", "Transformer (bfloat16)", {"attention.kind": "dense", **BF16}),
    ("dfss1-2-fp32", "Dfss 1:2 (float)",
     {"attention.kind": "dfss", "attention.dfss.nm": "1:2", "model.dtype": "float32"}),
    ("dfss2-4-bf16", "Dfss 2:4 (bfloat16)",
     {"attention.kind": "dfss", "attention.dfss.nm": "2:4", **BF16}),
)


def get_sweep(preset: str = "") -> Sweep:
  tiny = check_preset(preset, "experiments/dfss_table4.py")
  groups = []
  for task, _, full_overrides in TASKS:
    groups.append(Group(
        config=f"configs/{task}.py" + (":tiny" if tiny else ""),
        overrides=tiny_steps(30) if tiny else full_overrides,
        variants=[Variant(name, overrides) for name, _, overrides in VARIANTS],
        seeds=TINY_SEEDS if tiny else SEEDS))
  return Sweep(name="dfss_table4" + ("_tiny" if tiny else ""), groups=groups)


def get_table(preset: str = "") -> Table:
  tiny = check_preset(preset, "experiments/dfss_table4.py")
  return Table(
      title="DFSS Table 4: LRA test accuracy (%)" + (" [tiny CPU variant]" if tiny else ""),
      rows=[Selector(row, {k: v for k, v in overrides.items() if k != "eval_dtype"})
            for _, row, overrides in VARIANTS],
      columns=[Selector(label, {"task": task}) for task, label, _ in TASKS],
      average=["ListOps", "Text", "Retrieval", "Image"],
      average_label="Avg (4 tasks)",
  )
