"""Triton kernels (optional): one module per codec. Codecs fall back to their
PyTorch reference, which produces the same bits, when Triton or a GPU is missing."""
