"""gjax: a JAX-native trainer for GRPO-family RL on LLM reasoning."""

__version__ = "0.1.0"
