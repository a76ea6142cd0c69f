"""A small learnable IMDB-style set in the aclImdb layout, for the tiny "text" preset.

Not real IMDB text: every review is filler words plus a few sentiment words of its label, so a
tiny model learns the label from bytes in minutes on a CPU. The files are what the "text" task's
``aclimdb`` source reads (``lra_sparse.data.text``)::

  <output_dir>/{train,test}/{neg,pos}/<id>_<rating>.txt

CLI (absl flags)::

  python -m lra_sparse.generators.text --output_dir=data/text_tiny \\
      [--num_train=4000] [--num_test=1000] [--seed=0]

The same seed gives byte-identical files.
"""
from __future__ import annotations

import os
from typing import Sequence

from absl import app
from absl import flags
import numpy as np

from lra_sparse import cli
from lra_sparse.data.text import LABEL_NAMES


def write_tiny_aclimdb(data_dir: str, *, num_train: int = 4000, num_test: int = 1000,
                       seed: int = 0) -> None:
  """Writes a small learnable aclImdb-layout set for the "tiny" preset (not real IMDB text).

  Each review is filler words plus 2-4 words of its label's sentiment and at most one of the
  other, so a tiny model can learn the label from bytes in minutes on a CPU.
  """
  rng = np.random.default_rng(seed)
  filler = ["the", "movie", "film", "plot", "actor", "scene", "was", "and", "a", "story",
            "really", "quite", "with", "ending", "music", "it"]
  sentiment = (["awful", "boring", "terrible", "dull", "worst"],
               ["great", "superb", "wonderful", "moving", "best"])
  for split_dir, count in (("train", num_train), ("test", num_test)):
    for label, label_name in enumerate(LABEL_NAMES):
      os.makedirs(os.path.join(data_dir, split_dir, label_name), exist_ok=True)
    for index in range(count):
      label = index % 2
      # 10-30 filler words keep a review under ~200 bytes: the tiny preset's 256 never cuts a cue.
      words = list(rng.choice(filler, size=int(rng.integers(10, 30))))
      cues = ([rng.choice(sentiment[label]) for _ in range(int(rng.integers(2, 5)))]
              + [rng.choice(sentiment[1 - label]) for _ in range(int(rng.integers(0, 2)))])
      for cue in cues:
        words.insert(int(rng.integers(0, len(words) + 1)), str(cue))
      # aclImdb names reviews <id>_<rating>.txt; ratings 1-4 are neg, 7-10 pos.
      rating = int(rng.integers(7, 11)) if label else int(rng.integers(1, 5))
      path = os.path.join(data_dir, split_dir, LABEL_NAMES[label], f"{index}_{rating}.txt")
      with open(path, "w", encoding="utf-8") as f:
        f.write(" ".join(words).capitalize() + ".\n")


# ---------------------------------------------------------------------------------------------
# CLI.

def _define_flags() -> None:
  flags.DEFINE_string("output_dir", None, "Directory for the aclImdb-layout demo set.")
  flags.DEFINE_integer("num_train", 4000, "Number of training reviews.")
  flags.DEFINE_integer("num_test", 1000, "Number of test reviews.")
  flags.DEFINE_integer("seed", 0, "Seed of the numpy Generator.")
  flags.mark_flag_as_required("output_dir")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  write_tiny_aclimdb(f.output_dir, num_train=f.num_train, num_test=f.num_test, seed=f.seed)
  print(f"wrote {f.output_dir}/{{train,test}}/{{pos,neg}}/*.txt")


# Flags are defined only when this file is the program: tests import several generators (and
# the trainer) into one process, and their flag names (--output_dir, --seed, ...) overlap.
if __name__ == "__main__":
  _define_flags()
  cli.run(main)
