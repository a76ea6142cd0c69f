"""DFSS (dynamic N:M sparse attention): the pure-JAX reference, the Mosaic GPU kernels (Hopper),
the fused Triton kernels and the paper's compressed pipeline."""
