"""LRA ListOps: a generator faithful to the LRA one, writing the official TSV files.

Data (google-research/long-range-arena, lra_benchmarks/data/listops.py): a random expression
tree over MIN, MAX, MED (integer median, ``int(np.median)``) and SM (sum mod 10) whose leaves
are digits 0..9; the label is the value of the tree (10 classes). A node at depth < max_depth
(root depth 1) is an operator with probability 0.25 and otherwise a digit; an operator takes
2..max_args arguments. The LRA "length" counts operators, ``]`` and digits (not the parentheses)
and a tree is kept when ``min_length < length < max_length``. Sequences are written as LRA's
``to_string`` writes the nested pairs ``((((op, a0), a1), ...), "]")``::

    [MAX 2 9]  ->  ( ( ( [MAX 2 ) 9 ) ] )

Files: ``basic_{train,val,test}.tsv`` with the header ``Source<TAB>Target``, tab-delimited,
``\\r\\n`` line ends: what LRA's ``csv.writer(delimiter="\\t")`` writes. The task ``listops``
reads them (``lra_sparse.data.listops``, which also holds the vocabulary used here).

Generator CLI (absl flags)::

    python -m lra_sparse.generators.listops --output_dir=data/listops \\
        --num_train=96000 --num_val=2000 --num_test=2000 --seed=0 \\
        --min_length=500 --max_length=2000 [--max_depth=10] [--max_args=10]

  --output_dir   directory for basic_{train,val,test}.tsv (created if missing; required)
  --num_train    number of training examples (LRA: 96000)
  --num_val      number of validation examples (LRA: 2000)
  --num_test     number of test examples (LRA: 2000)
  --seed         seed of the numpy Generator; same seed -> byte-identical files
  --min_length   keep trees with LRA length > min_length (LRA: 500)
  --max_length   keep trees with LRA length < max_length (LRA: 2000)
  --max_depth    nodes at this depth are always digits (LRA: 10; the root has depth 1)
  --max_args     maximum number of arguments of an operator (LRA: 10)

CPU demo set: ``--output_dir=data/listops_tiny --num_train=4000 --num_val=500 --num_test=500
--min_length=15 --max_length=35`` (texts of at most 100 tokens, see the loader).

Sampling: the shapes of 2048 candidate trees are drawn level by level with numpy (one draw per
depth for all of them) and a tree is dropped as soon as its length reaches max_length, so
rejected trees (most of them) cost microseconds; the kept trees are labelled, evaluated and
written out vectorized over depths (no recursion). The node distribution is exactly LRA's
(independent nodes); the random stream is our own (LRA used unseeded ``random``).
"""
from __future__ import annotations

import os
import time
from typing import Sequence

from absl import app
from absl import flags
import numpy as np
import tqdm

from lra_sparse import cli
from lra_sparse.data.listops import CLOSE, DIGITS, END, HEADER, NUM_CLASSES, OPEN, OPERATORS

# LRA defaults.
OPERATOR_PROB = 0.25    # LRA's VALUE_P: a node above max_depth is an operator with this prob.
MAX_DEPTH = 10
MAX_ARGS = 10

# One byte per token while building text: operators become control characters (replaced by
# their names at the end), everything else is its own character.
_OP_CODES = tuple(chr(1 + i) for i in range(len(OPERATORS)))
_OP_BYTES = np.array([ord(c) for c in _OP_CODES], np.uint8)
_DIGIT_BYTES = np.array([ord(d) for d in DIGITS], np.uint8)


# ---------------------------------------------------------------------------------------------
# Generator.

_BATCH = 2048   # candidate trees sampled together (fixed: part of what a seed means)


def _sample_shapes(rng: np.random.Generator, batch: int, max_depth: int, max_args: int,
                   min_length: int, max_length: int) -> list[np.ndarray]:
  """Samples ``batch`` tree shapes level by level; keeps those with an LRA length inside.

  Returns the argument counts (0 = digit) of the kept trees' nodes per depth, in tree order;
  the children of the operators at depth d are the nodes at depth d+1, in order. Nodes of all
  trees of a depth are drawn in one call; a tree stops growing once its length reaches
  max_length (it is dropped).
  """
  length = np.zeros(batch, np.int64)
  tree = np.arange(batch)                       # tree id of every node at the current depth
  levels = []                                   # (tree ids, argument counts) per depth
  for depth in range(1, max_depth + 1):
    width = len(tree)
    if depth < max_depth:
      is_op = rng.random(width) <= OPERATOR_PROB   # LRA: r > VALUE_P -> digit
      num_args = np.where(is_op, rng.integers(2, max_args + 1, width), 0)
    else:
      is_op = np.zeros(width, bool)
      num_args = np.zeros(width, np.int64)
    # An operator counts 2 (itself and "]"), a digit 1.
    length += np.bincount(tree, weights=1 + is_op, minlength=batch).astype(np.int64)
    levels.append((tree, num_args))
    child_tree = np.repeat(tree, num_args)
    tree = child_tree[length[child_tree] < max_length]
    if len(tree) == 0:
      break
  kept = (length > min_length) & (length < max_length)
  shapes = [num_args[kept[tree_ids]] for tree_ids, num_args in levels]
  return [a for a in shapes if len(a)]


def _segment_starts(counts: np.ndarray) -> np.ndarray:
  return np.cumsum(counts) - counts


def _render(rng: np.random.Generator, shapes: list[np.ndarray]) -> tuple[list[str], np.ndarray]:
  """Draws operators/digits for the trees of ``shapes``; returns their LRA texts and values.

  Vectorized over all trees and nodes of a depth: values and token counts bottom-up, token
  positions top-down, then one byte buffer holds every tree's tokens (no recursion).
  """
  num_levels = len(shapes)
  labels = [np.where(a > 0, rng.integers(0, len(OPERATORS), len(a)), rng.integers(0, 10, len(a)))
            for a in shapes]
  # Bottom-up: value and token count of every node.
  values: list[np.ndarray] = [None] * num_levels
  sizes: list[np.ndarray] = [None] * num_levels
  for d in reversed(range(num_levels)):
    num_args, label = shapes[d], labels[d]
    is_op = num_args > 0
    values[d] = label.copy()
    sizes[d] = np.ones(len(num_args), np.int64)
    if not is_op.any():
      continue
    k = num_args[is_op]
    starts = _segment_starts(k)
    child_values, child_sizes = values[d + 1], sizes[d + 1]
    order = np.lexsort((child_values, np.repeat(np.arange(len(k)), k)))
    sorted_values = child_values[order]
    median = (sorted_values[starts + (k - 1) // 2] + sorted_values[starts + k // 2]) // 2
    candidates = np.stack([np.minimum.reduceat(child_values, starts),   # in OPERATORS order
                           np.maximum.reduceat(child_values, starts),
                           median,                               # = int(np.median(...))
                           np.add.reduceat(child_values, starts) % 10])
    values[d][is_op] = np.take_along_axis(candidates, label[is_op][None], 0)[0]
    # "(" x (k+1), operator, arguments each followed by ")", then "]" and ")".
    sizes[d][is_op] = 2 * k + 4 + np.add.reduceat(child_sizes, starts)
  # Top-down: position of every node's first token in one buffer holding all trees.
  tree_sizes = sizes[0]
  positions = _segment_starts(tree_sizes)
  buffer = np.zeros(int(tree_sizes.sum()), np.uint8)
  for d in range(num_levels):
    num_args, label, size = shapes[d], labels[d], sizes[d]
    is_op = num_args > 0
    buffer[positions[~is_op]] = _DIGIT_BYTES[label[~is_op]]
    if not is_op.any():
      break
    k, p, op_size = num_args[is_op], positions[is_op], size[is_op]
    open_counts = k + 1
    buffer[np.repeat(p - _segment_starts(open_counts), open_counts)
           + np.arange(int(open_counts.sum()))] = ord(OPEN)
    buffer[p + k + 1] = _OP_BYTES[label[is_op]]
    buffer[p + op_size - 2] = ord(END)
    buffer[p + op_size - 1] = ord(CLOSE)
    child_size = sizes[d + 1]
    step = child_size + 1                       # a child and the ")" after it
    before = np.cumsum(step) - step             # exclusive cumsum over the whole depth
    starts = _segment_starts(k)
    child_positions = (np.repeat(p + k + 2 - before[starts], k) + before)
    buffer[child_positions + child_size] = ord(CLOSE)
    positions = child_positions
  # Tokens are single bytes here: interleave spaces, then name the operators.
  spaced = np.full(2 * len(buffer), ord(" "), np.uint8)
  spaced[0::2] = buffer
  texts = []
  for start, size in zip(_segment_starts(tree_sizes).tolist(), tree_sizes.tolist()):
    text = spaced[2 * start:2 * (start + size) - 1].tobytes().decode("ascii")
    for op, code in zip(OPERATORS, _OP_CODES):
      text = text.replace(code, op)
    texts.append(text)
  return texts, values[0]


def _check_generator_args(num: int, min_length: int, max_length: int, max_depth: int,
                          max_args: int) -> None:
  if num < 0:
    raise ValueError(f"number of examples must be >= 0, got {num}")
  if max_depth < 2:
    raise ValueError(f"max_depth must be >= 2 (the root must be able to be an operator), "
                     f"got {max_depth}")
  if max_args < 2:
    raise ValueError(f"max_args must be >= 2, got {max_args}")
  if min_length < 0:
    raise ValueError(f"min_length must be >= 0, got {min_length}")
  # The shortest operator tree has length 4 ([OP a b]); some integer must lie strictly between.
  if max(min_length + 1, 4) >= max_length:
    raise ValueError(f"no tree has min_length={min_length} < length < max_length={max_length} "
                     f"(the shortest tree with an operator has length 4)")
  # The longest tree: operators with max_args arguments down to max_depth - 1, digits below.
  longest = 2 * sum(max_args**i for i in range(max_depth - 1)) + max_args**(max_depth - 1)
  if min_length + 1 > longest:
    raise ValueError(f"no tree of max_depth={max_depth}, max_args={max_args} is longer than "
                     f"min_length={min_length} (the longest has length {longest})")


def generate_listops(num: int, seed: int = 0, min_length: int = 500, max_length: int = 2000,
                     *, max_depth: int = MAX_DEPTH, max_args: int = MAX_ARGS,
                     progress: bool = False) -> list[tuple[str, int]]:
  """``num`` distinct (source, target) pairs with ``min_length < LRA length < max_length``.

  Deterministic in ``seed``; the order is the order of generation.
  """
  _check_generator_args(num, min_length, max_length, max_depth, max_args)
  rng = np.random.default_rng(seed)
  examples: list[tuple[str, int]] = []
  seen: set[str] = set()
  duplicates_in_a_row = 0         # guards against asking for more trees than exist
  batches_without_new = 0         # guards against a length range (almost) never hit
  num_candidates = 0
  start = time.perf_counter()
  with tqdm.tqdm(total=num, disable=not progress, unit="ex", desc="listops",
                 mininterval=2.0) as bar:
    while len(examples) < num:
      num_candidates += _BATCH
      batches_without_new += 1
      if batches_without_new > 2000:
        raise ValueError(f"no new tree with {min_length} < length < {max_length} in "
                         f"{2000 * _BATCH} candidates; widen the length range")
      shapes = _sample_shapes(rng, _BATCH, max_depth, max_args, min_length, max_length)
      if not shapes:
        continue
      sources, targets = _render(rng, shapes)
      for source, target in zip(sources, targets.tolist()):
        if source in seen:
          duplicates_in_a_row += 1
          if duplicates_in_a_row >= 10_000:
            raise ValueError(f"only {len(examples)} distinct trees found with {min_length} < "
                             f"length < {max_length}; ask for fewer or widen the length range")
          continue
        duplicates_in_a_row = batches_without_new = 0
        seen.add(source)
        examples.append((source, target))
        bar.update(1)
        if len(examples) == num:
          break
  elapsed = time.perf_counter() - start
  if progress:
    print(f"generated {num} examples from {num_candidates} candidate trees in {elapsed:.1f} s: "
          f"{num / max(elapsed, 1e-9):.0f} examples/s, "
          f"{num_candidates / max(elapsed, 1e-9):.0f} candidates/s, "
          f"acceptance {num / max(num_candidates, 1):.2%}")
  return examples


def label_distribution(targets: Sequence[int]) -> str:
  """One line: the count of every class and the majority-class share."""
  counts = np.bincount(np.asarray(targets, np.int64), minlength=NUM_CLASSES)
  total = max(int(counts.sum()), 1)
  per_class = " ".join(f"{c}:{n}" for c, n in enumerate(counts.tolist()))
  return (f"{per_class} | majority class {int(counts.argmax())} "
          f"{counts.max() / total:.1%} of {int(counts.sum())}")


def _write_tsv(path: str, rows: Sequence[tuple[str, int]]) -> None:
  # Byte-identical to LRA's csv.writer(delimiter="\t") ("\r\n" line ends; our texts never
  # need quoting) and ~25x faster.
  with open(path, "w", newline="", encoding="ascii") as f:
    f.write("\t".join(HEADER) + "\r\n")
    f.writelines(f"{source}\t{target}\r\n" for source, target in rows)


def write_listops_dataset(output_dir: str, num_train: int = 96000, num_val: int = 2000,
                          num_test: int = 2000, seed: int = 0, min_length: int = 500,
                          max_length: int = 2000, *, max_depth: int = MAX_DEPTH,
                          max_args: int = MAX_ARGS, progress: bool = True) -> dict[str, str]:
  """Generates and writes ``basic_{train,val,test}.tsv``; returns split -> path."""
  for name, n in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
    if n < 1:
      raise ValueError(f"{name} must be >= 1, got {n}")
  examples = generate_listops(num_train + num_val + num_test, seed, min_length, max_length,
                              max_depth=max_depth, max_args=max_args, progress=progress)
  os.makedirs(output_dir, exist_ok=True)
  bounds = {"train": (0, num_train), "val": (num_train, num_train + num_val),
            "test": (num_train + num_val, num_train + num_val + num_test)}
  paths = {}
  for split, (lo, hi) in bounds.items():
    rows = examples[lo:hi]
    paths[split] = os.path.join(output_dir, f"basic_{split}.tsv")
    _write_tsv(paths[split], rows)
    if progress:
      labels = label_distribution([target for _, target in rows])
      print(f"{paths[split]}: {len(rows)} examples; labels {labels}")
  return paths


# ---------------------------------------------------------------------------------------------
# CLI.

def _define_flags() -> None:
  flags.DEFINE_string("output_dir", None, "Directory for basic_{train,val,test}.tsv.")
  flags.DEFINE_integer("num_train", 96000, "Number of training examples.")
  flags.DEFINE_integer("num_val", 2000, "Number of validation examples.")
  flags.DEFINE_integer("num_test", 2000, "Number of test examples.")
  flags.DEFINE_integer("seed", 0, "Seed of the numpy Generator.")
  flags.DEFINE_integer("min_length", 500, "Keep trees with LRA length > min_length.")
  flags.DEFINE_integer("max_length", 2000, "Keep trees with LRA length < max_length.")
  flags.DEFINE_integer("max_depth", MAX_DEPTH, "Nodes at this depth are digits (root depth 1).")
  flags.DEFINE_integer("max_args", MAX_ARGS, "Maximum number of arguments of an operator.")
  flags.mark_flag_as_required("output_dir")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  write_listops_dataset(f.output_dir, f.num_train, f.num_val, f.num_test, f.seed,
                        f.min_length, f.max_length, max_depth=f.max_depth,
                        max_args=f.max_args, progress=True)


# Flags are defined only when this file is the program: tests import several generators (and
# the trainer) into one process, and their flag names (--output_dir, --seed, ...) overlap.
if __name__ == "__main__":
  _define_flags()
  cli.run(main)
