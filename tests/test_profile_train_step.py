"""lra_sparse/profiling.py (what benchmarks/profile_train_step.py reports): kernels to model
scopes (from the optimized HLO's metadata) and the kernel events of a Perfetto trace, on small
hand-written inputs; and benchmarks/bench_train_step.py's --attention_dropout, run as a
program."""
import gzip
import json
import os
import sys

import pytest

from lra_sparse import profiling as prof


@pytest.mark.parametrize("op_name,scope", [
    ("jit(train_step)/transpose(jvp(Classifier))/encoder/block_1/attention/DSAAttention_0/"
     "blhd,blhe->bhde/dot_general", "bwd DSAAttention_0/blhd,blhe->bhde"),
    ("jit(train_step)/jvp(Classifier)/encoder/block_0/attention/DSAAttention_0/jit(_where)/"
     "select_n", "fwd DSAAttention_0/select_n"),
    ("jit(train_step)/jvp(Classifier)/encoder/block_0/Dropout_1/select_n",
     "fwd Dropout_1/select_n"),
    ("jit(train_step)/add", "fwd add"),
])
def test_scope_of_names_the_innermost_module_and_its_op(op_name, scope):
  assert prof.scope_of(op_name) == scope


def test_fusion_scopes_and_kernel_events(tmp_path):
  hlo = tmp_path / "module_0007.jit_train_step.sm_9.0_gpu_after_optimizations.txt"
  hlo.write_text(
      '  %gemm_fusion_dot.375 = f32[2]{0} fusion(%p), kind=kCustom, metadata={op_type='
      '"dot_general" op_name="jit(train_step)/transpose(jvp(Classifier))/encoder/block_1/'
      'attention/DSAAttention_0/blr,bls->brs/dot_general" source_file="x.py"}\n'
      '  ROOT %loop_add_fusion = f32[2]{0} fusion(%a), kind=kLoop, metadata={op_type="add" '
      'op_name="jit(train_step)/jvp(Classifier)/encoder/block_0/add"}\n')
  scopes = prof.fusion_scopes(str(tmp_path))
  assert prof.kernel_scope("gemm_fusion_dot_375", scopes) == "bwd DSAAttention_0/blr,bls->brs"
  assert prof.kernel_scope("loop_add_fusion", scopes) == "fwd block_0/add"
  assert prof.kernel_scope("dsa_bwd_onepass", scopes) == "kernel dsa_bwd_onepass"
  trace_dir = tmp_path / "trace" / "plugins" / "profile" / "run"
  trace_dir.mkdir(parents=True)
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "tid": 5, "name": "thread_name",
       "args": {"name": "Stream #14(Compute)"}},
      {"ph": "M", "pid": 2, "tid": 6, "name": "thread_name", "args": {"name": "XLA Ops"}},
      {"ph": "X", "pid": 2, "tid": 5, "name": "dsa_fwd", "dur": 120.0},
      {"ph": "X", "pid": 2, "tid": 6, "name": "fusion.1", "dur": 999.0},   # a summary line
      {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction", "dur": 500.0},  # the host
  ]
  with gzip.open(trace_dir / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert list(prof.device_events(str(tmp_path / "trace"))) == [("dsa_fwd", 120.0)]
  kernels = prof.kernel_times(str(tmp_path / "trace"), 2, scopes)   # a trace of 2 steps
  assert kernels == {"dsa_fwd": {"ms": 0.06, "calls": 0.5, "scope": "kernel dsa_fwd"}}
  assert prof.scope_times(kernels) == {"kernel dsa_fwd": 0.06}
  with pytest.raises(RuntimeError, match="no perfetto_trace.json.gz"):
    list(prof.device_events(str(tmp_path / "empty")))


def test_bench_train_step_says_its_attention_dropout_and_applies_it():
  """bench_train_step trains every variant with --attention_dropout (default 0, what a cuDNN
  variant needs; not the configs' LRA default of 0.1), says so in its header, and the rate
  reaches the model (same seeds, another loss)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  losses = {}
  for rate in (None, "0.5"):
    args = [sys.executable, "-m", "benchmarks.bench_train_step", "--variants=fp32:xla",
            "--batch=2", "--length=32", "--reps=1", "--warmup=0",
            "--overrides=model.num_layers=1,model.emb_dim=32,model.qkv_dim=32,"
            "model.mlp_dim=64,model.num_heads=2,model.classifier_dim=64"]
    if rate:
      args.append(f"--attention_dropout={rate}")
    result = subprocess.run(args, cwd=repo, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"attention dropout {rate or 0}; " in result.stdout
    row = [line for line in result.stdout.splitlines() if line.startswith("| fp32:xla")]
    assert len(row) == 1 and "failed" not in row[0], result.stdout[-2000:]
    losses[rate] = float(row[0].split("|")[4])
  assert losses[None] != losses["0.5"]


def test_bench_train_step_ab_tiles():
  """--ab_tiles times each variant twice: as it is, then with the Mosaic kernels' default tiles
  swapped for the given ones while it traces (min_head_dim=64: Path-X's 8 padded to 64 as
  before the kernels ran 16 and 32), restored after; a bad field or value is one clear error."""
  from benchmarks import bench_train_step as bench  # pylint: disable=import-outside-toplevel
  from lra_sparse.kernels.dfss import mosaic  # pylint: disable=import-outside-toplevel
  tiles = mosaic.parse_tiles("min_head_dim=64,schedule_barrier=False")
  assert tiles == mosaic.Tiles(min_head_dim=64, schedule_barrier=False)
  for bad, match in (("min_head_dim=x", "not field=value"), ("nope=1", "not field=value"),
                     ("schedule_barrier=yes", "not field=value"),
                     ("min_head_dim=8", "min_head_dim must be one of")):
    with pytest.raises(ValueError, match=match):
      mosaic.parse_tiles(bad)
  runs = list(bench.timed_runs(["bf16:auto", "bf16:kind=dfss"], tiles, "min_head_dim=64"))
  assert [(label, variant) for label, variant, _ in runs] == [
      ("bf16:auto", "bf16:auto"), ("bf16:auto [tiles min_head_dim=64]", "bf16:auto"),
      ("bf16:kind=dfss", "bf16:kind=dfss"),
      ("bf16:kind=dfss [tiles min_head_dim=64]", "bf16:kind=dfss")]
  widths = []
  for _, _, context in runs[:2]:
    with context:
      widths.append(mosaic.kernel_head_dim(8))
  assert widths == [16, 64] and mosaic.kernel_head_dim(8) == 16
  assert mosaic.DEFAULT_TILES == mosaic.Tiles()
  assert [label for label, _, _ in bench.timed_runs(["bf16:auto"], None)] == ["bf16:auto"]
