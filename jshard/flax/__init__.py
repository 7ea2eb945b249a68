"""Flax adapters: per-module FSDP units for NNX (:mod:`jshard.flax.nnx`) and Linen (:mod:`jshard.flax.linen`)."""
