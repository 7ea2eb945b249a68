"""Flax adapters: per-module FSDP units for NNX (:mod:`jshard.flax.nnx`) and Linen (:mod:`jshard.flax.linen`).

Example:
  >>> from jshard.flax import linen as jlinen, nnx as jnnx
  >>> callable(jnnx.fully_shard) and callable(jlinen.fully_shard)
  True
"""
