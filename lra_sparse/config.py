"""The run config: shared defaults, the attention block, and checks of config keys.

Task configs (``configs/<task>.py``) call ``get_base_config()`` and override what differs;
every field can be set from the command line (``--config.model.num_layers=2``).

``config.attention`` holds ``kind`` and one block per attention kind, built from the config
class each kind declares next to its math (``lra_sparse/attention/<kind>.py``):
``--config.attention.kind=dsa --config.attention.dsa.sparsity=0.95``. A run uses, checks and
writes to its ``config.json`` only the block of its kind (``run_config``). Setting a field of
another kind is an error, and so is a key of the old flat layout (``attention.sparsity``,
``attention.n``...): the error names the new key. Old ``config.json`` files are read through
``upgrade_legacy_config``.
"""
from __future__ import annotations

import copy
import difflib
import importlib.util
import inspect
import os
import re
from typing import Any, Mapping

import ml_collections

from lra_sparse.attention import (attention_kinds, default_attention_config,
                                  parse_attention_config)

# The flat attention keys used before each kind had its own block -> their new keys.
LEGACY_ATTENTION_KEYS = {
    "implementation": "attention.dense.implementation",
    "n": "attention.dfss.nm",
    "m": "attention.dfss.nm",
    "backend": "attention.dfss.backend",
    "deterministic_kernels": "attention.dfss.deterministic_kernels",
    "sigma": "attention.dsa.sigma",
    "sparsity": "attention.dsa.sparsity",
    "quant_bits": "attention.dsa.quant_bits",
    "mse_weight": "attention.dsa.mse_weight",
    "vector": "attention.dsa.vector",
    "selection": "attention.dsa.selection",
    "threshold": "attention.dsa.threshold",
    "topk_algorithm": "attention.dsa.topk_algorithm",
    "num_landmarks": "attention.nystrom.num_landmarks",
    "pinv_iters": "attention.nystrom.pinv_iters",
    "conv_kernel": "attention.nystrom.conv_kernel",
    "nm": "attention.nystrom.nm",
}

# The model's parameters before they followed LRA's code (LRA_DIFFERENCES.md): what runs
# recorded before these fields existed ran, and the overrides that keep their specs resumable.
EARLIER_MODEL = {
    "model.attention_bias": True,
    "model.kernel_init": "lecun_normal",
    "model.mlp_bias_init_std": 0.0,
    "model.cls_init_std": 0.02,
    "model.float32_head": False,
}

# Fields added after runs had been recorded: (key, value, tasks). A config.json without ``key``
# ran with ``value`` (the behaviour before the field existed, not today's default), so reading
# it fills ``value`` in: tables then tell old runs from new ones, and a resume under the new
# default is refused instead of silently changing the run. ``tasks`` None = every task; a key
# is only filled in where its parent block exists (``attention.dsa`` only in DSA runs); a whole
# block (``wandb``) is filled in as one value. The fields of what a run records besides its
# metrics (``profile_steps``, ``wandb``) are filled in "off": old runs compare equal to new ones
# that record nothing more, and a resume may change them (train.RESUMABLE_FIELDS).
ADDED_FIELDS = (
    ("attention.dsa.mse_normalization", "scaled_mean", None),
    ("attention.dsa.selection_rule", "float", None),
    ("attention.dsa.mse_kernels", False, None),
    ("attention.dsa.granularity", "fine", None),
    ("attention.dsa.block_size", 64, None),
    ("attention.dsa.mse_gradient", "joint", None),
    ("attention.dense.deterministic_kernels", False, None),
    ("model.dual_head", "nli_one_hidden", ("retrieval",)),
    ("data.mask_black_pixels", False, ("image", "pathfinder", "pathx")),
    ("profile_steps", "", None),
    ("eval_train_mode", False, None),
    ("wandb", {"project": "", "entity": ""}, None),
    ("model.mask_token", False, None),
    ("model.value_conv_kernel", 0, None),
    ("objective", "classify", None),
    ("denoise", {"mask_rate": 0.15, "mask_share": 0.8, "random_share": 0.1}, None),
    ("optim.trainable", "", None),
    ("attention.dsa.selection_scores", "predictor", None),
    ("attention.dsa.mse_input_gradient", True, None),
    ("deterministic", False, None),
) + tuple((key, value, None) for key, value in EARLIER_MODEL.items())


def get_base_config() -> ml_collections.ConfigDict:
  """Shared defaults for every LRA task (google-research/long-range-arena, transformer_base)."""
  config = ml_collections.ConfigDict()
  config.task = ""                  # a name from lra_sparse.data.task_names()
  config.seed = 0

  config.data = ml_collections.ConfigDict()
  config.data.data_dir = ""         # task files (official layout); task-specific fields below
  config.data.max_length = 2000

  config.model = ml_collections.ConfigDict()
  config.model.num_layers = 4
  config.model.num_heads = 8
  config.model.emb_dim = 512
  config.model.qkv_dim = 512
  config.model.mlp_dim = 1024
  config.model.dropout_rate = 0.1
  # LRA's 0.1 (Image 0.2). The DFSS (Mosaic GPU and Triton) and DSA kernels draw it inside;
  # dense trains with it on the Mosaic GPU kernels on a Hopper in half precision, else on XLA
  # (cuDNN has no dropout through JAX; evaluation stays on cuDNN). Nystromformer has none, as its
  # official code (config.attention.nystrom.attention_dropout=True applies it to F and B).
  config.model.attention_dropout_rate = 0.1
  config.model.pooling = "cls"      # "cls" | "mean"
  # Position embeddings as LRA's AddPositionEmbs: fixed "sinusoidal", or "learned" (only LRA's
  # image (CIFAR-10) and Path-X configs learn them: configs/image.py, configs/pathx.py).
  config.model.pos_emb = "sinusoidal"
  config.model.classifier_dim = 1024
  config.model.pad_multiple = 16    # sequence (incl. CLS) padded to a multiple: N:M, kernel tiles
  config.model.dtype = "float32"    # compute dtype: "float32" | "bfloat16"; params stay float32
  # Parameters as LRA's code makes them (models/transformer/transformer.py, common_layers.py);
  # each field names the one thing it changes (LRA_DIFFERENCES.md):
  config.model.attention_bias = False      # q/k/v/out projections have biases (LRA: none)
  config.model.kernel_init = "xavier_uniform"   # q/k/v/out and MLP kernels | "lecun_normal"
  config.model.mlp_bias_init_std = 1e-6    # MLP biases N(0, std^2) (LRA 1e-6); 0 = zeros
  config.model.cls_init_std = 0.0          # CLS token N(0, std^2); 0 = zeros (LRA)
  config.model.float32_head = True         # classifier head in float32 (LRA) or model.dtype
  # One more embedding row (id = the task's vocabulary size) for the denoising objective's
  # mask token; a fine-tune of a denoising run sets it too, so the embedding loads.
  config.model.mask_token = False
  # A depthwise conv along the sequence on V, added to the attention output, for any kind: the
  # conv skip of Nystromformer's code (kernel size, odd; 0 = none, as LRA). Not in LRA or in
  # the DFSS / DSA papers: a local path for the self-pretraining study.
  config.model.value_conv_kernel = 0

  # kind (a name from lra_sparse.attention.attention_kinds()) and one block per kind:
  # attention.dense.implementation, attention.dfss.{nm, backend, deterministic_kernels},
  # attention.dsa.{sigma, sparsity, ...}, attention.nystrom.{num_landmarks, ..., nm}.
  config.attention = default_attention_config()

  config.optim = ml_collections.ConfigDict()
  config.optim.learning_rate = 0.05
  config.optim.schedule = "rsqrt"   # "rsqrt" (linear warmup x rsqrt decay) | "cosine"
  config.optim.warmup_steps = 1000
  config.optim.weight_decay = 0.1
  config.optim.b1 = 0.9
  config.optim.b2 = 0.98
  config.optim.eps = 1e-9
  config.optim.grad_clip_norm = 0.0  # 0 = off
  # k > 1: each step's batch is processed as k micro-batches whose gradients are averaged
  # (the same update, 1/k of the activation memory); batch_size must divide by k x devices.
  config.optim.grad_accum_steps = 1
  # A regular expression: only the parameters whose path ("/"-joined, e.g.
  # "encoder/block_0/attention/DSAAttention_0/predictor_query") it matches (re.search) are
  # updated, the others frozen (no update, no weight decay; clipping sees the trained ones
  # only); "" = all.
  # E.g. "predictor_" fits DSA's predictor to a trained model's scores. The logged grad_norm
  # stays that of every parameter's gradient.
  config.optim.trainable = ""

  # What the model is trained to predict (lra_sparse/objectives.py): "classify" (the task's
  # label, LRA) or "denoise" (masked tokens of the task's own inputs, labels unused: the
  # self-pretraining of Amos et al., "Never Train from Scratch", ICLR 2024; needs
  # model.mask_token). A share mask_rate of the real tokens is selected; of those, mask_share
  # become the mask token, random_share a uniformly drawn real token, the rest stay (BERT's
  # 80/10/10 by default); the loss is the cross-entropy at the selected positions.
  config.objective = "classify"
  config.denoise = ml_collections.ConfigDict()
  config.denoise.mask_rate = 0.15
  config.denoise.mask_share = 0.8
  config.denoise.random_share = 0.1

  # True: a rerun of the same config on the same machine and software repeats the run bit for
  # bit. On a GPU, sums with atomics add in no fixed order, so by default a rerun differs from
  # the first logged step (ListOps reruns ended up to 0.75 points apart). This sets XLA's
  # deterministic ops (train.DETERMINISTIC_XLA_FLAG in XLA_FLAGS, which lra_sparse.main sets
  # before JAX starts; a run started from Python must have it set already) and the attention
  # kernels' backward without atomics (every kind's ``deterministic_kernels``). Slower.
  config.deterministic = False

  config.batch_size = 32
  config.num_train_steps = 5000
  config.eval_every_steps = 500
  config.num_eval_batches = 0       # 0 = the whole split
  config.checkpoint_every_steps = 500
  config.log_every_steps = 50
  config.init_from = ""             # workdir of a finished run: load its params, then train
  config.eval_dtype = ""            # "" = as trained; "bfloat16" casts params for evaluation
  # Diagnostic: every periodic evaluation also runs the validation split as in training
  # (dropout on), recorded as split "val_train_mode" (a gap between the two modes vs bad
  # parameters). Costs one more validation pass per evaluation.
  config.eval_train_mode = False

  # What a run records besides metrics.jsonl and its TensorBoard copy (lra_sparse.metric_writers);
  # a resumed run may change these. profile_steps "START:STOP": a jax.profiler trace of train
  # steps START..STOP-1 (0-based) in <workdir>/profile/ (TensorBoard's profile plugin or xprof
  # opens it); "" = off.
  config.profile_steps = ""
  config.wandb = ml_collections.ConfigDict()
  config.wandb.project = ""         # "" = off; set: also log to W&B (needs `pip install wandb`)
  config.wandb.entity = ""          # W&B user or team; "" = wandb's default entity
  return config


def set_tiny_model(config: ml_collections.ConfigDict, *, num_layers: int, num_heads: int,
                   width: int, mlp_dim: int) -> None:
  """The CPU presets' model: emb = qkv = ``width``, classifier as wide as the MLP, no dropout
  (neither on activations nor on attention probabilities)."""
  config.model.num_layers = num_layers
  config.model.num_heads = num_heads
  config.model.emb_dim = width
  config.model.qkv_dim = width
  config.model.mlp_dim = mlp_dim
  config.model.classifier_dim = mlp_dim
  config.model.dropout_rate = 0.0
  config.model.attention_dropout_rate = 0.0


# ----------------------------------------------------------------------------- files
def load_python_file(path: str):
  """Imports the python file at ``path`` as a fresh module (configs, sweep and table specs)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path!r} does not exist (paths are relative to the directory "
                            "the command runs in)")
  module_name = "_lra_file_" + re.sub(r"\W", "_", os.path.abspath(path))
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config_file(path: str, preset: str = "") -> ml_collections.ConfigDict:
  """``get_config(preset)`` of a config file, as ``--config=path[:preset]`` loads it."""
  module = load_python_file(path)
  return module.get_config(preset) if preset else module.get_config()


def split_spec_arg(spec_arg: str) -> tuple[str, str]:
  """``"experiments/specs/x.py:tiny"`` -> ``("experiments/specs/x.py", "tiny")``."""
  path, sep, preset = spec_arg.rpartition(":")
  if sep and path.endswith(".py") and "/" not in preset:
    return path, preset
  return spec_arg, ""


def moved_spec_path(path: str) -> str | None:
  """Where the spec file ``path`` went, for a missing ``.../experiments/<name>.py`` whose
  ``.../experiments/specs/<name>.py`` exists (sweep and table specs moved there); else None."""
  directory, name = os.path.split(path)
  if os.path.exists(path) or os.path.basename(directory) != "experiments":
    return None
  moved = os.path.join(directory, "specs", name)
  return moved if os.path.isfile(moved) else None


def call_spec_function(spec_arg: str, function_name: str) -> Any:
  """Loads ``path[:preset]`` and returns ``function_name(preset)`` (or ``function_name()``).

  A spec given by its path before the specs moved to ``experiments/specs/`` is one error that
  names the new path."""
  path, preset = split_spec_arg(spec_arg)
  moved = moved_spec_path(path)
  if moved is not None:
    raise FileNotFoundError(f"{path} does not exist: the spec moved to {moved}")
  module = load_python_file(path)
  function = getattr(module, function_name, None)
  if not callable(function):
    raise ValueError(f"{path} defines no {function_name}()")
  if not preset:
    return function()
  if not inspect.signature(function).parameters:
    raise ValueError(f"{path}: {function_name}() takes no preset, but {preset!r} was given")
  return function(preset)


def flatten_config(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{"attention": {"dsa": {"sparsity": 0.9}}}`` -> ``{"attention.dsa.sparsity": 0.9}``."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, (Mapping, ml_collections.ConfigDict)):
      flat.update(flatten_config(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


# ----------------------------------------------------------------------------- keys
def legacy_key_message(key: str) -> str | None:
  """For a key of the old flat attention layout, the error text naming its new key."""
  if not key.startswith("attention."):
    return None
  field = key[len("attention."):]
  if field not in LEGACY_ATTENTION_KEYS:
    return None
  new = LEGACY_ATTENTION_KEYS[field]
  if field in ("n", "m"):
    return (f"config.{key} no longer exists: DFSS's N:M is one string, "
            f"config.{new} (e.g. --config.{new}=2:4)")
  return f"config.{key} no longer exists: use config.{new}"


def check_override_keys(config: ml_collections.ConfigDict, keys, where: str = "") -> None:
  """One ValueError for the first bad override key: a key of the old flat attention layout
  (names the new key), a key the config does not have (suggests the closest), or a field of
  another attention kind than the one ``config`` selects."""
  prefix = f"{where}: " if where else ""
  known = flatten_config(config.to_dict())
  kind = config.attention.kind
  for key in keys:
    legacy = legacy_key_message(key)
    if legacy:
      raise ValueError(prefix + legacy)
    if key not in known:
      hint = difflib.get_close_matches(key, list(known), n=1)
      raise ValueError(f"{prefix}config.{key} is not a field of the config"
                       + (f" (did you mean config.{hint[0]}?)" if hint else ""))
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "attention" and parts[1] != kind:
      raise ValueError(f"{prefix}config.{key} is set, but config.attention.kind={kind!r}: "
                       f"it would be ignored (set config.attention.kind={parts[1]!r}, or drop "
                       "it)")


def run_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config a run uses and records: ``attention`` holds ``kind`` and that kind's block
  only (checked by the kind's config class), with ``deterministic_kernels`` on where
  ``config.deterministic`` asks for it; everything else as given."""
  attention = parse_attention_config(config.attention)   # checks kind and its fields
  resolved = ml_collections.ConfigDict(config.to_dict())
  kind = attention.KIND
  pruned = ml_collections.ConfigDict()
  pruned.kind = kind
  pruned[kind] = resolved.attention[kind]
  if config.get("deterministic") and "deterministic_kernels" in pruned[kind]:
    pruned[kind].deterministic_kernels = True
  resolved.attention = pruned
  return resolved


def upgrade_legacy_config(tree: Mapping[str, Any]) -> dict[str, Any]:
  """A nested config dict in the current layout, meaning what the run that wrote it ran.

  Configs written before each attention kind had its own block (flat ``attention.n``,
  ``attention.sparsity``...) are converted: the fields of the run's kind move into
  ``attention.<kind>`` (``n``/``m`` become ``nm="n:m"``) and the other kinds' fields, which
  that run never used, are dropped. Then every field of ``ADDED_FIELDS`` the config lacks gets
  the value it ran with. Current configs come back as they are.
  """
  tree = _upgrade_flat_attention(dict(tree))
  task = tree.get("task")
  for key, value, tasks in ADDED_FIELDS:
    if tasks is not None and task not in tasks:
      continue
    *sections, field = key.split(".")
    node = tree
    for section in sections:
      child = node.get(section) if isinstance(node, Mapping) else None
      if not isinstance(child, Mapping):
        node = None
        break
      child = dict(child)           # copy: the caller's dict is never changed
      node[section] = child
      node = child
    if node is not None and field not in node:
      node[field] = copy.deepcopy(value)   # a block value is the caller's own
  return tree


def _upgrade_flat_attention(tree: dict[str, Any]) -> dict[str, Any]:
  attention = tree.get("attention")
  if not isinstance(attention, Mapping) or not any(
      field in attention and not isinstance(attention[field], Mapping)
      for field in LEGACY_ATTENTION_KEYS):
    return tree
  kind = attention.get("kind")
  block = {}
  for field, new in LEGACY_ATTENTION_KEYS.items():
    _, new_kind, new_field = new.split(".")
    if new_kind == kind and field in attention and field not in ("n", "m"):
      block[new_field] = attention[field]
  if kind == "dfss" and "n" in attention and "m" in attention:
    block["nm"] = f"{attention['n']}:{attention['m']}"
  tree["attention"] = {"kind": kind, **({kind: block} if kind in attention_kinds() else {})}
  return tree
