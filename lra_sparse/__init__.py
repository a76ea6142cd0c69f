"""lra-sparse: Long Range Arena with dense and sparse attention in JAX/Flax."""

from lra_sparse import moved as _moved

_moved.install()
