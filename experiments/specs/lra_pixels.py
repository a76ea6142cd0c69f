"""LRA Pathfinder-32 and Image at LRA's settings on a GPU: dense vs. DFSS 2:4, one seed each.

Pathfinder-32 is generated at LRA's size and the difficulty of its leaderboard (hard: contour
length 14, 200k images, 160k / 20k / 20k), with the compact cache, so that a resumed run reads
its data in a second instead of decoding 200k PNGs again:
  python -m lra_sparse.data.prepare --task=pathfinder --data_dir=data --offline
(into ``data/pathfinder``; every core generates; about a minute on 16 cores).
Image is Fashion-MNIST, the offline stand-in for CIFAR-10 (named ``fmnist-standin`` in run
names and labelled so in the table): ``configs/image.py`` with ``data.source=fashion_mnist``
read from ``data/fashion-mnist`` (a copy of the Debian package's files, which a lent GPU
machine does not have).
Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/lra_pixels.py --root=runs/lra_pixels
Table:  python -m lra_sparse.tables --root=runs/lra_pixels --spec=experiments/specs/lra_pixels.py \
          --format=markdown --out=experiments/results/lra_pixels.md

Every run is its task's LRA config in bf16 from scratch (Pathfinder-32: 4 layers, 4 heads of 4,
batch 512, 62.4k steps; Image: 1 layer, 8 heads of 8, batch 256, 35k steps), with LRA's
black-pixel masks; dense runs "auto" (cuDNN with the mask as a bias: 59.7 ms per
Pathfinder step on an H100, XLA 134.0), DFSS 2:4 the fused kernels (Triton: head dims 4 and 8
are zero-padded to 16; 82.2 ms). The runs are long (Pathfinder dense about 1 h on an H100,
DFSS 2:4 about 1.4 h): ``scripts/device_sweep.sh`` trains them in slices and carries
their checkpoints from one lent machine to the next. Preset "smoke": the tiny presets
for 20 steps on ``make demo``-sized data (pipeline check on a CPU).
The committed runs trained with attention dropout 0 (LRA's, and the configs' defaults since:
Image 0.2, Pathfinder 0.1), so dense ran on cuDNN; the full-size runs keep 0 here so that the
unfinished Pathfinder runs resume as they started.
"""
from experiments.specs._tiny import (IMAGE_STANDIN, IMAGE_STANDIN_LABEL, IMAGE_STANDIN_NAME,
                                     tiny_steps)
from experiments.specs.lra_listops import NO_ATTENTION_DROPOUT_BF16
from lra_sparse.sweep import Group, Sweep, Variant
from lra_sparse.tables import Selector, Table

KINDS = (  # (row label, run-name label, overrides)
    ("Transformer (dense)", "dense", {"attention.kind": "dense"}),
    ("DFSS 2:4", "dfss2-4", {"attention.kind": "dfss", "attention.dfss.nm": "2:4"}),
)
FMNIST_DIR = "data/fashion-mnist"
PATHFINDER_DIR = "data/pathfinder"


def _check(preset: str) -> bool:
  if preset not in ("", "smoke"):
    raise ValueError(f"unknown preset {preset!r} for experiments/specs/lra_pixels.py; "
                     "known: '', 'smoke'")
  return preset == "smoke"


def get_sweep(preset: str = "") -> Sweep:
  smoke = _check(preset)
  tiny = ":tiny" if smoke else ""
  common = tiny_steps(20) if smoke else NO_ATTENTION_DROPOUT_BF16
  image = dict(IMAGE_STANDIN, **({} if smoke else {"data.data_dir": FMNIST_DIR}))
  return Sweep(
      name="lra_pixels" + ("_smoke" if smoke else ""),
      groups=[Group(config="configs/pathfinder.py" + tiny, name="pathfinder32",
                    overrides=dict(common, **({} if smoke else
                                               {"data.data_dir": PATHFINDER_DIR})),
                    variants=[Variant(name, match) for _, name, match in KINDS]),
              Group(config="configs/image.py" + tiny, name=f"image-{IMAGE_STANDIN_NAME}",
                    overrides=dict(common, **image),
                    variants=[Variant(name, match) for _, name, match in KINDS])])


def get_table(preset: str = "") -> Table:
  smoke = _check(preset)
  return Table(
      title=("Pathfinder / Image smoke (tiny presets, 20 steps, CPU): test accuracy (%)" if smoke
             else "LRA Pathfinder-32 (generated, hard) and Image (Fashion-MNIST stand-in), bf16, "
             "from scratch, LRA settings but attention dropout 0: test accuracy (%) at the last "
             "step"),
      rows=[Selector(label, match) for label, _, match in KINDS],
      columns=[Selector("Pathfinder-32", {"task": "pathfinder"}),
               Selector(IMAGE_STANDIN_LABEL, dict({"task": "image"}, **IMAGE_STANDIN))],
  )
