"""DFSS paper, Table 6: Nystromformer pretrained, then fine-tuned with DFSS, on LRA Image.

Sweep:  python -m lra_sparse.sweep --sweep=experiments/dfss_table6_nystrom.py \
          --root=runs/dfss_table6
Table:  python -m lra_sparse.tables --root=runs/dfss_table6 \
          --spec=experiments/dfss_table6_nystrom.py --format=markdown \
          --out=experiments/results/dfss_table6.md
Tiny (CPU): ``experiments/dfss_table6_nystrom.py:tiny`` with ``--root=runs/dfss_table6_tiny``.

As in the paper (App. A.7): a standard Nystromformer (float) is pretrained from scratch for
35,000 iterations, then each row fine-tunes that checkpoint (init_from) for 3,500 iterations
(1/10) as Nystromformer (float), Nystromformer (bfloat16), Nystromformer + Dfss 1:2 (float) and
Nystromformer + Dfss 2:4 (bfloat16) (F and B N:M-pruned: attention.nystrom.nm). One pretrain run per
seed; every fine-tune run starts from the pretrain run of the same seed. Landmarks, conv kernel
and the optimizer follow configs/image.py.
"""
from experiments._tiny import TINY_SEEDS, check_preset, tiny_steps
from lra_sparse.sweep import Group, Ref, Sweep, Variant
from lra_sparse.tables import Selector, Table

SEEDS = (0, 1, 2)
PRETRAIN_STEPS, FINETUNE_STEPS = 35_000, 3_500
BF16 = {"model.dtype": "bfloat16", "eval_dtype": "bfloat16"}
VARIANTS = (  # (run-name label, row label, overrides)
    ("nystrom-fp32", "Nystromformer (float)",
     {"attention.nystrom.nm": "", "model.dtype": "float32"}),
    ("nystrom-bf16", "Nystromformer (bfloat16)", {"attention.nystrom.nm": "", **BF16}),
    ("nystrom-dfss1-2-fp32", "Nystromformer + Dfss 1:2 (float)",
     {"attention.nystrom.nm": "1:2", "model.dtype": "float32"}),
    ("nystrom-dfss2-4-bf16", "Nystromformer + Dfss 2:4 (bfloat16)",
     {"attention.nystrom.nm": "2:4", **BF16}),
)


def get_sweep(preset: str = "") -> Sweep:
  tiny = check_preset(preset, "experiments/dfss_table6_nystrom.py")
  config = "configs/image.py" + (":tiny" if tiny else "")
  seeds = TINY_SEEDS if tiny else SEEDS
  pretrain = Group(
      name="pretrain", config=config, seeds=seeds,
      overrides={"attention.kind": "nystrom", "attention.nystrom.nm": "",
                 "model.dtype": "float32",
                 **(tiny_steps(30) if tiny else {"num_train_steps": PRETRAIN_STEPS})})
  finetune = Group(
      name="finetune", config=config, seeds=seeds,
      overrides={"attention.kind": "nystrom", "init_from": Ref("pretrain"),
                 **(tiny_steps(20) if tiny else {"num_train_steps": FINETUNE_STEPS})},
      variants=[Variant(name, overrides) for name, _, overrides in VARIANTS])
  return Sweep(name="dfss_table6_nystrom" + ("_tiny" if tiny else ""),
               groups=[pretrain, finetune])


def get_table(preset: str = "") -> Table:
  tiny = check_preset(preset, "experiments/dfss_table6_nystrom.py")
  return Table(
      title="DFSS Table 6: Nystromformer + DFSS on LRA Image, test accuracy (%)"
            + (" [tiny CPU variant]" if tiny else ""),
      rows=[Selector(row, {"attention.kind": "nystrom",
                           **{k: v for k, v in overrides.items() if k != "eval_dtype"}})
            for _, row, overrides in VARIANTS],
      columns=[Selector("Pretraining", {"init_from": ""}),
               Selector("Finetuning", {"init_from": lambda path: path != ""})],
      where={"task": "image"},
  )
