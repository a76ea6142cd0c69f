"""Attention kernels, one folder per family, each beside its pure-JAX reference.

    shared/    what every family uses: ``prologue`` (operand checks, head-dim padding, key
               extents), ``launch`` (a ``@triton.jit`` function through jax-triton), ``philox``
               (the Triton source of the dropout draws ``lra_sparse.ops.dropout`` defines)
    dfss/      DFSS N:M: ``reference`` (pure JAX), ``mosaic`` (Pallas Mosaic GPU, Hopper),
               ``triton`` (wrapper) over ``triton_kernels`` + ``triton_select`` (source) with
               ``tiles``, and the paper's compressed SDDMM -> softmax -> SpMM pipeline
               (``compressed`` over ``compressed_kernels``)
    dsa/       DSA: ``reference`` (the selection rule and attention under a keep set),
               ``triton`` (wrapper) over ``select_kernels`` + ``attention_kernels`` with
               ``tiles``, and ``gram`` over ``gram_kernels`` (the predictor's MSE)
    nystrom/   Nystromformer's Pallas kernels: ``landmark`` (flash attentions of F and B V),
               ``pinv`` (the iterative pseudo-inverse), ``length_conv`` (the conv skip)

Kernels import only ``lra_sparse.ops`` and each other, never the attention kinds above them.
Importing a wrapper never imports triton, jax_triton or Pallas' GPU backends: the wrappers
import their kernel source on first launch.
"""
