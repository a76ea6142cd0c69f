"""The committed carry parts (experiments/carry/) still resume under the current code.

A long GPU run outlives a session only as committed carry parts (records and newest
checkpoint). A change to a spec or to a config's defaults would make its next call refuse the
carried run ("holds a run with another config") or, worse, start it again from step 0 under a
new name, losing every carried step; this test says so on the CPU, before device time is spent.
"""
import os

import pytest

from lra_sparse import config as config_lib
from lra_sparse import train
from lra_sparse import workdir as workdir_lib
from lra_sparse.sweep import carry
from lra_sparse.sweep import spec as spec_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRY = os.path.join(REPO, "experiments", "carry")
# Each carry folder: the sweep its parts belong to and the ROOT its device command names
# (a run's init_from is a path under ROOT.pI, so the configs compare only under that root).
SWEEPS = {"pathfinder32": ("experiments/specs/pathfinder32.py:all", "/tmp/pf")}


def _parts():
  folders = sorted(name for name in os.listdir(CARRY)
                   if os.path.isdir(os.path.join(CARRY, name)))
  return [(folder, part) for folder in folders
          for part in sorted(os.listdir(os.path.join(CARRY, folder)))]


def test_every_carry_folder_names_its_sweep():
  folders = {folder for folder, _ in _parts()}
  assert folders <= set(SWEEPS), f"add {sorted(folders - set(SWEEPS))} to SWEEPS"


@pytest.mark.parametrize("folder,part", _parts())
def test_a_carried_run_resumes_under_the_current_spec(folder, part, tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)                       # specs and configs load by relative path
  spec_arg, root = SWEEPS[folder]
  assert part.startswith("p") and part[1:].isdigit(), part
  unpacked = carry.unpack(str(tmp_path), os.path.join(CARRY, folder, part))
  assert unpacked and all(text.startswith("unpacked (checkpoint ")
                          for text in unpacked.values()), unpacked
  plans = {plan.name: plan for plan in
           spec_lib.expand_sweep(spec_lib.load_sweep(spec_arg), f"{root}.{part}")}
  for name in unpacked:
    assert name in plans, f"{folder}/{part}: {name} is no run of {spec_arg} any more"
    plan = plans[name]
    config = config_lib.load_config_file(plan.config, plan.preset)
    config.update_from_flattened_dict(plan.overrides)
    workdir = os.path.join(tmp_path, name)
    stored = workdir_lib.read_config(workdir)
    changes = train.check_resume_config(stored, config_lib.run_config(config), workdir)
    assert not changes, f"{folder}/{part}: {name} would resume with {changes}"
    checkpoint = int(unpacked[name].split("checkpoint ")[1].rstrip(")"))
    steps = [step for _, record in workdir_lib.read_metrics(workdir)
             if isinstance(step := record.get("step"), int)]
    assert 0 < checkpoint < stored["num_train_steps"] and steps     # records came along
