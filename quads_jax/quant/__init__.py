"""Quantization: the NVFP4 and FP8 formats, recipes and the one matmul dispatch."""
