"""ListOps generator and loader: labels by an independent evaluator, format, files, errors."""
import csv
import logging
import io
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from lra_sparse.data import get_task, listops
from lra_sparse.generators import listops as listops_generator
from lra_sparse.data.registry import check_split_arrays

# The vocabulary as the task contract states it, written out by hand (not imported).
EXPECTED_VOCAB = ["<pad>", "[MIN", "[MAX", "[MED", "[SM", "]", "(", ")",
                  "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
OPS = {"[MIN", "[MAX", "[MED", "[SM"}


def lra_evaluate(source: str) -> tuple[int, int, int, list[int]]:
  """Reads LRA's nested-pair text strictly and evaluates it like LRA's ``to_value``.

  Every "(" must hold exactly two items, then ")". Returns (value, LRA length, operator depth,
  argument counts of all operators). Iterative, independent of the generator's code.
  """
  pending = []        # open pairs: the items read so far
  result = None
  length = 0
  depth = max_depth = 0
  arg_counts = []
  for token in source.split(" "):
    if token == "(":
      pending.append([])
      continue
    if token == ")":
      items = pending.pop()
      assert len(items) == 2, f"a pair holds {len(items)} items"
      left, right = items
      if isinstance(left, str) and left in OPS:           # an operator meets its first argument
        item = ("partial", left, [right])
      elif right == "]":                                  # the operator is complete
        _, op, args = left
        arg_counts.append(len(args))
        depth -= 1
        if op == "[MIN":
          item = min(args)
        elif op == "[MAX":
          item = max(args)
        elif op == "[MED":
          item = int(np.median(args))
        else:
          item = int(np.sum(args)) % 10
      else:                                               # one more argument
        _, op, args = left
        item = ("partial", op, args + [right])
    else:
      assert token in OPS or token == "]" or (len(token) == 1 and token.isdigit()), token
      length += 1
      if token in OPS:
        depth += 1
        max_depth = max(max_depth, depth)
      item = int(token) if token.isdigit() else token
    if pending:
      pending[-1].append(item)
    else:
      assert result is None, "text continues after the root"
      result = item
  assert not pending and isinstance(result, int), "unbalanced text"
  return result, length, max_depth, arg_counts


def test_lra_to_string_format_and_evaluator():
  # LRA to_string of ((([MAX, 2), 9), "]") and of [SM [MIN 4 7] 8 9] written by hand.
  assert lra_evaluate("( ( ( [MAX 2 ) 9 ) ] )") == (9, 4, 1, [2])
  nested = "( ( ( ( [SM ( ( ( [MIN 4 ) 7 ) ] ) ) 8 ) 9 ) ] )"
  assert lra_evaluate(nested) == ((4 + 8 + 9) % 10, 8, 2, [2, 3])
  for broken in ("( ( ( ( ( [SM 4 ) 8 ) 9 ) ] )", "( ( [MAX 2 ) 9 ) ] )", "( ( ( [MAX 2 ) 9 ) ]"):
    with pytest.raises(AssertionError):
      lra_evaluate(broken)
  assert lra_evaluate("( ( ( ( ( [MED 1 ) 2 ) 7 ) 8 ) ] )")[0] == 4     # int(median) = int(4.5)


@pytest.mark.parametrize("min_length,max_length,num", [(20, 90, 600), (500, 2000, 30)])
def test_generator_labels_lengths_structure(min_length, max_length, num):
  examples = listops_generator.generate_listops(num, seed=1, min_length=min_length,
                                                max_length=max_length)
  assert len(examples) == num
  assert len({source for source, _ in examples}) == num
  all_arg_counts = []
  for source, target in examples:
    value, length, op_depth, arg_counts = lra_evaluate(source)
    assert value == target
    assert min_length < length < max_length
    assert len(source.split(" ")) == 3 * length - 2     # k + 1 pairs per k-argument operator
    assert op_depth <= 9           # nodes at depth 10 are always digits
    all_arg_counts += arg_counts
  assert min(all_arg_counts) >= 2 and max(all_arg_counts) <= 10
  if num >= 600:
    assert set(all_arg_counts) == set(range(2, 11))
    ops_seen = {token for source, _ in examples for token in source.split() if token in OPS}
    assert ops_seen == OPS
    assert len({t for _, t in examples}) == 10


def test_generator_options_and_bad_arguments():
  shallow = listops_generator.generate_listops(50, seed=0, min_length=3, max_length=40,
                                               max_depth=3, max_args=4)
  for source, target in shallow:
    value, length, op_depth, arg_counts = lra_evaluate(source)
    assert value == target and op_depth <= 2 and max(arg_counts) <= 4
  with pytest.raises(ValueError, match="min_length"):
    listops_generator.generate_listops(5, min_length=100, max_length=100)
  with pytest.raises(ValueError, match="longest"):
    listops_generator.generate_listops(5, min_length=50, max_length=100, max_depth=2)
  with pytest.raises(ValueError, match="distinct"):
    # Only [OP a b] trees have length 4: 4 * 100 of them.
    listops_generator.generate_listops(401, min_length=3, max_length=5)
  with pytest.raises(ValueError, match="max_args"):
    listops_generator.generate_listops(5, min_length=3, max_length=50, max_args=1)
  with pytest.raises(ValueError, match="max_depth"):
    listops_generator.generate_listops(5, min_length=3, max_length=50, max_depth=1)
  with pytest.raises(ValueError, match="num_val"):
    listops_generator.write_listops_dataset("unused", 5, 0, 5, min_length=3, max_length=50)


def read_files(directory):
  out = {}
  for split in ("train", "val", "test"):
    with open(os.path.join(directory, f"basic_{split}.tsv"), "rb") as f:
      out[split] = f.read()
  return out


def test_write_dataset_deterministic_distinct_official_layout(tmp_path):
  kwargs = dict(num_train=60, num_val=10, num_test=10, min_length=30, max_length=120,
                progress=False)
  listops_generator.write_listops_dataset(str(tmp_path / "a"), seed=7, **kwargs)
  listops_generator.write_listops_dataset(str(tmp_path / "b"), seed=7, **kwargs)
  listops_generator.write_listops_dataset(str(tmp_path / "c"), seed=8, **kwargs)
  a, b, c = (read_files(tmp_path / name) for name in "abc")
  assert a == b
  assert all(a[split] != c[split] for split in a)
  sources = []
  for split, count in (("train", 60), ("val", 10), ("test", 10)):
    lines = a[split].decode().split("\r\n")
    assert lines[0] == "Source\tTarget" and lines[-1] == ""
    rows = [line.split("\t") for line in lines[1:-1]]
    assert len(rows) == count
    official = io.StringIO(newline="")         # what LRA's write_to_file writes for these rows
    writer = csv.writer(official, delimiter="\t")
    writer.writerow(["Source", "Target"])
    writer.writerows([source, int(target)] for source, target in rows)
    assert official.getvalue().encode() == a[split]
    for source, target in rows:
      assert lra_evaluate(source)[0] == int(target)
    sources += [source for source, _ in rows]
  assert len(set(sources)) == len(sources)      # no duplicates within or across splits


def make_config(data_dir, max_length, **data):
  data.setdefault("keep_parentheses", True)     # the official files' tokens, unless a test asks
  config = ml_collections.ConfigDict()
  config.data = ml_collections.ConfigDict(dict(data_dir=str(data_dir), max_length=max_length,
                                               **data))
  return config


def write_tsv(path, text):
  with open(path, "w", newline="") as f:
    f.write(text)


# Official-release style lines (CRLF, header), with their expected ids by hand.
FIXTURE = ("Source\tTarget\r\n"
           "( ( ( [MAX 2 ) 9 ) ] )\t9\r\n"
           "( ( ( ( [MED 1 ) 7 ) 4 ) ] )\t4\r\n"
           "( ( ( ( [SM ( ( ( [MIN 4 ) 7 ) ] ) ) 8 ) 9 ) ] )\t1\r\n")
FIXTURE_IDS = [
    [6, 6, 6, 2, 10, 7, 17, 7, 5, 7],
    [6, 6, 6, 6, 3, 9, 7, 15, 7, 12, 7, 5, 7],
    [6, 6, 6, 6, 4, 6, 6, 6, 1, 12, 7, 15, 7, 5, 7, 7, 16, 7, 17, 7, 5, 7],
]


def test_vocabulary_and_spec():
  assert list(listops.VOCAB) == EXPECTED_VOCAB
  spec = get_task("listops").spec(make_config("unused", 8))
  assert (spec.name, spec.num_classes, spec.vocab_size) == ("listops", 10, 18)


def test_loader_fixture_ids_padding_truncation(tmp_path):
  for split in ("train", "val", "test"):
    write_tsv(tmp_path / f"basic_{split}.tsv", FIXTURE)
  task = get_task("listops")
  config = make_config(tmp_path, 16)
  arrays = task.load_split(config, "val")
  check_split_arrays(arrays, task.spec(config), "val")
  assert arrays["inputs"].dtype == np.uint8 and arrays["targets"].dtype == np.int32
  expected = np.zeros((3, 16), np.int32)
  for row, ids in enumerate(FIXTURE_IDS):
    ids = ids[:16]                             # the third line is cut at max_length
    expected[row, :len(ids)] = ids
  np.testing.assert_array_equal(arrays["inputs"], expected)
  np.testing.assert_array_equal(arrays["targets"], [9, 4, 1])
  inputs, targets, num_cut = listops.read_listops_tsv(str(tmp_path / "basic_test.tsv"), 16,
                                                      keep_parentheses=True)
  assert num_cut == 1
  inputs, _, num_cut = listops.read_listops_tsv(str(tmp_path / "basic_test.tsv"), 22,
                                            keep_parentheses=True)
  assert num_cut == 0 and inputs[2].tolist() == FIXTURE_IDS[2]
  # Without parentheses the row is the LRA token sequence (length = LRA length).
  no_parens = task.load_split(make_config(tmp_path, 10, keep_parentheses=False), "test")
  assert no_parens["inputs"][2].tolist() == [4, 1, 12, 15, 5, 16, 17, 5, 0, 0]


def test_loader_irregular_spacing_and_lf_line_ends(tmp_path):
  lines = FIXTURE.split("\r\n")
  lines[2] = lines[2].replace(" ", "  ").replace("\t4", "\t 4")     # valid, not the fast form
  write_tsv(tmp_path / "basic_train.tsv", "\n".join(lines).rstrip("\n"))   # no final line end
  arrays = get_task("listops").load_split(make_config(tmp_path, 30), "train")
  for row, ids in enumerate(FIXTURE_IDS):
    assert arrays["inputs"][row].tolist() == ids + [0] * (30 - len(ids))
  assert arrays["targets"].tolist() == [9, 4, 1]


def test_loader_reads_generated_files(tmp_path):
  listops_generator.write_listops_dataset(str(tmp_path), 30, 5, 5, seed=3, min_length=20,
                                          max_length=80, progress=False)
  arrays = get_task("listops").load_split(make_config(tmp_path, 400), "train")
  with open(tmp_path / "basic_train.tsv") as f:
    rows = [line.rstrip("\n").split("\t") for line in f][1:]
  for row, (source, target) in enumerate(rows):
    ids = [EXPECTED_VOCAB.index(token) for token in source.split()]
    assert len(ids) <= 400
    assert arrays["inputs"][row].tolist() == ids + [0] * (400 - len(ids))
    assert arrays["targets"][row] == int(target)


@pytest.mark.parametrize("text,line,message", [
    (FIXTURE + "( ( ( [MAX 2 ) 9 ) ] )\t9\textra\r\n", 5, "2 tab-separated columns"),
    ("Source\tTarget\n( ( ( [MAX 2 ) 9 ) ] )\n", 2, "2 tab-separated columns"),
    ("Source\tTarget\n( ( ( [FIRST 2 ) 9 ) ] )\t2\n", 2, "unknown token '\\[FIRST'"),
    ("Source\tTarget\n( ( ( [MAX 2 ) 12 ) ] )\t2\n", 2, "unknown token '12'"),
    (FIXTURE + "( ( ( [MAX 2 ) 9 ) ] )\t10\r\n", 5, "Target 10 outside"),
    (FIXTURE + "( ( ( [MAX 2 ) 9 ) ] )\t-1\r\n", 5, "Target must be an integer"),
    (FIXTURE + "( ( ( [MAX 2 ) 9 ) ] )\tnine\r\n", 5, "Target must be an integer"),
    ("( ( ( [MAX 2 ) 9 ) ] )\t9\n", 1, "header"),
    ("Source\tLabel\n( ( ( [MAX 2 ) 9 ) ] )\t9\n", 1, "header"),
    ("Source\tTarget\n \t3\n", 2, "empty Source"),
    # Spellings the one-byte fast path must not accept.
    (FIXTURE + "( ( ( MIN 2 ) 9 ) ] )\t2\r\n", 5, "unknown token 'MIN'"),
    (FIXTURE + "( ( ( [MINX 2 ) 9 ) ] )\t2\r\n", 5, "unknown token '\\[MINX'"),
    (FIXTURE + "( ( ( [NIM 2 ) 9 ) ] )\t2\r\n", 5, "unknown token '\\[NIM'"),
    (FIXTURE + "( ( ( [SMD 2 ) 9 ) ] )\t2\r\n", 5, "unknown token '\\[SMD'"),
    (FIXTURE + "( ( ( [MAX 2M ) 9 ) ] )\t2\r\n", 5, "unknown token '2M'"),
    (FIXTURE + "( ( ( [MAX 2 )\r9 ) ] )\t9\r\n", 5, "stray carriage return"),
    # A blank line between rows is an error (blank lines at the end of the file are not rows).
    (FIXTURE + "\r\n( ( ( [MAX 2 ) 9 ) ] )\t9\r\n", 5, "2 tab-separated columns"),
    (FIXTURE + "( ( ( [MAX 2 ) 9 ) ] )[\t9", 5, "unknown token '\\)\\['"),   # file end
    (FIXTURE + "( ( ( [MAX 2 ) 9[ ) ] )\t9\n", 5, "unknown token '9\\['"),
    (FIXTURE.encode().replace(b"[MED 1", b"[MED \xff").decode("latin-1"), 3, "not UTF-8|unknown"),
])
def test_loader_malformed_line_names_file_and_line(tmp_path, text, line, message):
  write_tsv(tmp_path / "basic_train.tsv", text)
  with pytest.raises(ValueError, match=f"basic_train.tsv:{line}: .*{message}"):
    get_task("listops").load_split(make_config(tmp_path, 32), "train")


def test_loader_missing_files_and_bad_arguments(tmp_path):
  task = get_task("listops")
  missing = tmp_path / "nowhere"
  with pytest.raises(FileNotFoundError, match="nowhere"):
    task.load_split(make_config(missing, 32), "train")
  write_tsv(tmp_path / "basic_train.tsv", FIXTURE)
  with pytest.raises(FileNotFoundError, match="basic_val.tsv"):
    task.load_split(make_config(tmp_path, 32), "val")
  with pytest.raises(ValueError, match="split"):
    task.load_split(make_config(tmp_path, 32), "dev")
  with pytest.raises(ValueError, match="max_length"):
    task.load_split(make_config(tmp_path, 0), "train")


def test_cli_writes_the_official_files(tmp_path):
  out = tmp_path / "cli"
  command = [sys.executable, "-m", "lra_sparse.generators.listops", f"--output_dir={out}",
             "--num_train=20", "--num_val=4", "--num_test=4", "--seed=5", "--min_length=10",
             "--max_length=60"]
  result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode == 0, result.stderr[-2000:]
  assert "majority class" in result.stdout and "examples/s" in result.stdout
  listops_generator.write_listops_dataset(str(tmp_path / "api"), 20, 4, 4, seed=5,
                                          min_length=10, max_length=60, progress=False)
  assert read_files(out) == read_files(tmp_path / "api")


def test_truncation_is_a_warning_and_trailing_blank_lines_are_not_rows(tmp_path, caplog):
  for split in ("train", "val", "test"):
    write_tsv(tmp_path / f"basic_{split}.tsv", FIXTURE)
  path = tmp_path / "basic_val.tsv"
  path.write_bytes(path.read_bytes() + b"\r\n\r\n\n")     # blank lines after the last row
  task = get_task("listops")
  with caplog.at_level(logging.INFO):
    arrays = task.load_split(make_config(tmp_path, 16), "val")
  np.testing.assert_array_equal(arrays["targets"], [9, 4, 1])
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "1 of them (33.3%) longer than max_length=16 tokens were " \
                                 "truncated" in warnings[0]
  caplog.clear()
  with caplog.at_level(logging.INFO):
    task.load_split(make_config(tmp_path, 64), "val")
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_loader_default_drops_parentheses_like_the_config(tmp_path):
  """One default: a config without data.keep_parentheses reads like configs/listops.py."""
  for split in ("train", "val", "test"):
    write_tsv(tmp_path / f"basic_{split}.tsv", FIXTURE)
  config = ml_collections.ConfigDict({"data": {"data_dir": str(tmp_path), "max_length": 32}})
  default = get_task("listops").load_split(config, "test")
  explicit = get_task("listops").load_split(make_config(tmp_path, 32, keep_parentheses=False),
                                            "test")
  np.testing.assert_array_equal(default["inputs"], explicit["inputs"])
  assert listops.TOKEN_TO_ID["("] not in default["inputs"]
  from lra_sparse.config import load_config_file  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  assert load_config_file(os.path.join(repo, "configs", "listops.py")).data.keep_parentheses \
      is False
