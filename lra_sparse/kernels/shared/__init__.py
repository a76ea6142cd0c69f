"""Shared by every kernel family: operand prologue, the jax-triton launch, the Philox draws
in Triton."""
