"""Local-view collectives, usable inside ``jax.shard_map`` (and as policy hooks)."""

from jshard._step.collectives import all_gather as all_gather
from jshard._step.collectives import all_reduce as all_reduce
from jshard._step.collectives import divide_factors as divide_factors
from jshard._step.collectives import float8_all_gather as float8_all_gather
from jshard._step.collectives import int8_all_gather as int8_all_gather
from jshard._step.collectives import reduce_scatter as reduce_scatter

__all__ = ["all_gather", "all_reduce", "divide_factors", "float8_all_gather", "int8_all_gather", "reduce_scatter"]
