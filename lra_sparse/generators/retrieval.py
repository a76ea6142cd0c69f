"""Small learnable AAN-format files for the tiny "retrieval" preset (not real AAN text).

Every document draws words from one of a few topic vocabularies; a pair is labelled 1 when both
documents share a topic, so a tiny dual encoder learns it from bytes. The files are what the
"retrieval" task reads (``lra_sparse.data.retrieval``): ``<output_dir>/new_aan_pairs.{train,eval,
test}.tsv``, one ``label<TAB>id1<TAB>id2<TAB>text1<TAB>text2`` line per pair, no header.

CLI (absl flags)::

  python -m lra_sparse.generators.retrieval --output_dir=data/retrieval_tiny \\
      [--num_train=4000] [--num_eval=500] [--num_test=500] [--seed=0]

The same seed gives byte-identical files.
"""
from __future__ import annotations

import os
from typing import Sequence

from absl import app
from absl import flags
import numpy as np

from lra_sparse import cli
from lra_sparse.data.retrieval import FILE_PREFIX


def write_tiny_aan(data_dir: str, *, num_train: int = 4000, num_eval: int = 500,
                   num_test: int = 500, seed: int = 0) -> None:
  """Writes small learnable AAN-format files for the "tiny" preset (not real AAN text).

  Each document draws words from one of a few topic vocabularies; a pair is labelled 1 when both
  documents share a topic, so a tiny dual encoder can learn it from bytes.
  """
  rng = np.random.default_rng(seed)
  topics = [["graph", "node", "edge", "path", "tree"], ["parse", "syntax", "grammar", "verb"],
            ["speech", "audio", "phone", "acoustic"], ["translate", "bilingual", "align", "corpus"]]
  common = ["we", "the", "a", "model", "method", "results", "of", "in", "paper", "show"]
  os.makedirs(data_dir, exist_ok=True)

  def document(topic: int) -> str:
    # Under ~200 bytes: the tiny preset's 256 tokens per document never cut a topic word.
    words = list(rng.choice(common, size=int(rng.integers(10, 25))))
    for _ in range(int(rng.integers(3, 7))):
      words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(topics[topic])))
    return " ".join(words)

  for name, count in (("train", num_train), ("eval", num_eval), ("test", num_test)):
    with open(os.path.join(data_dir, f"{FILE_PREFIX}.{name}.tsv"), "w", encoding="utf-8") as f:
      for index in range(count):
        label = index % 2
        topic1 = int(rng.integers(len(topics)))
        topic2 = topic1 if label else (topic1 + int(rng.integers(1, len(topics)))) % len(topics)
        f.write(f"{float(label)}\t{name}-{index}a\t{name}-{index}b\t"
                f"{document(topic1)}\t{document(topic2)}\n")


# ---------------------------------------------------------------------------------------------
# CLI.

def _define_flags() -> None:
  flags.DEFINE_string("output_dir", None, "Directory for the AAN-format demo set.")
  flags.DEFINE_integer("num_train", 4000, "Number of training pairs.")
  flags.DEFINE_integer("num_eval", 500, "Number of validation pairs.")
  flags.DEFINE_integer("num_test", 500, "Number of test pairs.")
  flags.DEFINE_integer("seed", 0, "Seed of the numpy Generator.")
  flags.mark_flag_as_required("output_dir")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  write_tiny_aan(f.output_dir, num_train=f.num_train, num_eval=f.num_eval,
                 num_test=f.num_test, seed=f.seed)
  print(f"wrote {f.output_dir}/{FILE_PREFIX}.{{train,eval,test}}.tsv")


# Flags are defined only when this file is the program: tests import several generators (and
# the trainer) into one process, and their flag names (--output_dir, --seed, ...) overlap.
if __name__ == "__main__":
  _define_flags()
  cli.run(main)
