r"""A sweep spec and its expansion into runs.

A sweep spec is a python file whose ``get_sweep(preset="")`` returns a :class:`Sweep`; the
optional ``:preset`` after the path (``experiments/specs/x.py:tiny``) is passed to it, like the
config files. A sweep is a list of :class:`Group`\ s, each one config file (+ preset), fixed
overrides, and axes: ``product`` (every combination), ``zip`` (lists walked together),
``variants`` (a list of override dicts, e.g. dense vs. DFSS 1:2) and ``seeds``; the runs of a
group are the product of the variants, the zipped lists, the product axes and the seeds.

An override value may be a :class:`Ref` to a run of an earlier group
(``init_from=Ref("pretrain")``): it becomes that run's workdir, the run waits for it, and is
marked ``blocked`` if it failed or was interrupted.

Every run gets a deterministic name (group, config, variant label, axis values, seed) and the
workdir ``<root>/<name>`` (:class:`RunPlan`, :func:`expand_sweep`).

``step_cost`` (on a group and on a variant, multiplied; default 1) is a scheduling hint: the
time of one training step relative to the sweep's other runs. A run's cost is its
``num_train_steps`` times it; with several GPU slots the local executor launches first the
ready run with the most work on its chain of dependents (critical path first), so a slow kind's
pretraining and fine-tune do not start last and end after every other run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import sys
from typing import Any, Iterable, Mapping, Sequence

import ml_collections

from lra_sparse import config as config_lib

MAX_NAME_LENGTH = 150
DEFAULT_MAIN = (sys.executable, "-m", "lra_sparse.main")
_MISSING = object()


# ----------------------------------------------------------------------------- spec structures


@dataclasses.dataclass(frozen=True)
class Ref:
  """The workdir of one run of an earlier group of the same sweep.

  The referenced run is the one in ``group`` that agrees with the referring run on every key in
  ``same`` ("config" = config file and preset; other names are override keys such as "seed")
  and whose overrides contain ``match``. Exactly one run must qualify.
  """
  group: str
  same: tuple[str, ...] = ("config", "seed")
  match: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Variant:
  """A labelled set of overrides; the label replaces its key=value parts in run names."""
  label: str
  overrides: Mapping[str, Any]
  step_cost: float = 1.0                        # relative time per step (see the module doc)


@dataclasses.dataclass
class Group:
  """Runs sharing one config file: fixed overrides x variants x zip x product x seeds."""
  config: str                                   # "configs/listops.py" or "configs/listops.py:tiny"
  name: str = ""                                # name prefix; needed when several groups exist
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  variants: Sequence[Mapping[str, Any] | Variant] = (dict(),)
  zip: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
  product: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
  seeds: Sequence[int] = (0,)
  step_cost: float = 1.0                        # relative time per step (see the module doc)


@dataclasses.dataclass
class Sweep:
  name: str
  groups: Sequence[Group]


@dataclasses.dataclass
class RunPlan:
  """One run of an expanded sweep."""
  name: str
  group: str
  config: str                                   # config file path, without preset
  preset: str
  overrides: dict[str, Any]                     # Ref values resolved to workdir paths
  workdir: str
  depends_on: list[str]
  cost: float = 1.0                             # num_train_steps x step_cost (scheduling)

  @property
  def config_arg(self) -> str:
    return f"{self.config}:{self.preset}" if self.preset else self.config

  def command(self, main_command: Sequence[str] = DEFAULT_MAIN) -> list[str]:
    args = [*main_command, f"--config={self.config_arg}", f"--workdir={self.workdir}"]
    args += [f"--config.{key}={format_flag_value(value)}"
             for key, value in sorted(self.overrides.items())]
    return args


# ----------------------------------------------------------------------------- loading specs


def load_sweep(spec_arg: str) -> Sweep:
  sweep = config_lib.call_spec_function(spec_arg, "get_sweep")
  if not isinstance(sweep, Sweep):
    raise ValueError(f"{spec_arg}: get_sweep() must return lra_sparse.sweep.Sweep, "
                     f"got {type(sweep).__name__}")
  return sweep


# ----------------------------------------------------------------------------- expansion


def format_flag_value(value: Any) -> str:
  """The text after ``--config.key=`` that ml_collections parses back to ``value``."""
  if isinstance(value, Ref):
    raise ValueError(f"unresolved {value!r}")
  if value is None:
    raise ValueError("None cannot be passed as a --config override")
  if isinstance(value, float):
    return repr(value)
  return str(value)


def format_name_value(value: Any) -> str:
  """A short, filesystem-safe rendering of an axis value for run names."""
  if isinstance(value, bool):
    text = str(value).lower()
  elif isinstance(value, float):
    text = format(value, "g")
  elif value == "":
    text = "none"
  else:
    text = str(value)
  return re.sub(r"[^A-Za-z0-9.+-]", "_", text.replace(":", "-"))


def _short_keys(keys: Iterable[str]) -> dict[str, str]:
  """Last dotted component of each key, or the full key where two keys would collide."""
  keys = sorted(set(keys))
  last = {key: key.rsplit(".", 1)[-1] for key in keys}
  counts: dict[str, int] = {}
  for short in last.values():
    counts[short] = counts.get(short, 0) + 1
  return {key: (last[key] if counts[last[key]] == 1 else key) for key in keys}


def _canonical(value: Any) -> str:
  return json.dumps(value, sort_keys=True, default=repr)


def _check_step_cost(value: Any, where: str) -> float:
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not math.isfinite(value) or value <= 0):
    raise ValueError(f"{where}: step_cost must be a positive finite number, got {value!r}")
  return float(value)


def _group_axis_combinations(
    group: Group, where: str) -> list[tuple[str, set[str], dict[str, Any], float]]:
  """(variant label, keys the label names, axis overrides incl. seed, step cost) per run of
  the group.

  The order is deterministic: variants, zip, product (keys sorted), seeds.
  """
  group_cost = _check_step_cost(group.step_cost, where)
  variants = [(variant.label, dict(variant.overrides),
               group_cost * _check_step_cost(variant.step_cost,
                                             f"{where} variant {variant.label!r}"))
              if isinstance(variant, Variant) else ("", dict(variant), group_cost)
              for variant in group.variants] or [("", {}, group_cost)]
  labels = [label for label, _, _ in variants if label]
  if len(set(labels)) != len(labels) or any(re.search(r"[^A-Za-z0-9.+=-]", l) for l in labels):
    raise ValueError(f"{where}: variant labels must be distinct and use only letters, digits "
                     f"and . + = -, got {labels}")
  zip_keys = sorted(group.zip)
  zip_lengths = {len(group.zip[key]) for key in zip_keys}
  if len(zip_lengths) > 1:
    raise ValueError(f"{where}: zip lists have different lengths "
                     f"{ {key: len(group.zip[key]) for key in zip_keys} }")
  zipped = ([dict(zip(zip_keys, values)) for values in zip(*(group.zip[key] for key in zip_keys))]
            if zip_keys else [{}])
  product_keys = sorted(group.product)
  for key in product_keys:
    if isinstance(group.product[key], (str, bytes)) or not len(group.product[key]):
      raise ValueError(f"{where}: product axis {key!r} must be a non-empty list")
  products = [dict(zip(product_keys, values))
              for values in itertools.product(*(group.product[key] for key in product_keys))]
  seeds = list(group.seeds)
  if not seeds:
    raise ValueError(f"{where}: seeds must not be empty")
  combos = []
  for (label, variant, cost), zipped_values, product_values, seed in itertools.product(
      variants, zipped, products, seeds):
    parts = [variant, zipped_values, product_values, dict(group.overrides)]
    seen: set[str] = set()
    for part in parts:
      clash = seen & set(part)
      if clash:
        raise ValueError(f"{where}: {sorted(clash)} set by more than one of "
                         "variants/zip/product/overrides")
      seen |= set(part)
    if "seed" in seen:
      raise ValueError(f"{where}: set seeds with Group(seeds=...), not as an override")
    axis_values = {**variant, **zipped_values, **product_values, "seed": seed}
    # Keys named by the variant label stay out of the key=value part of the run name.
    combos.append((label, set(variant) if label else set(), axis_values, cost))
  return combos


def expand_sweep(sweep: Sweep, root: str, validate: bool = True) -> list[RunPlan]:
  """All runs of a sweep, in launch order (groups in order; a Ref points to an earlier group)."""
  if not sweep.groups:
    raise ValueError(f"sweep {sweep.name!r} has no groups")
  group_names = [group.name for group in sweep.groups if group.name]
  if len(set(group_names)) != len(group_names):
    raise ValueError(f"sweep {sweep.name!r}: group names must be distinct, got {group_names}")
  root = os.path.abspath(root)
  runs: list[RunPlan] = []
  runs_by_group: dict[str, list[RunPlan]] = {}
  names: dict[str, dict[str, Any]] = {}
  for index, group in enumerate(sweep.groups):
    where = f"sweep {sweep.name!r} group {group.name or index!r}"
    config_path, preset = config_lib.split_spec_arg(group.config)
    base_config = _load_group_config(config_path, preset, where) if validate else None
    combos = _group_axis_combinations(group, where)
    # Axis keys (variants/zip/product) name the runs, seed always does; fixed overrides do not.
    axis_keys = sorted({key for _, _, combo, _ in combos for key in combo} - {"seed"})
    short = _short_keys(axis_keys)
    config_label = os.path.splitext(os.path.basename(config_path))[0] + (
        f"-{preset}" if preset else "")
    group_runs = []
    for label, labelled_keys, combo, step_cost in combos:
      parts = ([group.name] if group.name else []) + [config_label] + ([label] if label else [])
      parts += [f"{short[key]}={format_name_value(combo[key])}" for key in axis_keys
                if key in combo and key not in labelled_keys and not isinstance(combo[key], Ref)]
      parts.append(f"seed={combo['seed']}")
      name = "__".join(parts)
      overrides = {**dict(group.overrides), **combo}
      if base_config is not None:
        validate_run_overrides(base_config, overrides, f"{where} run {name!r}")
      identity = {"group": group.name, "config": group.config,
                  "overrides": {k: (repr(v) if isinstance(v, Ref) else v)
                                for k, v in overrides.items()}}
      if len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha1(_canonical(identity).encode()).hexdigest()[:8]
        name = f"{name[:MAX_NAME_LENGTH - 10]}__{digest}"
      if name in names:
        raise ValueError(f"{where}: two runs get the name {name!r}: {names[name]} and "
                         f"{identity}; make the axis values distinct")
      names[name] = identity
      resolved, depends_on = {}, []
      for key, value in overrides.items():
        if isinstance(value, Ref):
          target = _resolve_ref(value, overrides, group.config, runs_by_group, where, key)
          resolved[key] = target.workdir
          depends_on.append(target.name)
        else:
          resolved[key] = value
      steps = overrides.get("num_train_steps", base_config.get("num_train_steps", 1)
                            if base_config is not None else 1)
      run = RunPlan(name=name, group=group.name, config=config_path, preset=preset,
                    overrides=resolved, workdir=os.path.join(root, name),
                    depends_on=sorted(set(depends_on)),
                    cost=step_cost * (steps if isinstance(steps, int) and steps > 0 else 1))
      group_runs.append(run)
    if group.name:
      runs_by_group[group.name] = group_runs
    runs.extend(group_runs)
  return runs


def _load_group_config(config_path: str, preset: str, where: str):
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{where}: config file {config_path!r} does not exist "
                            "(paths are relative to the directory the sweep runs in)")
  return config_lib.load_config_file(config_path, preset)


def _resolve_ref(ref: Ref, overrides: Mapping[str, Any], config_arg: str,
                 runs_by_group: Mapping[str, list[RunPlan]], where: str, key: str) -> RunPlan:
  """The one run of ``ref.group`` that ``ref`` selects for a run with these overrides."""
  if ref.group not in runs_by_group:
    raise ValueError(f"{where}: {key}={ref!r} names no earlier group "
                     f"(earlier groups: {sorted(runs_by_group)})")
  candidates = []
  for run in runs_by_group[ref.group]:
    ok = True
    for same_key in ref.same:
      if same_key == "config":
        ok &= run.config_arg == config_arg
      else:
        if same_key not in overrides:
          raise ValueError(f"{where}: {ref!r} compares {same_key!r}, which this run does not set")
        ok &= run.overrides.get(same_key, _MISSING) == overrides[same_key]
    for match_key, match_value in ref.match.items():
      ok &= run.overrides.get(match_key, _MISSING) == match_value
    if ok:
      candidates.append(run)
  if len(candidates) != 1:
    raise ValueError(f"{where}: {key}={ref!r} must match exactly one run of group "
                     f"{ref.group!r}, matched {len(candidates)}: {[r.name for r in candidates]}")
  return candidates[0]


def validate_run_overrides(config, overrides: Mapping[str, Any], where: str) -> None:
  """One clear error for an override key the run's config would refuse or ignore: unknown
  (with a suggestion), of the old flat attention layout (names the new key), or a field of an
  attention kind other than the run's."""
  config = ml_collections.ConfigDict(config.to_dict())
  if "attention.kind" in overrides and not isinstance(overrides["attention.kind"], Ref):
    config.attention.kind = overrides["attention.kind"]
  config_lib.check_override_keys(config, sorted(overrides), where)
