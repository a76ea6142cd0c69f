"""DFSS paper, Table 6: Nystromformer pretrained, then fine-tuned with DFSS, on LRA Image.

Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/dfss_table6_nystrom.py \
          --root=runs/dfss_table6
Table:  python -m lra_sparse.tables --root=runs/dfss_table6 \
          --spec=experiments/specs/dfss_table6_nystrom.py --format=markdown \
          --out=experiments/results/dfss_table6.md
Tiny (CPU): ``experiments/specs/dfss_table6_nystrom.py:tiny`` with ``--root=runs/dfss_table6_tiny``.

As in the paper (App. A.7): a standard Nystromformer (float) is pretrained from scratch for
35,000 iterations "following Xiong et al.", i.e. with the Nystromformer LRA image config
(``configs/image.py:nystromformer``: 2 layers, 2 heads of 32, width 64, MLP 128, mean pooling,
64 landmarks, AdamW(0.9, 0.999, eps 1e-6) at lr 1e-4 on torch's OneCycleLR, batch 256, length
1024, CIFAR-10; the preset lists where each value comes from). Each row then fine-tunes that
checkpoint (init_from) for 3,500 iterations (1/10) with the same config as Nystromformer
(float), Nystromformer (bfloat16), Nystromformer + Dfss 1:2 (float) and Nystromformer + Dfss
2:4 (bfloat16) (F and B N:M-pruned: attention.nystrom.nm; bf16 rows compute in bf16 and are
evaluated with bf16 parameters, as Sec. 5.1 tests bf16 models). One pretrain run per seed;
every fine-tune run starts from the pretrain run of the same seed. The tiny variant uses the
tiny Image preset with Nystrom attention on Fashion-MNIST (named as the stand-in in run names
and the table).
"""
from experiments.specs._tiny import (IMAGE_STANDIN_NAME, TINY_SEEDS, check_preset, image_data,
                                     tiny_steps)
from lra_sparse.sweep import Group, Ref, Sweep, Variant
from lra_sparse.tables import Selector, Table

SEEDS = (0, 1, 2)
CONFIG = "configs/image.py:nystromformer"
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
  tiny = check_preset(preset, "experiments/specs/dfss_table6_nystrom.py")
  config = "configs/image.py:tiny" if tiny else CONFIG
  seeds = TINY_SEEDS if tiny else SEEDS
  suffix = f"-{IMAGE_STANDIN_NAME}" if tiny else ""
  pretrain = Group(
      name="pretrain" + suffix, config=config, seeds=seeds,
      overrides={"attention.kind": "nystrom", "attention.nystrom.nm": "",
                 "model.dtype": "float32", **image_data(tiny),
                 **(tiny_steps(30) if tiny else {"num_train_steps": PRETRAIN_STEPS})})
  finetune = Group(
      name="finetune" + suffix, config=config, seeds=seeds,
      overrides={"attention.kind": "nystrom", "init_from": Ref("pretrain" + suffix),
                 **image_data(tiny),
                 **(tiny_steps(20) if tiny else {"num_train_steps": FINETUNE_STEPS})},
      variants=[Variant(name, overrides) for name, _, overrides in VARIANTS])
  return Sweep(name="dfss_table6_nystrom" + ("_tiny" if tiny else ""),
               groups=[pretrain, finetune])


def get_table(preset: str = "") -> Table:
  tiny = check_preset(preset, "experiments/specs/dfss_table6_nystrom.py")
  # The full table takes runs of the Nystromformer config only (its width and schedule).
  setting = image_data(tiny) if tiny else {**image_data(False), "model.emb_dim": 64,
                                           "optim.schedule": "one_cycle"}
  return Table(
      title=("DFSS Table 6: Nystromformer + DFSS on LRA Image, test accuracy (%)" if not tiny
             else "DFSS Table 6: Nystromformer + DFSS on Image (Fashion-MNIST stand-in), test "
                  "accuracy (%) [tiny CPU variant]"),
      rows=[Selector(row, {"attention.kind": "nystrom",
                           **{k: v for k, v in overrides.items() if k != "eval_dtype"}})
            for _, row, overrides in VARIANTS],
      columns=[Selector("Pretraining", {"init_from": ""}),
               Selector("Finetuning", {"init_from": lambda path: path != ""})],
      where={"task": "image", **setting},
  )
