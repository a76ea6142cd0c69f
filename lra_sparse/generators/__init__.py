"""Data set generators: each module writes files in the official on-disk layout of one LRA task.

``listops`` (the LRA-faithful ListOps generator) and ``pathfinder`` (Pathfinder and Path-X images)
write full-size sets; ``text`` and ``retrieval`` write small learnable demo sets in the aclImdb and
AAN layouts for the tiny presets. Each is also a command line tool
(``python -m lra_sparse.generators.<task> --output_dir=DIR ...``, absl flags, ``--helpfull``
lists them). The files they write are read back by the loaders in ``lra_sparse.data``, which
never import a generator; a generator may import its loader's format constants.
"""
