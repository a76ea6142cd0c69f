"""LRA ListOps: the loader of the official TSV files (google-research/long-range-arena).

Data (``lra_benchmarks/data/listops.py``): a random expression tree over MIN, MAX, MED (integer
median, ``int(np.median)``) and SM (sum mod 10) whose leaves are digits 0..9; the label is the
value of the tree (10 classes). The LRA "length" counts operators, ``]`` and digits (not the
parentheses). Sequences are written as LRA's ``to_string`` writes the nested pairs
``((((op, a0), a1), ...), "]")``::

    [MAX 2 9]  ->  ( ( ( [MAX 2 ) 9 ) ] )

Files: ``basic_{train,val,test}.tsv`` with the header ``Source<TAB>Target``, tab-delimited,
``\\r\\n`` line ends: what LRA's ``csv.writer(delimiter="\\t")`` writes. The LRA-faithful
generator of these files is ``lra_sparse.generators.listops``
(``python -m lra_sparse.generators.listops --output_dir=data/listops``).

Loader: task ``listops`` (``lra_sparse.data.get_task("listops")``) with a fixed vocabulary
(``VOCAB``: 0 = padding, then ``[MIN [MAX [MED [SM ] ( )`` and the digits). Rows longer than
``config.data.max_length`` tokens are cut at max_length like LRA's ``[:max_length]``.
With the parentheses a text has exactly ``3 * LRA length - 2`` tokens, so max_length=2000 cuts
every tree longer than 667 (about 80% of the LRA set). The optional
``config.data.keep_parentheses`` keeps ``(`` and ``)`` when True; False (the default here and
in ``configs/listops.py``) drops them: the token count
is then the LRA length (< 2000, nothing is cut), as in S4 and later work. (LRA's own pipeline,
``tfds`` ``Tokenizer()`` with ``alphanum_only=True``, dropped ``(``, ``)``, ``[`` and ``]``.)
A demo set for max_length=100 with parentheses: the generator's ``--min_length=15
--max_length=35``.
"""
from __future__ import annotations

import os
import time
from typing import Any

from absl import logging
import numpy as np

from lra_sparse.data.common import check_split_name, token_dtype
from lra_sparse.data.registry import PAD_ID, TaskSpec, register_task

# ---------------------------------------------------------------------------------------------
# Vocabulary (the tokens lra_sparse.generators.listops writes).

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
OPEN = "("
CLOSE = ")"
DIGITS = tuple(str(d) for d in range(10))
VOCAB = ("<pad>",) + OPERATORS + (END, OPEN, CLOSE) + DIGITS
TOKEN_TO_ID = {token: i for i, token in enumerate(VOCAB) if i != PAD_ID}
VOCAB_SIZE = len(VOCAB)
NUM_CLASSES = 10
HEADER = ("Source", "Target")


# ---------------------------------------------------------------------------------------------
# Loader.

# Fast path, for the regular form of the official files ("t t ... t<TAB>d", single spaces,
# one-digit target): one bytes.translate pass over the whole file deletes "[", "\r" and the op
# letters M N X D, so every token becomes ONE byte holding its id ([MIN -> I, [MAX -> A,
# [MED -> E, [SM -> S), spaces/tabs/newlines become markers and anything else an invalid marker.
# The deleted bytes are verified on the original bytes (every "[" must start a known operator
# followed by a space or tab, no op letter may appear outside one, "\r" only before "\n").
# Lines that are not regular go through the per-line path, which accepts irregular spacing and
# raises the error for a bad line.
_SEPARATOR, _TAB_MARK, _LINE_MARK, _INVALID = 0xFF, 0xFD, 0xFC, 0xFE
_TRANSLATION = bytearray([_INVALID] * 256)
for _token in (END, OPEN, CLOSE) + DIGITS:
  _TRANSLATION[ord(_token)] = TOKEN_TO_ID[_token]
for _op, _kept_letter in zip(OPERATORS, "IAES"):
  _TRANSLATION[ord(_kept_letter)] = TOKEN_TO_ID[_op]
_TRANSLATION[ord(" ")] = _SEPARATOR
_TRANSLATION[ord("\t")] = _TAB_MARK
_TRANSLATION[ord("\n")] = _LINE_MARK
_TRANSLATION = bytes(_TRANSLATION)
_DELETED = b"[MNXD\r"
_PAREN_IDS = np.array([TOKEN_TO_ID[OPEN], TOKEN_TO_ID[CLOSE]], np.int32)


def _operator_check(data: bytes, raw: np.ndarray) -> tuple[np.ndarray, bool]:
  """Positions of "[" that do not start a known operator token followed by a space or tab, and
  whether every op letter of the file belongs to such a token."""
  at = np.flatnonzero(raw == ord("["))
  near_end = at[at + 4 >= len(raw)]      # too close to the end of the file to be good
  at = at[at + 4 < len(raw)]
  byte = [raw[at + k] for k in range(5)]
  is_separator = [(b == ord(" ")) | (b == ord("\t")) for b in byte]
  is_op = {}
  for op in OPERATORS:
    letters = op[1:]
    match = is_separator[len(op)]
    for k, letter in enumerate(letters, start=1):
      match = match & (byte[k] == ord(letter))
    is_op[op] = match
  good = is_op["[MIN"] | is_op["[MAX"] | is_op["[MED"] | is_op["[SM"]
  count = {op: int(np.count_nonzero(m)) for op, m in is_op.items()}
  # Each good operator has one M; N, X, D belong to MIN, MAX, MED only.
  letters_ok = (data.count(b"M") == sum(count.values()) and data.count(b"N") == count["[MIN"]
                and data.count(b"X") == count["[MAX"] and data.count(b"D") == count["[MED"])
  return np.concatenate([at[~good], near_end]), letters_ok


def _parse_line(line: str, path: str, line_number: int) -> tuple[np.ndarray, int]:
  """Per-line parse with one clear error for a bad line."""
  fields = line.split("\t")
  if len(fields) != 2:
    raise ValueError(f"{path}:{line_number}: expected 2 tab-separated columns (Source, Target), "
                     f"got {len(fields)}")
  source, target_text = fields
  if "\r" in source:
    raise ValueError(f"{path}:{line_number}: stray carriage return in Source")
  tokens = source.split()
  if not tokens:
    raise ValueError(f"{path}:{line_number}: empty Source")
  for token in tokens:
    if token not in TOKEN_TO_ID:
      raise ValueError(f"{path}:{line_number}: unknown token {token!r} in Source "
                       f"(known: {' '.join(VOCAB[1:])})")
  stripped = target_text.strip()
  if not (stripped.isascii() and stripped.isdigit()):
    raise ValueError(f"{path}:{line_number}: Target must be an integer in [0, {NUM_CLASSES}), "
                     f"got {target_text!r}")
  target = int(stripped)
  if target >= NUM_CLASSES:
    raise ValueError(f"{path}:{line_number}: Target {target} outside [0, {NUM_CLASSES})")
  return np.array([TOKEN_TO_ID[t] for t in tokens], np.int32), target


def _line_ends(array: np.ndarray, mark: int) -> np.ndarray:
  """Positions of the line marks, plus the end when the last line has none."""
  ends = np.flatnonzero(array == mark)
  if len(array) and array[-1] != mark:
    ends = np.append(ends, len(array))
  return ends


def read_listops_tsv(path: str, max_length: int, *, keep_parentheses: bool
                     ) -> tuple[np.ndarray, np.ndarray, int]:
  """Parses one official-format file: (inputs uint8 [N, max_length], targets int32 [N], cut).

  ``cut`` is the number of rows longer than max_length tokens (truncated to max_length).
  Accepts "\r\n" (official files) and "\n" line ends.
  """
  if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) \
      or max_length < 1:
    raise ValueError(f"config.data.max_length must be a positive integer, got {max_length!r}")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"ListOps file not found: {path}")
  with open(path, "rb") as f:
    data = f.read()
  # Blank lines at the end of the file are not rows (as in the retrieval loader).
  body = data.rstrip(b"\r\n")
  if len(body) < len(data):
    data = body + (b"\r\n" if data[len(body):].startswith(b"\r\n") else b"\n")
  header = data.split(b"\n", 1)[0].removesuffix(b"\r")
  if header != "\t".join(HEADER).encode():
    raise ValueError(f"{path}:1: expected the header 'Source<TAB>Target', got {header[:80]!r}")
  # Translated text: one byte per token, the same lines ("\n" is kept). Line 0 is the header.
  text = np.frombuffer(data.translate(_TRANSLATION, _DELETED), np.uint8)
  line_ends = _line_ends(text, _LINE_MARK)
  num_rows = len(line_ends) - 1
  if num_rows == 0:
    raise ValueError(f"{path}: no examples after the header")
  line_starts = line_ends[:-1] + 1
  line_ends = line_ends[1:]
  source_ends = line_ends - 2
  source_lengths = source_ends - line_starts
  target_ids = text[line_ends - 1].astype(np.int32)
  # Regular lines: "<source of odd length> <TAB> <digit>".
  regular = ((source_lengths >= 1) & (source_lengths % 2 == 1)
             & (text[np.maximum(source_ends, 0)] == _TAB_MARK)
             & (target_ids >= TOKEN_TO_ID["0"]) & (target_ids <= TOKEN_TO_ID["9"]))
  # The deleted bytes must have been where the regular form allows them. The original line
  # positions are found only when some line needs the per-line path.
  raw = np.frombuffer(data, np.uint8)
  raw_line_ends = None
  bad_operators, letters_ok = _operator_check(data, raw)
  # The letters I A E S became operator ids: as many as good operators (one M each).
  num_op_ids = np.count_nonzero(text[line_starts[0]:] <= len(OPERATORS))
  if not letters_ok or num_op_ids != data.count(b"M") \
      or data.count(b"\r") != data.count(b"\r\n"):
    regular[:] = False            # a stray letter or "\r" somewhere: read every line slowly
  elif len(bad_operators):
    raw_line_ends = _line_ends(raw, ord("\n"))
    regular[np.searchsorted(raw_line_ends, bad_operators) - 1] = False
  inputs = np.zeros((num_rows, max_length), token_dtype(VOCAB_SIZE))     # PAD_ID == 0
  targets = np.where(regular, target_ids - TOKEN_TO_ID["0"], 0).astype(np.int32)
  num_cut = 0
  for row in np.flatnonzero(regular).tolist():
    source = text[line_starts[row]:source_ends[row]]
    ids = source[0::2]
    if (source[1::2] == _SEPARATOR).all() and ids.max() < VOCAB_SIZE:
      if not keep_parentheses:
        ids = ids[(ids != _PAREN_IDS[0]) & (ids != _PAREN_IDS[1])]
      num_cut += len(ids) > max_length
      inputs[row, :min(len(ids), max_length)] = ids[:max_length]
    else:
      regular[row] = False
  irregular = np.flatnonzero(~regular).tolist()
  if irregular and raw_line_ends is None:
    raw_line_ends = _line_ends(raw, ord("\n"))
  for row in irregular:
    line_number = row + 2
    try:
      line = data[raw_line_ends[row] + 1:raw_line_ends[row + 1]].decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}:{line_number}: not UTF-8 text ({e})") from None
    ids, targets[row] = _parse_line(line.removesuffix("\r"), path, line_number)
    if not keep_parentheses:
      ids = ids[~np.isin(ids, _PAREN_IDS)]
    num_cut += len(ids) > max_length
    inputs[row, :min(len(ids), max_length)] = ids[:max_length]
  return inputs, targets, num_cut


@register_task("listops")
class ListOpsTask:
  """Official ``basic_{train,val,test}.tsv`` files under ``config.data.data_dir``."""

  def spec(self, config: Any) -> TaskSpec:
    del config
    return TaskSpec(name="listops", num_classes=NUM_CLASSES, vocab_size=VOCAB_SIZE)

  def load_split(self, config: Any, split: str) -> dict[str, np.ndarray]:
    check_split_name(split)
    data_dir = config.data.data_dir
    if not data_dir or not os.path.isdir(data_dir):
      raise FileNotFoundError(
          f"ListOps data directory not found: {data_dir!r} (config.data.data_dir); generate it "
          f"with: python -m lra_sparse.generators.listops --output_dir={data_dir or 'DIR'}")
    # One default, the config's: LRA's tokenizer dropped the parentheses.
    keep_parentheses = bool(config.data.get("keep_parentheses", False))
    path = os.path.join(data_dir, f"basic_{split}.tsv")
    start = time.perf_counter()
    inputs, targets, num_cut = read_listops_tsv(path, config.data.max_length,
                                                keep_parentheses=keep_parentheses)
    # Truncation changes the task (the answer depends on the whole expression): loud.
    log = logging.warning if num_cut else logging.info
    log("listops %s: %d examples from %s in %.1f s; %d of them (%.1f%%) longer than "
        "max_length=%d tokens were truncated", split, len(targets), path,
        time.perf_counter() - start, num_cut, 100.0 * num_cut / len(targets),
        config.data.max_length)
    return {"inputs": inputs, "targets": targets}
