"""quads-jax: QUADS NVFP4 rollout for RL post-training of MoE LLMs in JAX / Flax / Pallas."""

__version__ = "0.1.0"
