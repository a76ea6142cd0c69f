"""Shared overrides for the tiny CPU variants of the paper specs (tiny presets, few steps)."""

TINY_SEEDS = (0, 1)


def tiny_steps(num_steps: int) -> dict:
  """A few steps with one eval/checkpoint at the end: checks the pipeline, not the accuracy."""
  return {"num_train_steps": num_steps, "eval_every_steps": num_steps,
          "checkpoint_every_steps": num_steps, "log_every_steps": max(1, num_steps // 4),
          "num_eval_batches": 2}


def check_preset(preset: str, spec: str) -> bool:
  """True for the tiny variant; one clear error for an unknown preset."""
  if preset not in ("", "tiny"):
    raise ValueError(f"unknown preset {preset!r} for {spec}; known: '', 'tiny'")
  return preset == "tiny"
