"""JetStream's prefill buckets and the prompt length a run's server must prefill. No JetStream
import here: config validation reads them before anything loads."""

from __future__ import annotations

# JetStream's prefill buckets (token_utils.pad_tokens); max_prefill_length must be one.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def served_prompt_len(config) -> int:
    """The longest prompt a run's JetStream server prefills: `data.max_prompt_len`, and for a
    multi-turn run (env.name set) that plus `rollout.max_new_tokens`, since each turn's
    request resends the row's whole history (gjax.rollout.jetstream_episodes)."""
    extra = config.rollout.max_new_tokens if config.env.name else 0
    return config.data.max_prompt_len + extra


def prefill_bucket(num_tokens: int) -> int:
    """Smallest JetStream bucket holding `num_tokens` (+1: the BOS slot JetStream adds)."""
    for b in PREFILL_BUCKETS:
        if b >= num_tokens + 1:
            return b
    raise ValueError(f"prompts of {num_tokens} tokens exceed JetStream's largest bucket")
