"""DSA's prediction path: the selection rule (reference), the Triton selection and attention
kernels, and the Gram kernels of the predictor's MSE."""
