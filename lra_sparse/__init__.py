"""lra-sparse: Long Range Arena with dense and sparse attention in JAX/Flax."""
