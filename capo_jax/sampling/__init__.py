"""Rollouts: the jitted sampler (prefill + decode loop) and its token-choice strategies."""

from capo_jax.sampling.sampler import Samples, SamplingSpec, bucket_length, generate
from capo_jax.sampling.strategies import Greedy, Strategy, Temperature, TopK, TopP, make_strategy

__all__ = [
  "Greedy",
  "Samples",
  "SamplingSpec",
  "Strategy",
  "Temperature",
  "TopK",
  "TopP",
  "bucket_length",
  "generate",
  "make_strategy",
]
