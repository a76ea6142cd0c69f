"""LRA Pathfinder32 (google-research/long-range-arena, lra_benchmarks/image, pathfinder32).

Data: 32x32 images in LRA's layout under ``config.data.data_dir`` (``curv_baseline`` /
``curv_contour_length_9`` / ``curv_contour_length_14`` + ``metadata/*.npy``), one token per pixel
(its value; black pixels masked as LRA's ``inputs > 0``), 1024 tokens, 80/10/10 split.
Generate it with::

  python -m lra_sparse.generators.pathfinder --output_dir=data/pathfinder32 --resolution=32 \\
      --difficulty=hard --num_images=200000 --seed=0

Presets: ``--config=configs/pathfinder.py`` (LRA defaults: the LRA paper's Pathfinder column is
the hard set) or ``--config=configs/pathfinder.py:tiny`` (a CPU-sized model on a small easy set:
``python -m lra_sparse.generators.pathfinder --output_dir=data/pathfinder_tiny --resolution=32
--difficulty=easy --num_images=4000 --seed=0``).

Model sizes follow LRA's Pathfinder32 task settings: 4 layers, 4 heads, emb/qkv/mlp 32/16/32
(head_dim 4). LRA's own ``pathfinder32/transformer_base.py`` overrides its base config
with 1 layer, 4 heads, 128/64/128 and dropout 0.2; set those on the command line to reproduce it.
"""
from lra_sparse.config import get_base_config, set_tiny_model

TRAIN_EXAMPLES = 160_000    # 80% of LRA's 200k images per difficulty
NUM_EPOCHS = 200


def get_config(preset: str = "") -> "ml_collections.ConfigDict":
  config = get_base_config()
  config.task = "pathfinder"
  config.data.data_dir = "data/pathfinder32"
  config.data.difficulty = "hard"         # easy | intermediate | hard (contour length 6/9/14)
  config.data.max_length = 32 * 32
  # LRA's padding mask inputs > 0: black pixels are neither attended to nor pooled.
  # False: every pixel is a token (pixel + 1), this repository's earlier behaviour.
  config.data.mask_black_pixels = True

  config.model.num_layers = 4
  config.model.num_heads = 4
  config.model.emb_dim = 32
  config.model.qkv_dim = 16
  config.model.mlp_dim = 32
  config.model.classifier_dim = 32        # LRA's classifier head is mlp_dim wide
  config.model.dropout_rate = 0.1
  config.model.pooling = "mean"           # LRA: classifier_pool = 'MEAN' for the image tasks

  # LRA: lr 1e-3, constant * linear_warmup * cosine_decay, warmup 1 epoch, 200 epochs, wd 0.
  steps_per_epoch = TRAIN_EXAMPLES // 512
  config.batch_size = 512
  config.optim.learning_rate = 1e-3
  config.optim.schedule = "cosine"
  config.optim.warmup_steps = steps_per_epoch               # 312
  config.optim.weight_decay = 0.0
  config.optim.grad_clip_norm = 0.0
  config.num_train_steps = steps_per_epoch * NUM_EPOCHS     # 62400
  config.eval_every_steps = steps_per_epoch
  config.checkpoint_every_steps = steps_per_epoch * 10
  config.log_every_steps = 50
  config.num_eval_batches = 0

  if preset == "tiny":
    config.data.data_dir = "data/pathfinder_tiny"
    config.data.difficulty = "easy"
    set_tiny_model(config, num_layers=2, num_heads=2, width=32, mlp_dim=64)
    config.optim.learning_rate = 2e-3
    config.optim.warmup_steps = 20
    config.batch_size = 16
    config.num_train_steps = 300
    config.eval_every_steps = 100
    config.checkpoint_every_steps = 100
    config.log_every_steps = 10
    config.num_eval_batches = 4
  elif preset:
    raise ValueError(f"unknown preset {preset!r} for configs/pathfinder.py; known: '', 'tiny'")
  return config
