"""RL: tasks, rewards, the GRPO objective with rollout correction, diagnostics."""
