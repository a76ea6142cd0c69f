"""The ground floor: attention math that the kinds (``lra_sparse.attention``) and the kernels
(``lra_sparse.kernels``) share. Plain JAX; imports nothing else of the project.

- ``nm``: the N:M rule (parser, keep mask, the 1:4 / 2:4 tournament).
- ``softmax``: scores, the safe masked softmax, probability dropout, A V.
- ``dropout``: the counter-based (Philox) dropout mask every fused kernel and reference draws.
- ``sharding``: kernel calls split over a data-parallel mesh.
"""
