"""Pallas (Mosaic GPU) kernels for NVFP4 W4A4 / FP8 matmuls on Hopper, each with a jnp reference."""
