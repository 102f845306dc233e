"""The three roles on real parts: rollout and GenRM reward on vLLM, training on torch (§2.1, §8.1)."""
