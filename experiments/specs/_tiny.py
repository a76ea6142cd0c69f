"""Shared overrides for the tiny CPU variants of the paper specs (tiny presets, few steps)."""

TINY_SEEDS = (0, 1)


def tiny_steps(num_steps: int) -> dict:
  """A few steps with one eval/checkpoint at the end: checks the pipeline, not the accuracy."""
  return {"num_train_steps": num_steps, "eval_every_steps": num_steps,
          "checkpoint_every_steps": num_steps, "log_every_steps": max(1, num_steps // 4),
          "num_eval_batches": 2}


def check_preset(preset: str, spec: str, presets=("", "tiny")) -> bool:
  """True for the tiny variant; one clear error for a preset not in ``presets``."""
  if preset not in presets:
    raise ValueError(f"unknown preset {preset!r} for {spec}; known: "
                     + ", ".join(repr(p) for p in presets))
  return preset == "tiny"


# Image in the tiny variants: they run on a CPU without CIFAR-10, so their Image runs read
# Fashion-MNIST, asked for explicitly (configs/image.py defaults to CIFAR-10) and named as the
# stand-in in run names and tables. The full-size specs select data.source="tfds" (CIFAR-10).
IMAGE_STANDIN = {"data.source": "fashion_mnist"}
IMAGE_STANDIN_NAME = "fmnist-standin"                     # in run names
IMAGE_STANDIN_LABEL = "Image (Fashion-MNIST stand-in)"    # in tables
IMAGE_CIFAR10 = {"data.source": "tfds"}


def image_data(tiny: bool) -> dict:
  """The overrides (and table match) of an Image run: the stand-in when tiny, else CIFAR-10."""
  return dict(IMAGE_STANDIN if tiny else IMAGE_CIFAR10)
