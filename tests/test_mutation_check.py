"""scripts/mutation_check.py's list stays runnable: each mutation's snippet is in its file once
and its test exists (a snippet the code no longer holds would make the mutation an error, found
only when someone runs the check)."""
from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_mutation_names_a_snippet_found_once_and_an_existing_test():
  from scripts import mutation_check  # pylint: disable=import-outside-toplevel
  names = [m[0] for m in mutation_check.MUTATIONS]
  assert len(names) == len(set(names)), "two mutations share a name"
  for name, path, snippet, replacement, test in mutation_check.MUTATIONS:
    with open(os.path.join(REPO, path)) as f:
      source = f.read()
    assert source.count(snippet) == 1, (name, path, source.count(snippet))
    assert replacement != snippet, name
    test_file, test_name = test.split("::")
    with open(os.path.join(REPO, test_file)) as f:
      assert re.search(rf"^def {re.escape(test_name.split('[')[0])}\(", f.read(), re.M), \
          (name, test)
