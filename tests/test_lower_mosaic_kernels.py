"""scripts/lower_mosaic_kernels.py: the grid it lowers, how it reports a failing case, and the
Mosaic kernels lowered for CUDA on this CPU (jax 0.11 and later: the venv's under Python
3.12)."""
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import lower_mosaic_kernels as lower


def test_cases_are_the_grid_of_kinds_head_dims_rates_and_masks():
  grid = lower.cases(["dense", "2:4"], ["8", "64"], ["0", "0.1"], ["none", "holes"])
  assert len(grid) == 16
  assert grid[0] == ("dense", 8, 0.0, "none")
  assert ((2, 4), 64, 0.1, "holes") in grid
  with pytest.raises(ValueError, match="--masks: 'prefix' is not none or holes"):
    lower.cases(["dense"], ["8"], ["0"], ["prefix"])
  with pytest.raises(ValueError, match="--kinds"):
    lower.cases(["5:4"], ["8"], ["0"], ["none"])


def test_a_failing_case_reports_its_first_line_or_where_it_failed(monkeypatch):
  from lra_sparse.kernels.dfss import mosaic
  tiles = mosaic.Tiles()

  def message(*args, **kwargs):
    raise ValueError("smem_bytes=234624 > max_smem_bytes=232448\nthe rest")

  def bare(*args, **kwargs):
    raise AssertionError   # as a bare assert in library code (pytest rewrites the tests' own)

  monkeypatch.setattr(mosaic, "dfss_attention_mgpu", message)
  assert lower.lower_case(((2, 4), 64, 0.0, "none"), tiles) == (
      "FAILED: ValueError: smem_bytes=234624 > max_smem_bytes=232448")
  monkeypatch.setattr(mosaic, "dense_attention_mgpu", bare)
  result = lower.lower_case(("dense", 16, 0.1, "holes"), tiles)
  assert result.startswith("FAILED: AssertionError at test_lower_mosaic_kernels.py:")
  assert "(raise AssertionError" in result

  def fine(q, k, v, **kwargs):
    assert kwargs["tiles"] is tiles and kwargs["dropout_rate"] == 0.1
    mask = np.asarray(kwargs["mask"])     # a constant of the trace: holes, a padded example
    assert mask.shape == q.shape[:2] and not mask[-1].any() and 0 < mask[0].mean() < 1
    assert q.dtype == jnp.bfloat16 and q.shape[-1] == 16
    return q * 1.0

  monkeypatch.setattr(mosaic, "dense_attention_mgpu", fine)
  assert lower.lower_case(("dense", 16, 0.1, "holes"), tiles) == "ok"


def _jax_lowers_the_kernels() -> bool:
  """jax 0.11 and later lower every primitive the kernels use (0.10.2 lacks concatenate in
  Mosaic GPU's warpgroup lowering); ``make venv`` gets 0.11.2 wherever Python 3.12 runs."""
  import jax
  return tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


@pytest.mark.skipif(not _jax_lowers_the_kernels(),
                    reason="lowering the Mosaic GPU kernels needs jax >= 0.11 (Python 3.12)")
def test_every_mosaic_kernel_case_lowers_for_cuda():
  """Dense and DFSS 2:4 / 1:2, forward and backward, head dims 8 (run at 16), 32, 64 and 128,
  with and without attention dropout, key masks with holes: each lowers for CUDA here, so a
  kernel change that breaks a wgmma's shapes or swizzles or overflows shared memory fails on
  the CPU."""
  from lra_sparse.kernels.dfss import mosaic
  grid = lower.cases(["dense", "2:4", "1:2"], ["8", "32", "64", "128"], ["0", "0.1"], ["holes"])
  results = {case: lower.lower_case(case, mosaic.DEFAULT_TILES) for case in grid}
  assert {case: r for case, r in results.items() if r != "ok"} == {}
  assert len(results) == 24


@pytest.mark.skipif(not _jax_lowers_the_kernels(),
                    reason="lowering the Mosaic GPU kernels needs jax >= 0.11 (Python 3.12)")
def test_the_two_kernel_backward_lowers_for_cuda():
  """Tiles(fused_backward=False), the backward of deterministic runs (the grid above lowers
  the default, fused one): dense and DFSS 2:4 at head dims 8 and 64, with dropout and holes."""
  from lra_sparse.kernels.dfss import mosaic
  grid = lower.cases(["dense", "2:4"], ["8", "64"], ["0.1"], ["holes"])
  tiles = mosaic.Tiles(fused_backward=False)
  assert {c: r for c in grid if (r := lower.lower_case(c, tiles)) != "ok"} == {}


def _kernel_launches(loss, head_dim: int) -> int:
  """Mosaic GPU kernels launched by the forward and backward of ``loss``, lowered for CUDA."""
  import jax
  q = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
  return lower.kernel_launches(lower.lowered_for_cuda(loss, q))


@pytest.mark.skipif(not _jax_lowers_the_kernels(),
                    reason="lowering the Mosaic GPU kernels needs jax >= 0.11 (Python 3.12)")
@pytest.mark.parametrize("kind", ["dense", "2:4"])
def test_deterministic_kernels_reach_the_mosaic_backward(monkeypatch, kind):
  """The public functions the model calls (``dense_attention`` / ``dfss_attention`` with the
  configs' ``deterministic_kernels``) pick the Mosaic backward: by default one kernel at head
  dims up to 64 (dK/dV adding dQ's shares), so forward + backward launch 2 kernels; with
  deterministic_kernels=True the separate dQ kernel too (3); at head dim 128 always 3 (the
  fused kernel's shared memory does not fit). Lowered for CUDA on this CPU, the kernels'
  availability check patched."""
  from lra_sparse.attention.dense import dense_attention
  from lra_sparse.attention.dfss import dfss_attention
  from lra_sparse.kernels.dfss import mosaic
  monkeypatch.setattr(mosaic, "is_available", lambda: True)

  def launches(head_dim, deterministic):
    def loss(q, k, v):
      if kind == "dense":
        out = dense_attention(q, k, v, implementation="mosaic",
                              deterministic_kernels=deterministic)
      else:
        out = dfss_attention(q, k, v, n=2, m=4, backend="mosaic",
                             deterministic_kernels=deterministic)
      return out.astype(jnp.float32).sum()
    return _kernel_launches(loss, head_dim)

  assert [launches(64, False), launches(64, True), launches(128, False)] == [2, 3, 3]
  assert launches(8, False) == 2     # Path-X's head dim, run at 16


_SHARDED_LOWERING = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from lra_sparse.attention.dfss import dfss_attention
from lra_sparse.kernels.dfss import mosaic
from lra_sparse.ops import sharding
from scripts.lower_mosaic_kernels import kernel_launches, lowered_for_cuda
mosaic.is_available = lambda: True
mesh = jax.make_mesh((2,), (sharding.DATA_AXIS,))
q = jax.ShapeDtypeStruct((4, 256, 2, 64), jnp.bfloat16,
                         sharding=NamedSharding(mesh, PartitionSpec(sharding.DATA_AXIS)))
for deterministic in (False, True):
  loss = lambda q, k, v: dfss_attention(q, k, v, n=2, m=4, backend="mosaic",
      deterministic_kernels=deterministic).astype(jnp.float32).sum()
  with jax.set_mesh(mesh):
    text = lowered_for_cuda(loss, q)
  per_shard = "manual_computation" in text or "SPMDFullToShardShape" in text   # shard_map's
  print(deterministic, kernel_launches(text), per_shard)
"""


@pytest.mark.skipif(not _jax_lowers_the_kernels(),
                    reason="lowering the Mosaic GPU kernels needs jax >= 0.11 (Python 3.12)")
def test_the_fused_backward_lowers_per_data_shard():
  """On a data-parallel mesh (two CPU devices here) the kernels run once per shard inside
  ``shard_map``: the fused backward's float32 dQ (a ``jax.new_ref`` the dK/dV kernel adds into)
  lowers there too, as one backward kernel; deterministic_kernels=True gives two."""
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  result = subprocess.run([sys.executable, "-c", _SHARDED_LOWERING], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split("\n")[:2] == ["False 2 True", "True 3 True"], result.stdout
