"""Nystromformer's Pallas kernels: landmark flash attentions, the pseudo-inverse, the conv skip."""
