"""The multi-GPU issue's tools on a CPU: benchmarks/bench_data_parallel.py on two forced CPU
devices (the two-device step computes what the one-device step does: float32 loss curves equal
up to summation order; bad device counts get one clear error), scripts/compare_runs.py on
hand-written logs, and the --parallel=gpus sweep spec."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from lra_sparse import sweep as sweep_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--overrides=model.num_layers=1,model.emb_dim=32,model.qkv_dim=32,model.mlp_dim=64,"
        "model.num_heads=2,model.classifier_dim=64")


def _run(*args, devices=2):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, "-m", "benchmarks.bench_data_parallel", TINY,
                         "--length=64", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)


def _rows(text, first):
  return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
          if line.startswith(f"| {first}")]


def test_two_devices_train_as_one():
  result = _run("--variants=fp32:xla", "--per_device_batch=4", "--curve_batch=8",
                "--curve_steps=8", "--reps=2", "--warmup=1")
  assert result.returncode == 0, result.stderr[-2000:]
  speed = _rows(result.stdout, "fp32:xla | ")
  assert [row[1:3] for row in speed[:2]] == [["1", "4"], ["2", "8"]]
  assert all(float(row[3]) > 0 for row in speed[:2]) and speed[0][5] == "1.00"
  curves = {row[1]: row for row in speed[2:]}
  assert set(curves) == {"1 device", "2 devices"}   # no float32 reference for a float32 run
  # Same batches, same dropout masks, the same update: only the gradient sums' order differs.
  assert curves["1 device"][2] == curves["2 devices"][2]      # loss at step 1
  assert 0 <= float(curves["2 devices"][-2]) < 1e-5
  assert re.search(r"Loss curves \(8 steps, global batch 8", result.stdout)


def test_curves_alone_with_the_float32_reference():
  result = _run("--variants=bf16:xla", "--devices=1,2", "--speed=false", "--curve_batch=4",
                "--curve_steps=3")
  assert result.returncode == 0, result.stderr[-2000:]
  assert "Speed" not in result.stdout
  curves = {row[1]: row for row in _rows(result.stdout, "bf16:xla | ")}
  assert set(curves) == {"1 device", "2 devices", "1 device, fp32"}
  assert float(curves["1 device"][-2]) == 0
  # bfloat16 against float32 differs by rounding: more than nothing, far less than the loss.
  assert 0 < float(curves["1 device, fp32"][-2]) < 0.1


def test_float32_reference_on_two_devices():
  """--fp32_devices=2 (where one device lacks the memory for the float32 run) computes the
  same float32 curve, up to summation order."""
  curves = {}
  for n in (1, 2):
    result = _run("--variants=bf16:xla", "--devices=1", "--speed=false", "--curve_batch=4",
                  "--curve_steps=3", f"--fp32_devices={n}")
    assert result.returncode == 0, result.stderr[-2000:]
    curves.update({row[1]: row for row in _rows(result.stdout, "bf16:xla | ")})
  assert set(curves) == {"1 device", "1 device, fp32", "2 devices, fp32"}
  one, two = (np.array([float(x) for x in curves[f"{name}, fp32"][2:-2]])
              for name in ("1 device", "2 devices"))
  np.testing.assert_allclose(one, two, atol=2e-4)


@pytest.mark.parametrize("args,message", [
    (("--devices=1,3",), "3 devices asked for; 2 available"),
    (("--speed=false", "--curve_steps=0"), "nothing to measure"),
    (("--devices=2",), "--devices=2 must include 1"),
    (("--devices=1,2", "--curve_batch=5"), "global batch 5 does not split over 2 devices"),
])
def test_bad_device_counts_get_one_clear_error(args, message):
  result = _run("--variants=fp32:xla", "--per_device_batch=2", "--reps=1", "--warmup=0",
                "--curve_steps=2", *args)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last, result.stderr[-1500:]
  assert "Traceback" not in result.stderr


def _workdir(path, losses, *, repeat=(), checkpoints=(), events=1):
  path.mkdir(parents=True)
  records = [{"step": s, "split": "train", "loss": v, "steps_per_sec": 10.0}
             for s, v in losses.items()]
  records += [{"step": s, "split": "train", "loss": losses[s]} for s in repeat]
  records.append({"step": max(losses), "split": "val", "loss": 9.0, "accuracy": 0.5})
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  for step in checkpoints:
    (path / "checkpoints" / str(step)).mkdir(parents=True)
  for i in range(events):
    (path / f"events.out.tfevents.{i}").write_text("")
  return str(path)


def _compare(*args):
  return subprocess.run([sys.executable, "-m", "scripts.compare_runs", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


def test_compare_runs_reports_curve_differences_and_what_was_written(tmp_path):
  one = _workdir(tmp_path / "one_process", {10: 2.0, 50: 1.5, 100: 1.25}, checkpoints=(50, 100))
  two = _workdir(tmp_path / "two_processes", {10: 2.0, 50: 1.5, 100: 1.2505},
                 repeat=(50,), checkpoints=(100,), events=2)
  result = _compare(one, two)
  assert result.returncode == 0, result.stderr
  rows = {row[0]: row for row in _rows(result.stdout, "")}
  assert rows["one_process"][1:4] == ["2.0000", "1.5000", "1.2500"]
  assert rows["one_process"][6:] == ["0.00e+00 (3 steps)", "10.00", "1-1", "50,100", "1"]
  assert rows["two_processes"][6:] == ["5.00e-04 (3 steps)", "10.00", "1-2", "100", "2"]
  result = _compare(one, str(tmp_path / "missing"))
  assert result.returncode == 1 and "missing/metrics.jsonl does not exist" in result.stderr


def test_compare_runs_plots_the_curves(tmp_path):
  one = _workdir(tmp_path / "dense", {10: 2.0, 50: 1.5, 100: 1.25})
  two = _workdir(tmp_path / "dfss", {10: 2.0, 50: 1.4, 100: 1.3}, repeat=(50,))
  png = tmp_path / "curves.png"
  result = _compare(f"--plot={png}", one, two)
  assert result.returncode == 0, result.stderr
  assert f"wrote {png}" in result.stdout
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
  # the plotted curve: each step once, a step logged twice (a resume) with its last record
  with open(os.path.join(two, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 50, "split": "train", "loss": 0.5}) + "\n")
  probe = subprocess.run(
      [sys.executable, "-c", "import sys; from scripts import compare_runs as c; "
       "print(c._curve(sys.argv[1], 'train', 'loss'))", two],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert probe.stdout.strip() == "([10, 50, 100], [2.0, 0.5, 1.3])", probe.stderr


def test_compare_runs_tells_whether_sweep_runs_overlapped(tmp_path):
  runs = [{"name": "a", "slot": "0", "state": "finished", "seconds": 60.0,
           "started": "2026-01-01T00:00:00+00:00", "ended": "2026-01-01T00:01:00+00:00"},
          {"name": "b", "slot": "1", "state": "finished", "seconds": 50.0,
           "started": "2026-01-01T00:00:20+00:00", "ended": "2026-01-01T00:01:10+00:00"},
          {"name": "c", "state": "pending"}]
  manifest = tmp_path / "sweep.json"
  manifest.write_text(json.dumps({"runs": runs}))
  result = _compare(f"--manifest={manifest}")
  assert result.returncode == 0, result.stderr
  assert [row[:2] for row in _rows(result.stdout, "")[1:]] == [["a", "0"], ["b", "1"]]
  assert "2 runs on slots ['0', '1']; all of them ran at once for 40 s" in result.stdout


def test_parallel_gpus_spec_has_one_run_per_kind(monkeypatch):
  monkeypatch.chdir(REPO)
  for preset, steps, dtype in (("", 300, "bfloat16"), (":smoke", 6, None)):
    sweep = sweep_lib.load_sweep(f"experiments/specs/data_parallel_sweep.py{preset}")
    (group,) = sweep.groups
    assert [v.label for v in group.variants] == ["dense", "dfss2-4"]
    assert group.overrides["num_train_steps"] == steps
    assert group.overrides.get("model.dtype") == dtype
  with pytest.raises(ValueError, match="unknown preset 'x'"):
    sweep_lib.load_sweep("experiments/specs/data_parallel_sweep.py:x")


_PER_SHARD_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from lra_sparse import train
from lra_sparse.attention import dfss
from lra_sparse.kernels.dfss import reference as dfss_reference

seen = []
class FakeTriton:   # the kernel's contract, the reference's math; records the batch it gets
  @staticmethod
  def dfss_attention_triton(q, k, v, *, n, m, mask, deterministic, dropout_rate, dropout_seed):
    seen.append(q.shape[0])
    out = dfss_reference.dfss_attention_reference(q, k, v, n=n, m=m, mask=mask)
    if dropout_seed is not None:    # makes the key each shard was given visible
      out = out + jnp.remainder(dropout_seed[1], 1024).astype(out.dtype)
    return out
dfss._pick_kernel = lambda *args: (FakeTriton, "triton")

rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=(4, 32, 2, 16)), jnp.float32) for _ in range(3))
mask = jnp.asarray(np.arange(32)[None] < np.array([32, 20, 9, 32])[:, None])
loss = lambda q, k, v: jnp.sum(dfss.dfss_attention(q, k, v, mask=mask, backend="triton") ** 2)
want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
assert seen == [4], seen
mesh = Mesh(np.array(jax.devices()), ("data",))
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
got = train.in_mesh(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), mesh)(
    put(q), put(k), put(v))
assert seen == [4, 2], seen          # one call per device, on its half of the batch
for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
drop = lambda q: dfss.dfss_attention(q, q, q, mask=mask, backend="triton", dropout_rate=0.1,
                                     dropout_rng=jax.random.key(3))
base = dfss_reference.dfss_attention_reference(q, q, q, n=2, m=4, mask=mask)
shift = np.asarray(train.in_mesh(jax.jit(drop), mesh)(put(q)) - base)[:, 0, 0, 0]
assert (round(shift[2] - shift[0]) % 1024, round(shift[1] - shift[0])) == (1, 0), shift
print("ok")
"""


def test_kernels_run_once_per_device_on_their_shard():
  """Under the trainer's mesh (train.in_mesh) a kernel call gets each device's half of the
  batch, not the gathered batch, with the same values and gradients as one call on the whole
  batch; with dropout each shard's call gets its own Philox key (shard 1's second word is
  shard 0's plus one). Checked with a stand-in for the Triton DFSS kernel on 2 CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  result = subprocess.run([sys.executable, "-c", _PER_SHARD_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


_NYSTROM_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from lra_sparse import train
from lra_sparse.attention import nystrom
from lra_sparse.kernels.nystrom import landmark as la
from lra_sparse.kernels.nystrom import pinv as pinv_pallas

calls = []
def spy(name, fn):
  def wrapped(*args, **kwargs):
    calls.append((name, args[0].shape[0]))
    return fn(*args, **kwargs)
  return wrapped
pinv_pallas.iterate = spy("pinv", pinv_pallas.iterate)
la.few_queries_attention = spy("B V", la.few_queries_attention)
la.few_keys_attention = spy("F", la.few_keys_attention)

rng = np.random.default_rng(0)
b, l, h, d = 4, 40, 2, 16
q, k, v = (jnp.asarray(rng.normal(size=(b, l, h, d)), jnp.bfloat16) for _ in range(3))
mask = jnp.asarray(np.arange(l)[None] < np.array([40, 40, 9, 25])[:, None])   # shards differ
c = jnp.asarray(rng.normal(size=(b, l, h, d)), jnp.float32)
mesh = Mesh(np.array(jax.devices()), ("data",))
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
f = lambda q, k, v: jnp.sum(nystrom.nystrom_attention(
    q, k, v, num_landmarks=32, nm=(1, 2), mask=mask, implementation="pallas") * c)
grad = jax.value_and_grad(f, argnums=(0, 1, 2))
want = jax.jit(grad)(q, k, v)
assert calls == [("pinv", 4), ("B V", 4), ("F", 4)], calls
calls.clear()
got = train.in_mesh(jax.jit(grad), mesh)(put(q), put(k), put(v))
assert calls == [("pinv", 2), ("B V", 2), ("F", 2)], calls
for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
  a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
  np.testing.assert_allclose(a, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())
print("ok")
"""


def test_nystrom_kernels_run_once_per_device_on_their_shard():
  """The Nystromformer's Pallas kernels (B V, F (.), the fused pseudo-inverse; the interpreter
  here) under the trainer's mesh: each gets its device's half of the batch, with the values
  and gradients of one call on the whole batch (the pseudo-inverse's initial scale stays a
  maximum over the whole batch). 2 CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  result = subprocess.run([sys.executable, "-c", _NYSTROM_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


_GRAM_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from lra_sparse import train
from lra_sparse.kernels.dsa import gram as dsa_gram
from lra_sparse.kernels.dsa import reference as ref

calls = []
def stand_in(q, k, xp, w_q, w_k, km, ext, has_mask):   # the Gram kernels' sum, in XLA
  calls.append(q.shape[0])
  mask = (km != 0) if has_mask else None
  per_example = ref.prediction_mse(q.astype(jnp.float32), k.astype(jnp.float32),
                                   ref.LowRank(xp, w_q), ref.LowRank(xp, w_k), mask,
                                   normalization="eq6")
  return per_example * q.shape[0]
dsa_gram._mse = stand_in

rng = np.random.default_rng(1)
b, l, h, d, r = 4, 24, 2, 8, 6
q, k = (jnp.asarray(rng.normal(size=(b, l, h, d)), jnp.float32) for _ in range(2))
xp = jnp.asarray(rng.normal(size=(b, l, r)), jnp.float32)
wq, wk = (jnp.asarray(rng.normal(size=(h, r, r)), jnp.float32) for _ in range(2))
mask = jnp.asarray(np.arange(l)[None] < np.array([24, 24, 5, 11])[:, None])  # shards differ
mesh = Mesh(np.array(jax.devices()), ("data",))
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
for form in ("eq6", "scaled_mean"):
  f = lambda q, k, xp, wq, wk: dsa_gram.prediction_mse(q, k, xp, wq, wk, mask,
                                                       normalization=form)
  grad = jax.value_and_grad(f, argnums=range(5))
  want = jax.jit(grad)(q, k, xp, wq, wk)
  ref_value = ref.prediction_mse(q, k, ref.LowRank(xp, wq), ref.LowRank(xp, wk), mask,
                                 normalization=form)
  got = train.in_mesh(jax.jit(grad), mesh)(put(q), put(k), put(xp), wq, wk)
  np.testing.assert_allclose(float(want[0]), float(ref_value), rtol=1e-5)
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-4)
assert calls == [4, 2, 4, 2], calls
print("ok")
"""


def test_gram_mse_sums_over_shards_then_normalizes():
  """DSA's L_MSE on the Gram kernels under the trainer's mesh: each device sums its shard's
  squared error, the sums are added, then normalised (the mean form divides by all real pairs
  of the batch, which the two shards hold unequally), with the same value and gradients
  (incl. the replicated predictor weights') as one call on the whole batch. The kernels'
  sum stood in for by the XLA Gram form, on 2 CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  result = subprocess.run([sys.executable, "-c", _GRAM_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


_SAVE_ON_TWO_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
assert jax.device_count() == 2
mesh = Mesh(np.array(jax.devices()), ("data",))
put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
state = {"params": {"dense": {"kernel": put(np.arange(12.0).reshape(4, 3), P()),
                              "bias": put(np.arange(4.0), P("data"))}},
         "opt_state": {"mu": put(np.ones((4, 3)), P())}, "step": put(7, P())}
manager = ocp.CheckpointManager(sys.argv[1] + "/checkpoints")
manager.save(7, args=ocp.args.StandardSave(state))
manager.wait_until_finished()
print("saved")
"""

_LOAD_ON_ONE_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from lra_sparse import checkpointing
assert jax.device_count() == 1
params = {"dense": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(4)},
          "head": {"kernel": jnp.full((3, 2), 5.0)}}
loaded, fresh, unused = checkpointing.load_params_from(sys.argv[1], params)
np.testing.assert_array_equal(loaded["dense"]["kernel"], np.arange(12.0).reshape(4, 3))
np.testing.assert_array_equal(loaded["dense"]["bias"], np.arange(4.0))
np.testing.assert_array_equal(loaded["head"]["kernel"], np.full((3, 2), 5.0))
assert fresh == ["head/kernel"] and unused == [], (fresh, unused)
print("ok")
"""


def test_init_from_reads_a_checkpoint_that_two_devices_wrote_on_one(tmp_path):
  """config.init_from (checkpointing.load_params_from) of a run saved data parallel on two
  devices, read by a run on one (a fine-tune on one GPU of a dense run trained on two): the
  parameters come back as saved, the new ones stay at their init. Without a target on this
  process's devices orbax refused it ("Topology mismatch"), as it did on a 4-GPU machine."""
  def run(script, devices):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  saved = run(_SAVE_ON_TWO_SCRIPT, 2)
  assert saved.returncode == 0 and "saved" in saved.stdout, saved.stderr[-3000:]
  loaded = run(_LOAD_ON_ONE_SCRIPT, 1)
  assert loaded.returncode == 0 and loaded.stdout.strip().endswith("ok"), loaded.stderr[-3000:]
