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

Presets for the data these machines have (labelled as what they are, no paper values beside
them): "standin" is the same protocol on Fashion-MNIST (the Image stand-in,
``data.source=fashion_mnist``, padded to 32x32 like CIFAR-10); "listops" is LRA's ListOps config
(``configs/listops.py:stable``, the stable recipe) with Nystromformer attention (64 landmarks),
pretrained 5,000 steps and fine-tuned 500 (the paper's 1/10). The full-size Image table shows
DFSS Table 6's values and our deltas.
"""
from experiments.specs._tiny import (IMAGE_STANDIN_NAME, TINY_SEEDS, check_preset, image_data,
                                     tiny_steps)
from lra_sparse.sweep import Group, Ref, Sweep, Variant
from lra_sparse.tables import Selector, Table

SEEDS = (0, 1, 2)
CONFIG = "configs/image.py:nystromformer"
PRETRAIN_STEPS, FINETUNE_STEPS = 35_000, 3_500
PRESETS = ("", "standin", "listops", "tiny")
# (config, data overrides, pretraining steps, fine-tuning steps, run-name suffix, column label)
SETTINGS = {
    "": (CONFIG, {"data.source": "tfds"}, PRETRAIN_STEPS, FINETUNE_STEPS, "", "Image"),
    "standin": (CONFIG, {"data.source": "fashion_mnist"}, PRETRAIN_STEPS, FINETUNE_STEPS,
                f"-{IMAGE_STANDIN_NAME}", "Image (Fashion-MNIST stand-in)"),
    "listops": ("configs/listops.py:stable", {}, 5_000, 500, "-listops", "ListOps"),
}
# DFSS Table 6 (Image, CIFAR-10): (pretraining, fine-tuning) per row; None = not reported.
PAPER = {"Nystromformer (float)": (41.17, 41.52), "Nystromformer (bfloat16)": (None, 41.59),
         "Nystromformer + Dfss 1:2 (float)": (None, 41.91),
         "Nystromformer + Dfss 2:4 (bfloat16)": (None, 42.54)}
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


def _check(preset: str) -> bool:
  return check_preset(preset, "experiments/specs/dfss_table6_nystrom.py", PRESETS)


def get_sweep(preset: str = "") -> Sweep:
  tiny = _check(preset)
  seeds = TINY_SEEDS if tiny else SEEDS
  if tiny:
    config, data, suffix = "configs/image.py:tiny", image_data(True), f"-{IMAGE_STANDIN_NAME}"
    pretrain_steps, finetune_steps = tiny_steps(30), tiny_steps(20)
  else:
    config, data, pre, fine, suffix, _ = SETTINGS[preset]
    pretrain_steps, finetune_steps = {"num_train_steps": pre}, {"num_train_steps": fine}
  pretrain = Group(
      name="pretrain" + suffix, config=config, seeds=seeds,
      overrides={"attention.kind": "nystrom", "attention.nystrom.nm": "",
                 "model.dtype": "float32", **data, **pretrain_steps})
  finetune = Group(
      name="finetune" + suffix, config=config, seeds=seeds,
      overrides={"attention.kind": "nystrom", "init_from": Ref("pretrain" + suffix),
                 **data, **finetune_steps},
      variants=[Variant(name, overrides) for name, _, overrides in VARIANTS])
  name = "dfss_table6_nystrom" + (f"_{preset}" if preset else "")
  return Sweep(name=name, groups=[pretrain, finetune])


def get_table(preset: str = "") -> Table:
  tiny = _check(preset)
  if tiny:
    setting, task, label = image_data(True), "image", "Image (Fashion-MNIST stand-in)"
  elif preset == "listops":
    setting, task, label = {}, "listops", SETTINGS["listops"][5]
  else:
    # The Image tables take runs of the Nystromformer config only (its width and schedule).
    setting = {**SETTINGS[preset][1], "model.emb_dim": 64, "optim.schedule": "one_cycle"}
    task, label = "image", SETTINGS[preset][5]
  paper = (lambda row: {column: value for column, value in
                        zip(("Pretraining", "Finetuning"), PAPER[row]) if value is not None}) \
      if preset == "" else (lambda row: {})
  return Table(
      title=(f"DFSS Table 6 protocol: Nystromformer + DFSS on {label}, test accuracy (%)"
             + (" [tiny CPU variant]" if tiny else "")),
      rows=[Selector(row, {"attention.kind": "nystrom",
                           **{k: v for k, v in overrides.items() if k != "eval_dtype"}},
                     paper=paper(row))
            for _, row, overrides in VARIANTS],
      columns=[Selector("Pretraining", {"init_from": ""}),
               Selector("Finetuning", {"init_from": lambda path: path != ""})],
      where={"task": task, **setting},
      paper_source="DFSS Table 6 (CIFAR-10)" if preset == "" else "",
  )
