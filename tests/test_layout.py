"""The package's structure: imports point down, no circles, no tuning globals, moved paths say
where they went, and experiments/ names files by what they show."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "lra_sparse")


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for every module of lra_sparse."""
  out = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path[:-3], REPO).replace(os.sep, ".")
        out[dotted.removesuffix(".__init__")] = path
  return out


def _imports(path: str, modules) -> set[str]:
  """The lra_sparse modules ``path`` imports (``from a import b`` counts a.b when that is a
  module, else a), anywhere in the file (function-level imports too)."""
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lra_sparse"):
      for alias in node.names:
        child = f"{node.module}.{alias.name}"
        found.add(child if child in modules else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("lra_sparse"))
  return found


MODULES = _modules()
GRAPH = {name: _imports(path, MODULES) for name, path in MODULES.items()}


def test_kernels_and_ops_import_nothing_above_them():
  upward = []
  for name, deps in GRAPH.items():
    if name.startswith("lra_sparse.kernels"):
      allowed = ("lra_sparse.kernels", "lra_sparse.ops")
    elif name.startswith("lra_sparse.ops"):
      allowed = ("lra_sparse.ops",)
    else:
      continue
    upward += [(name, dep) for dep in deps if not dep.startswith(allowed)]
  assert not upward, upward


def test_no_import_cycles_between_modules():
  """Module-to-module cycles (a package's __init__ importing its own children is not one)."""
  def edges(name):
    return [d for d in GRAPH[name] if d in GRAPH and d != name
            and not name.startswith(d + ".") and not d.startswith(name + ".")]

  state, cycles = {}, []

  def visit(name, stack):
    state[name] = "open"
    for dep in edges(name):
      if state.get(dep) == "open":
        cycles.append(stack[stack.index(dep):] + [dep])
      elif dep not in state:
        visit(dep, stack + [dep])
    state[name] = "done"

  for name in GRAPH:
    if name not in state:
      visit(name, [name])
  assert not cycles, cycles


def test_the_graph_sees_a_real_import():
  """The checks above read real edges (a broken parser would pass them vacuously)."""
  assert "lra_sparse.ops.nm" in GRAPH["lra_sparse.kernels.dfss.mosaic"]
  assert "lra_sparse.kernels.dfss.mosaic" in GRAPH["lra_sparse.attention.dfss"]


def test_kernels_keep_no_tuning_state_in_module_globals():
  """No ``global`` statement and no store into a module-level container from a function in
  kernels/ (tiles are arguments); the tests' poisoned-kernel registry is the one exception."""
  offenders = []
  for name, path in MODULES.items():
    if not name.startswith("lra_sparse.kernels"):
      continue
    tree = ast.parse(open(path, encoding="utf-8").read())
    module_names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)}
    for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
      for node in ast.walk(func):
        if isinstance(node, ast.Global):
          offenders.append((name, func.name, "global"))
        stored = (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in module_names)
        if stored and (name, node.value.id) != ("lra_sparse.kernels.shared.launch", "_POISONED"):
          offenders.append((name, func.name, node.value.id))
  assert not offenders, offenders


@pytest.mark.parametrize("statement,new", [
    ("from lra_sparse.kernels import dfss_triton", "lra_sparse.kernels.dfss.triton"),
    ("import lra_sparse.kernels.dsa_reference", "lra_sparse.kernels.dsa.reference"),
    ("from lra_sparse.attention.nm import parse_nm", "lra_sparse.ops.nm"),
    ("from lra_sparse.kernels.dfss_mgpu import Tiles", "lra_sparse.kernels.dfss.mosaic"),
])
def test_an_old_module_path_names_its_new_one(statement, new):
  result = subprocess.run([sys.executable, "-c", statement], cwd=REPO, capture_output=True,
                          text=True, check=False)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].endswith(f"moved to {new}"), result.stderr


def test_experiment_file_names_say_what_they_show():
  """No name under experiments/ says which session or day made it (that goes in its header)."""
  files = subprocess.run(["git", "ls-files", "experiments"], cwd=REPO, capture_output=True,
                         text=True, check=False).stdout.split()
  if not files:
    pytest.skip("not a git checkout")
  pattern = re.compile(r"session|20\d\d-\d\d-\d\d|_before|_after|_final", re.IGNORECASE)
  assert not [f for f in files if pattern.search(f)]


def test_committed_runs_hold_only_their_records():
  """A run folder under experiments/results holds config.json, metrics.jsonl and result.json
  (no logs, event files or checkpoints: experiments/results/README.md); a sweep root may add
  its sweep.json and a note beside the runs."""
  files = subprocess.run(["git", "ls-files", "experiments/results"], cwd=REPO,
                         capture_output=True, text=True, check=False).stdout.split()
  if not files:
    pytest.skip("not a git checkout")
  run_dirs = {os.path.dirname(f) for f in files if f.endswith("/config.json")}
  assert run_dirs, "no committed run folders found"
  records = {"config.json", "metrics.jsonl", "result.json"}
  stray = [f for f in files if os.path.dirname(f) in run_dirs
           and os.path.basename(f) not in records]
  assert not stray, stray
