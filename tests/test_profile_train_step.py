"""benchmarks/profile_train_step.py: kernels to model scopes (from the optimized HLO's
metadata) and the kernel events of a Perfetto trace, on small hand-written inputs."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from benchmarks import profile_train_step as prof  # noqa: E402


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
  with pytest.raises(RuntimeError, match="no perfetto_trace.json.gz"):
    list(prof.device_events(str(tmp_path / "empty")))
