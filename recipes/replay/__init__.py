"""Rollout replay: training on a serving engine's rollout records (tokens, logprobs, the DSA
top-k and the MoE routing it used) with the recorded selections replayed (docs/replay.md)."""
