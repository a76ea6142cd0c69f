"""LRA Path-X: Pathfinder at 128x128 (long-range-arena, lra_benchmarks/image, pathfinder128).

Data: 128x128 images in LRA's layout under ``config.data.data_dir`` (Path-X is the hard set,
``curv_contour_length_14``), one token per pixel (its value; black pixels masked as LRA's
``inputs > 0``), 16384 tokens, 80/10/10 split::

  python -m lra_sparse.generators.pathfinder --output_dir=data/pathfinder128 --resolution=128 \\
      --difficulty=hard --num_images=200000 --seed=0

Presets: ``--config=configs/pathx.py`` (LRA defaults: 1 layer, 2 heads, 32/16/32, batch 64, lr
1e-3 cosine, 200 epochs, warmup 1 epoch, gradient clipping 1.0) or
``--config=configs/pathx.py:tiny`` (a CPU-sized run on a small easy set: ``python -m
lra_sparse.generators.pathfinder --output_dir=data/pathx_tiny --resolution=128
--difficulty=easy --num_images=600 --seed=0``). At 16384 tokens a dense score matrix is 1 GiB
(float32) per example and head, so the tiny preset uses Nystromformer attention (64
landmarks).
"""
from lra_sparse.config import get_base_config, set_tiny_model

TRAIN_EXAMPLES = 160_000    # 80% of LRA's 200k images
NUM_EPOCHS = 200


def get_config(preset: str = "") -> "ml_collections.ConfigDict":
  config = get_base_config()
  config.task = "pathx"
  config.data.data_dir = "data/pathfinder128"
  config.data.difficulty = "hard"         # Path-X = curv_contour_length_14
  config.data.max_length = 128 * 128
  # LRA's padding mask inputs > 0: black pixels are neither attended to nor pooled.
  # False: every pixel is a token (pixel + 1), this repository's earlier behaviour.
  config.data.mask_black_pixels = True

  config.model.num_layers = 1
  config.model.num_heads = 2
  config.model.emb_dim = 32
  config.model.pos_emb = "learned"       # LRA pathfinder128 sets learn_pos_emb
  config.model.qkv_dim = 16
  config.model.mlp_dim = 32
  config.model.classifier_dim = 32        # LRA's classifier head is mlp_dim wide
  config.model.dropout_rate = 0.1
  config.model.pooling = "mean"           # LRA: classifier_pool = 'MEAN'

  steps_per_epoch = TRAIN_EXAMPLES // 64
  config.batch_size = 64
  config.optim.learning_rate = 1e-3
  config.optim.schedule = "cosine"
  config.optim.warmup_steps = steps_per_epoch               # 2500
  config.optim.weight_decay = 0.0
  config.optim.grad_clip_norm = 1.0                         # LRA pathfinder128: 1.0
  config.num_train_steps = steps_per_epoch * NUM_EPOCHS     # 500000
  config.eval_every_steps = steps_per_epoch
  config.checkpoint_every_steps = steps_per_epoch * 10
  config.log_every_steps = 100
  config.num_eval_batches = 0

  if preset == "tiny":
    config.data.data_dir = "data/pathx_tiny"
    config.data.difficulty = "easy"
    set_tiny_model(config, num_layers=1, num_heads=2, width=32, mlp_dim=64)
    config.attention.kind = "nystrom"
    config.attention.nystrom.num_landmarks = 64   # 16384 = 64 segments of 256 tokens
    config.optim.learning_rate = 2e-3
    config.optim.warmup_steps = 10
    config.batch_size = 8
    config.num_train_steps = 200
    config.eval_every_steps = 100
    config.checkpoint_every_steps = 100
    config.log_every_steps = 10
    config.num_eval_batches = 2
  elif preset:
    raise ValueError(f"unknown preset {preset!r} for configs/pathx.py; known: '', 'tiny'")
  return config
