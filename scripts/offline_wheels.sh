#!/usr/bin/env bash
# Builds a wheelhouse for a GPU host without internet (a lent device, a cluster node) whose
# Python 3.12 image already holds jax with CUDA, jaxlib, flax, optax, orbax-checkpoint, triton,
# absl-py, numpy, tqdm and pytest: everything else the trainer, the sweeps and the tests import,
# at requirements-gpu.txt's pins, with the small dependencies those bring (all as x86-64
# manylinux / pure-Python wheels for CPython 3.12). Run it on a machine that reaches PyPI.
#   bash scripts/offline_wheels.sh [DEST=.whl]
# Install on the host, first thing in each command (the image's packages stay as they are):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site DEST/*.whl && export PYTHONPATH=/tmp/site:$PWD
# A call whose trainer dies on "No module named ..." lost its device time to a missing wheel:
# the module belongs in PINNED or DEPS below.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
# The packages of requirements-gpu.txt the image lacks, at its pins.
PINNED=(jax-triton ml-collections tensorflow-datasets grain array-record tensorboardX submitit)
# Their dependencies that the image lacks (unpinned upstream; the newest wheel for 3.12).
DEPS=(dm-tree immutabledict promise simple-parsing docstring-parser tensorflow-metadata
      termcolor toml portpicker googleapis-common-protos cloudpickle)
pkgs=()
for name in "${PINNED[@]}"; do
  pin=$(grep -i -E "^${name}==" requirements-gpu.txt || true)
  [ -n "$pin" ] || { echo "requirements-gpu.txt pins no $name" >&2; exit 1; }
  pkgs+=("$pin")
done
pkgs+=("${DEPS[@]}")
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
failed=()
for p in "${pkgs[@]}"; do
  # A binary wheel for the host's platform first; a pure-Python sdist (promise) is built here.
  python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dest" "$p" \
      2>/dev/null || python3 -m pip wheel -q --no-deps -w "$dest" "$p" 2>/dev/null \
      || failed+=("$p")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "could not fetch: ${failed[*]}" >&2
  exit 1
fi
du -sh "$dest"
