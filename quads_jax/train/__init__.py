"""Training: mesh and sharding, train state and step, checkpoints, SFT, the RL loop."""
