"""The trainer: loss goes down, workdir files, resume, data parallelism, bad configs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lra_sparse import config as config_lib
from lra_sparse import train
from lra_sparse.data import pipeline

from conftest import checkpoint_params


def _read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_listops_tiny_run_lowers_loss_and_writes_files(tmp_path, tiny_config, listops_dir):
  config = tiny_config("listops", **{"data.data_dir": listops_dir, "data.max_length": 128,
                                     "num_train_steps": 30, "optim.learning_rate": 0.01})
  result = train.train_and_evaluate(config, str(tmp_path))
  for name in ("config.json", "metrics.jsonl", "result.json"):
    assert os.path.exists(tmp_path / name), name
  records = _read_metrics(tmp_path)
  train_losses = [r["loss"] for r in records if r["split"] == "train"]
  assert len(train_losses) == 6
  assert np.mean(train_losses[-2:]) < np.mean(train_losses[:2])
  assert {r["split"] for r in records} == {"train", "val", "test", "test_at_best_val"}
  saved = json.loads((tmp_path / "result.json").read_text())
  assert saved["step"] == 30 and saved["test"]["accuracy"] == result["test"]["accuracy"]
  assert json.loads((tmp_path / "config.json").read_text())["task"] == "listops"


class _Interrupt(RuntimeError):
  pass


def test_resume_after_interruption_matches_uninterrupted_run(tmp_path, tiny_config, monkeypatch):
  config = tiny_config(num_train_steps=30, checkpoint_every_steps=10)
  reference = train.train_and_evaluate(config, str(tmp_path / "straight"))

  real_dataset = pipeline.train_dataset

  class Killing:
    """Training data that 'kills' the run when step 25 is requested."""

    def __init__(self, *args, **kwargs):
      self._inner = real_dataset(*args, **kwargs)

    def __getitem__(self, step):
      if step == 25:
        raise _Interrupt("killed")
      return self._inner[step]

  monkeypatch.setattr(train, "train_dataset", Killing)
  with pytest.raises(_Interrupt):
    train.train_and_evaluate(config, str(tmp_path / "resumed"))
  assert not (tmp_path / "resumed" / "result.json").exists()
  monkeypatch.setattr(train, "train_dataset", real_dataset)
  resumed = train.train_and_evaluate(config, str(tmp_path / "resumed"))
  assert resumed["step"] == 30
  np.testing.assert_allclose(resumed["test"]["loss"], reference["test"]["loss"], rtol=1e-5)
  steps = [r["step"] for r in _read_metrics(tmp_path / "resumed") if r["split"] == "train"]
  # Killed while running step 26 (after logging 25); resumed from the step-20 checkpoint.
  assert steps == [5, 10, 15, 20, 25, 25, 30]
  # The best-validation record survives the restart (records past the checkpoint are redone).
  assert resumed["test_at_best_val"] == reference["test_at_best_val"]


def test_result_holds_test_metrics_at_the_best_validation_step(tmp_path, tiny_config):
  result = train.train_and_evaluate(tiny_config(eval_every_steps=5), str(tmp_path / "run"))
  records = _read_metrics(tmp_path / "run")
  vals = [(r["step"], r["accuracy"]) for r in records if r["split"] == "val"]
  assert [step for step, _ in vals] == [5, 10, 15, 20, 25, 30]
  best_step = max(vals, key=lambda item: (item[1], -item[0]))[0]   # first step on ties
  best = result["test_at_best_val"]
  assert best["step"] == best_step
  assert best["val_accuracy"] == dict(vals)[best_step]
  logged = [r for r in records if r["split"] == "test_at_best_val"]
  assert logged[-1]["step"] == best_step and logged[-1]["accuracy"] == best["accuracy"]
  # Each record is a new best: validation accuracy strictly rises along them.
  rising = [r["val_accuracy"] for r in logged]
  assert rising == sorted(set(rising))
  if best_step == 30:
    assert best["loss"] == result["test"]["loss"]
  else:
    assert best["loss"] != result["test"]["loss"]


_DEVICE_SCRIPT = """
import json
import jax
import jax.numpy as jnp
from conftest import make_tiny_config
from lra_sparse import config as config_lib
from lra_sparse import train
config = make_tiny_config(num_train_steps=6, log_every_steps=1, eval_every_steps=6,
                          checkpoint_every_steps=6)
train.train_and_evaluate(config, {workdir!r})
print(json.dumps({{"devices": jax.local_device_count()}}))
"""


@pytest.mark.parametrize("num_devices", [2])
def test_two_cpu_devices_match_one_device(tmp_path, num_devices):
  losses = {}
  for count in (1, num_devices):
    workdir = str(tmp_path / f"dev{count}")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={count}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    script = _DEVICE_SCRIPT.format(workdir=workdir)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["devices"] == count
    losses[count] = [r["loss"] for r in _read_metrics(workdir) if r["split"] == "train"]
  assert len(losses[1]) == 6
  np.testing.assert_allclose(losses[num_devices], losses[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    ({"attention.kind": "nonexistent"}, "unknown attention kind 'nonexistent'"),
    ({"model.num_heads": 3}, "num_heads=3 must divide config.model.qkv_dim=32"),
    ({"task": "nope"}, "unknown task 'nope'"),
    ({"optim.schedule": "linear"}, "config.optim.schedule='linear'"),
    ({"eval_dtype": "float16"}, "config.eval_dtype='float16'"),
    ({"model.dtype": "float64"}, "config.model.dtype='float64'"),
])
def test_bad_config_gets_one_clear_error(tmp_path, tiny_config, overrides, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    train.train_and_evaluate(tiny_config(**overrides), str(tmp_path))


def test_missing_data_directory_is_named(tmp_path, tiny_config):
  config = tiny_config("listops", **{"data.data_dir": str(tmp_path / "absent")})
  with pytest.raises(FileNotFoundError, match="absent"):
    train.train_and_evaluate(config, str(tmp_path / "run"))


def test_rsqrt_schedule_matches_lra_formula():
  schedule = train.rsqrt_schedule(0.05, 1000)
  for step in (0, 499, 999, 1999, 4999):
    s = step + 1
    expected = 0.05 * min(1.0, s / 1000) / np.sqrt(max(s, 1000))
    np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-6)


def test_init_from_copies_shared_params_and_eval_dtype(tmp_path, tiny_config):
  base = tiny_config(num_train_steps=10)
  pre_result = train.train_and_evaluate(base, str(tmp_path / "pre"))
  # Learning rate 0: the fine-tune's weights stay exactly what it started from, so its
  # checkpoint shows whether every parameter was copied from the pretrain run.
  finetune = tiny_config(num_train_steps=10, init_from=str(tmp_path / "pre"),
                         eval_dtype="bfloat16", **{"optim.learning_rate": 0.0})
  result = train.train_and_evaluate(finetune, str(tmp_path / "ft"))
  records = _read_metrics(tmp_path / "ft")
  init = [r for r in records if r["split"] == "init_from"]
  assert init and init[0]["fresh_params"] == 0 and init[0]["unused_params"] == 0
  pre, ft = checkpoint_params(tmp_path / "pre"), checkpoint_params(tmp_path / "ft")
  assert jax.tree.structure(pre) == jax.tree.structure(ft)
  for a, b in zip(jax.tree.leaves(pre), jax.tree.leaves(ft)):
    np.testing.assert_array_equal(a, b)
  # eval_dtype=bfloat16 evaluates the same weights in bf16: close to, not equal to, float32.
  assert np.isfinite(result["test"]["loss"])
  assert result["test"]["loss"] != pre_result["test"]["loss"]
  np.testing.assert_allclose(result["test"]["loss"], pre_result["test"]["loss"], rtol=0.05)
  bad = tiny_config(num_train_steps=10, init_from=str(tmp_path / "pre"))
  bad.model.emb_dim = 48
  bad.model.qkv_dim = 48
  with pytest.raises(ValueError, match="has shape"):
    train.train_and_evaluate(bad, str(tmp_path / "bad"))


def test_trainable_fits_dsa_predictor_to_a_frozen_trained_model(tmp_path, tiny_config):
  """optim.trainable="predictor_": DSA at sparsity 0 (every key kept: dense attention) from a
  trained dense run, only the predictor updated: every other parameter stays bit for bit what
  the dense run saved, although weight decay and clipping are on; the predictor fits (its MSE
  falls); the model's outputs are the dense run's. Bad patterns are one clear error each."""
  pre_result = train.train_and_evaluate(tiny_config(num_train_steps=10),
                                        str(tmp_path / "pre"))
  warm = tiny_config(num_train_steps=20, init_from=str(tmp_path / "pre"), **{
      "attention.kind": "dsa", "attention.dsa.sparsity": 0.0,
      "attention.dsa.mse_gradient": "predictor", "attention.dsa.mse_input_gradient": False,
      "optim.trainable": "predictor_",
      "optim.learning_rate": 0.01, "optim.weight_decay": 0.1, "optim.grad_clip_norm": 1.0,
      "eval_every_steps": 10})
  result = train.train_and_evaluate(warm, str(tmp_path / "warm"))
  pre = checkpoint_params(tmp_path / "pre")
  after = jax.tree_util.tree_flatten_with_path(checkpoint_params(tmp_path / "warm"))[0]
  predictor = 0
  for path, value in after:
    name = jax.tree_util.keystr(path)
    if "predictor_" in name:
      predictor += 1
      continue
    frozen = pre
    for key in path:
      frozen = frozen[key.key]
    np.testing.assert_array_equal(value, frozen, err_msg=name)
  assert predictor == 2          # W~q and W~k of the tiny model's one layer
  val = [r for r in _read_metrics(tmp_path / "warm") if r["split"] == "val"]
  assert val[-1]["dsa_mse"] < 0.5 * val[0]["dsa_mse"], val
  np.testing.assert_allclose(result["test"]["loss"], pre_result["test"]["loss"], rtol=1e-4)
  for pattern, message in (("nothing_here", "config.optim.trainable='nothing_here' matches "
                                            "no parameter \\(paths look like "),
                           ("predictor_(", "is not a regular expression")):
    bad = tiny_config(**{"optim.trainable": pattern})
    with pytest.raises(ValueError, match=message):
      train.train_and_evaluate(bad, str(tmp_path / "bad"))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(tmp_path, *overrides, workdir="run"):
  return subprocess.run(
      [sys.executable, "-m", "lra_sparse.main", "--config=configs/listops.py:tiny",
       f"--workdir={tmp_path / workdir}", *overrides],
      cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("override, message", [
    ("--config.attention.sparsity=0.95",
     "error: config.attention.sparsity no longer exists: use config.attention.dsa.sparsity"),
    ("--config.attention.n=1",
     "error: config.attention.n no longer exists: DFSS's N:M is one string, "
     "config.attention.dfss.nm (e.g. --config.attention.dfss.nm=2:4)"),
    ("--config.attention.dsa.sparsity=0.95",
     "error: config.attention.dsa.sparsity is set, but config.attention.kind='dense': it would "
     "be ignored (set config.attention.kind='dsa', or drop it)"),
])
def test_cli_refuses_old_and_unused_attention_keys_in_one_line(tmp_path, override, message):
  proc = _main(tmp_path, override)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines() == [message]
  assert not (tmp_path / "run" / "config.json").exists()


def test_cli_sets_a_kind_field_and_records_only_that_kind(tmp_path, listops_dir):
  proc = _main(tmp_path, "--config.attention.kind=dsa", "--config.attention.dsa.sparsity=0.95",
               f"--config.data.data_dir={listops_dir}", "--config.data.max_length=128",
               "--config.num_train_steps=2", "--config.eval_every_steps=2",
               "--config.checkpoint_every_steps=2", "--config.log_every_steps=1",
               "--config.num_eval_batches=1", "--config.batch_size=8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  config = json.loads((tmp_path / "run" / "config.json").read_text())
  assert config["attention"] == {"kind": "dsa", "dsa": {
      "sigma": 0.25, "sparsity": 0.95, "quant_bits": 0, "mse_weight": 1.0,
      "mse_normalization": "eq6", "vector": 1, "selection": "topk", "threshold": 0.0,
      "topk_algorithm": "top_k", "backend": "auto", "deterministic_kernels": False,
      "forward": "auto",
      "selection_rule": "int8", "mse_kernels": True, "granularity": "fine", "block_size": 64,
      "mse_gradient": "joint", "mse_input_gradient": True, "selection_scores": "predictor"}}
  assert "test accuracy" in proc.stdout


def test_gradient_accumulation_gives_the_one_batch_update(tmp_path, tiny_config):
  """k micro-batches of B/k give the update of one batch of B (float32 summation order only),
  in the step function and through the trainer."""
  from lra_sparse import config as config_lib  # pylint: disable=import-outside-toplevel
  from lra_sparse.data import get_task  # pylint: disable=import-outside-toplevel

  config = config_lib.run_config(tiny_config(batch_size=16))
  spec = get_task("synthetic").spec(config)
  model = train.make_model(config, spec)
  arrays = get_task("synthetic").load_split(config, "train")
  batch = {key: value[:16] for key, value in arrays.items()}
  params = model.init(jax.random.key(0), batch, deterministic=True)["params"]
  # Plain SGD with rate 1 makes the update the gradient itself (Adam's first step is close to
  # sign(g), which would amplify float rounding where g ~ 0).
  import optax  # pylint: disable=import-outside-toplevel
  state = train.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(1.0),
                                  model_state=None)
  rng = jax.random.key(1)
  one, one_metrics = jax.jit(train.make_train_step(model, 1))(state, batch, rng)
  four, four_metrics = jax.jit(train.make_train_step(model, 4))(state, batch, rng)
  moved = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(one.params),
                                                      jax.tree.leaves(params))]
  assert max(moved) > 1e-3                       # the update is not trivially zero
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  for key in ("loss", "accuracy", "grad_norm"):
    np.testing.assert_allclose(float(one_metrics[key]), float(four_metrics[key]), rtol=1e-5)
  ref = train.train_and_evaluate(tiny_config(num_train_steps=10), str(tmp_path / "one"))
  acc = train.train_and_evaluate(tiny_config(num_train_steps=10,
                                             **{"optim.grad_accum_steps": 2}),
                                 str(tmp_path / "two"))
  np.testing.assert_allclose(acc["test"]["loss"], ref["test"]["loss"], rtol=1e-4)
  with pytest.raises(ValueError, match="divisible by the 1 local devices x "
                                       "config.optim.grad_accum_steps=3"):
    train.train_and_evaluate(tiny_config(**{"optim.grad_accum_steps": 3}),
                             str(tmp_path / "bad"))


def _torch_one_cycle(max_lr, total_steps, pct_start, step_num):
  """torch.optim.lr_scheduler.OneCycleLR.get_lr (anneal_strategy="linear", three_phase=False,
  div_factor=25, final_div_factor=1e4, cycle_momentum with base 0.85 / max 0.95), written out
  in float64 from its phase table: (lr, beta1) at ``step_num``."""
  initial_lr = max_lr / 25.0
  min_lr = initial_lr / 1e4
  phases = [
      {"end_step": float(pct_start * total_steps) - 1, "lr": (initial_lr, max_lr),
       "momentum": (0.95, 0.85)},
      {"end_step": total_steps - 1, "lr": (max_lr, min_lr), "momentum": (0.85, 0.95)},
  ]
  start_step = 0.0
  for i, phase in enumerate(phases):
    end_step = phase["end_step"]
    if step_num <= end_step or i == len(phases) - 1:
      pct = (step_num - start_step) / (end_step - start_step)
      lr = (phase["lr"][1] - phase["lr"][0]) * pct + phase["lr"][0]
      momentum = (phase["momentum"][1] - phase["momentum"][0]) * pct + phase["momentum"][0]
      return lr, momentum
    start_step = phase["end_step"]
  raise AssertionError("unreachable")


@pytest.mark.parametrize("warmup, total", [(175, 35000), (175, 3500), (10, 40)])
def test_one_cycle_schedule_is_torch_one_cycle_lr(warmup, total):
  lr_fn, b1_fn = train.one_cycle_schedules(1e-4, warmup, total)
  steps = sorted({0, 1, warmup // 2, warmup - 2, warmup - 1, warmup, warmup + 1, total // 2,
                  total - 2, total - 1})
  for step in steps:
    lr, b1 = _torch_one_cycle(1e-4, total, warmup / total, step)
    np.testing.assert_allclose(float(lr_fn(step)), lr, rtol=2e-5, atol=1e-12)
    np.testing.assert_allclose(float(b1_fn(step)), b1, rtol=1e-6)
  assert float(lr_fn(warmup - 1)) == pytest.approx(1e-4, rel=1e-6)        # the peak
  assert float(lr_fn(0)) == pytest.approx(1e-4 / 25, rel=1e-6)


def test_one_cycle_optimizer_is_adamw_with_the_cycled_beta1(tiny_config):
  """Two AdamW updates against float64 by hand: lr and beta1 of steps 0 and 1, eps 1e-6,
  beta2 0.999, decoupled weight decay times lr (torch AdamW), bias corrections with the
  beta1 of the step (torch Adam reads the cycled beta1 each step)."""
  import optax  # pylint: disable=import-outside-toplevel
  config = tiny_config(num_train_steps=20, **{
      "optim.schedule": "one_cycle", "optim.learning_rate": 1e-2, "optim.warmup_steps": 5,
      "optim.b2": 0.999, "optim.eps": 1e-6, "optim.weight_decay": 0.1})
  tx = train.make_optimizer(config)
  params = np.array([0.5, -1.0, 2.0])
  grads = [np.array([0.1, -0.2, 0.3]), np.array([-0.3, 0.1, 0.2])]
  state = tx.init(jnp.asarray(params, jnp.float32))
  current = jnp.asarray(params, jnp.float32)
  m = v = np.zeros(3)
  want = params.copy()
  for step, grad in enumerate(grads):
    lr, b1 = _torch_one_cycle(1e-2, 20, 5 / 20, step)
    updates, state = tx.update(jnp.asarray(grad, jnp.float32), state, current)
    current = optax.apply_updates(current, updates)
    m = b1 * m + (1 - b1) * grad
    v = 0.999 * v + 0.001 * grad ** 2
    m_hat, v_hat = m / (1 - b1 ** (step + 1)), v / (1 - 0.999 ** (step + 1))
    want = want - lr * (m_hat / (np.sqrt(v_hat) + 1e-6) + 0.1 * want)
  np.testing.assert_allclose(np.asarray(current), want, rtol=1e-5)
  # The state holds the hyperparameters of the last update (step 1), not config.optim.b1.
  assert float(state.hyperparams["b1"]) == pytest.approx(_torch_one_cycle(1e-2, 20, 0.25, 1)[1])
  assert float(state.hyperparams["b1"]) != config.optim.b1


@pytest.mark.parametrize("eval_dtype", ["bfloat16", ""])
def test_eval_dtype_bfloat16_evaluates_parameters_cast_to_bf16(tmp_path, tiny_config,
                                                                monkeypatch, eval_dtype):
  """DFSS Sec. 5.1 tests bf16 models by casting every parameter to bf16: what the eval step
  receives is bf16 (and its model computes in bf16); training and checkpoints stay float32."""
  seen = []
  real = train.make_eval_step

  def recording(model, **kwargs):
    step = real(model, **kwargs)

    def eval_step(params, model_state, batch, weights, *rng):
      seen.append(({str(x.dtype) for x in jax.tree.leaves(params)}, model.model_config.dtype))
      return step(params, model_state, batch, weights, *rng)
    return eval_step

  monkeypatch.setattr(train, "make_eval_step", recording)
  config = tiny_config(num_train_steps=4, eval_every_steps=2, checkpoint_every_steps=4,
                       eval_dtype=eval_dtype)
  train.train_and_evaluate(config, str(tmp_path / "run"))
  assert seen
  want = ({"bfloat16"}, "bfloat16") if eval_dtype else ({"float32"}, "float32")
  assert all(record == want for record in seen), seen
  params = checkpoint_params(tmp_path / "run")
  assert {str(np.asarray(x).dtype) for x in jax.tree.leaves(params)} == {"float32"}


def test_resuming_a_run_recorded_before_a_new_default_keeps_its_old_behaviour(tmp_path,
                                                                              tiny_config):
  """A config.json without attention.dsa.mse_normalization ran the scaled mean: resuming it
  under today's default (Eq. 6) is refused, naming the field; asking for the old form resumes."""
  from lra_sparse import config as config_lib  # pylint: disable=import-outside-toplevel
  from lra_sparse import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  config = config_lib.run_config(tiny_config(**{"attention.kind": "dsa"}))
  stored = json.loads(config.to_json_best_effort())
  del stored["attention"]["dsa"]["mse_normalization"]
  (tmp_path / "config.json").write_text(json.dumps(stored))
  old = workdir_lib.read_config(str(tmp_path))
  with pytest.raises(ValueError, match=r"attention.dsa.mse_normalization: 'scaled_mean' -> "
                                       r"'eq6'[^\n]*$"):
    train.check_resume_config(old, config, str(tmp_path))
  config.attention.dsa.mse_normalization = "scaled_mean"
  assert train.check_resume_config(old, config, str(tmp_path)) == []


def test_deterministic_runs_set_xla_flags_and_every_kernel_backward_without_atomics(
    tmp_path, tiny_config, listops_dir, monkeypatch):
  """config.deterministic: main puts XLA's deterministic ops into XLA_FLAGS before JAX starts
  (the subprocess has no XLA_FLAGS of its own, and the trainer refuses the run without them),
  and every kind with a ``deterministic_kernels`` field records it on; started from Python
  without the flag, the run is refused in one line."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "lra_sparse.main", "--config=configs/listops.py:tiny",
       f"--workdir={tmp_path / 'run'}", "--config.deterministic=True",
       f"--config.data.data_dir={listops_dir}", "--config.data.max_length=128",
       "--config.num_train_steps=2", "--config.eval_every_steps=2",
       "--config.checkpoint_every_steps=2", "--config.log_every_steps=1",
       "--config.num_eval_batches=1", "--config.batch_size=8"],
      cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  config = json.loads((tmp_path / "run" / "config.json").read_text())
  assert config["deterministic"] is True
  assert config["attention"]["dense"]["deterministic_kernels"] is True

  for kind in ("dense", "dfss", "dsa"):
    resolved = config_lib.run_config(tiny_config(**{"attention.kind": kind,
                                                     "deterministic": True}))
    assert resolved.attention[kind].deterministic_kernels is True, kind
    assert config_lib.run_config(tiny_config(**{"attention.kind": kind})).attention[
        kind].deterministic_kernels is False, kind
  nystrom = config_lib.run_config(tiny_config(**{"attention.kind": "nystrom",
                                                 "deterministic": True}))
  assert "deterministic_kernels" not in nystrom.attention.nystrom

  monkeypatch.delenv("XLA_FLAGS", raising=False)
  with pytest.raises(ValueError, match="config.deterministic=True needs XLA_FLAGS to hold "
                                       "--xla_gpu_deterministic_ops=true before JAX starts"):
    train.train_and_evaluate(tiny_config(deterministic=True), str(tmp_path / "python"))
  assert not (tmp_path / "python" / "config.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "dfss", "dsa", "nystrom"])
def test_deterministic_gpu_reruns_repeat_bit_for_bit(tmp_path, listops_dir, kind):
  """On a GPU a rerun of one config differs from the first logged step (unordered atomic
  sums); with config.deterministic the two runs' logs match bit for bit (bf16, so each kind
  trains on its fused kernels where it has them)."""
  records = []
  for name in ("first", "second"):
    proc = _main(tmp_path, f"--config.attention.kind={kind}", "--config.deterministic=True",
                 "--config.model.dtype=bfloat16", f"--config.data.data_dir={listops_dir}",
                 "--config.num_train_steps=20", "--config.eval_every_steps=10",
                 "--config.checkpoint_every_steps=20", "--config.log_every_steps=5",
                 workdir=name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records.append([{k: v for k, v in r.items() if k not in ("time", "steps_per_sec")}
                    for r in _read_metrics(tmp_path / name)])
  assert len(records[0]) > 4 and records[0] == records[1]
