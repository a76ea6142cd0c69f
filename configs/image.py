"""LRA Image: 10-class images as 1024-pixel gray sequences (google-research/long-range-arena
image/cifar10, transformer_base).

Presets: ``--config=configs/image.py`` (LRA defaults) or ``--config=configs/image.py:tiny`` (a
CPU-sized model on a Fashion-MNIST subset). The default source is Fashion-MNIST from the Debian
package ``dataset-fashion-mnist`` (real data that works offline); ``--config.data.source=tfds``
gives LRA's CIFAR-10 (tfds ``cifar10`` prepared as array_record).
"""
from lra_sparse.config import get_base_config, set_tiny_model

NUM_EPOCHS = 200
TRAIN_EXAMPLES = 45000                   # CIFAR-10 train[:90%], as LRA's config counts steps


def get_config(preset: str = "") -> "ml_collections.ConfigDict":
  config = get_base_config()
  config.task = "image"
  # "fashion_mnist": IDX files, data_dir "" = /usr/share/datasets/fashion-mnist;
  # "tfds": CIFAR-10 in gray, data_dir = tfds data dir ("" = ~/tensorflow_datasets).
  # Both: train = first 90% of the official train split, val = last 10%, test = test (LRA).
  config.data.source = "fashion_mnist"
  config.data.data_dir = ""
  config.data.max_length = 1024          # 32 x 32 pixels (Fashion-MNIST is padded 28 -> 32)
  config.data.max_examples = 0           # > 0 keeps the first examples of each split
  # LRA: 1 layer, 8 heads, 128/64/128, batch 256, 5e-4 cosine, 200 epochs, warmup 1 epoch, wd 0.
  config.batch_size = 256
  steps_per_epoch = TRAIN_EXAMPLES // config.batch_size  # 175, LRA's integer division
  config.model.num_layers = 1
  config.model.num_heads = 8
  config.model.emb_dim = 128
  config.model.qkv_dim = 64
  config.model.mlp_dim = 128
  config.model.classifier_dim = 128      # LRA's classifier head hidden width is mlp_dim
  config.model.dropout_rate = 0.3        # LRA image config (its attention dropout 0.2 stays 0 here)
  config.model.pos_emb = "learned"       # LRA cifar10 sets learn_pos_emb
  config.optim.learning_rate = 5e-4
  config.optim.schedule = "cosine"
  config.optim.warmup_steps = steps_per_epoch
  config.optim.weight_decay = 0.0
  config.num_train_steps = steps_per_epoch * NUM_EPOCHS   # 35000
  config.eval_every_steps = steps_per_epoch
  config.checkpoint_every_steps = steps_per_epoch * 10
  if preset == "tiny":
    config.data.max_examples = 2048
    set_tiny_model(config, num_layers=1, num_heads=4, width=32, mlp_dim=64)
    config.optim.learning_rate = 1e-3
    config.optim.warmup_steps = 30
    config.batch_size = 64
    config.num_train_steps = 300
    config.eval_every_steps = 100
    config.checkpoint_every_steps = 100
    config.log_every_steps = 20
  elif preset:
    raise ValueError(f"unknown preset {preset!r} for configs/image.py; known: '', 'tiny'")
  return config
