"""jshard: FSDP2-style fully sharded data parallel training for JAX and Flax."""

import importlib as _importlib

from jshard import collectives as collectives
from jshard import optim as optim
from jshard import state_dict as state_dict
from jshard._sharding.comm_hooks import AllGather as AllGather
from jshard._sharding.comm_hooks import AllReduce as AllReduce
from jshard._sharding.comm_hooks import ReduceScatter as ReduceScatter
from jshard._sharding.fully_shard import fully_shard as fully_shard
from jshard._sharding.fully_shard import reshard as reshard
from jshard._sharding.mesh import make_mesh as make_mesh
from jshard._sharding.pipeline_policy import PipelinePolicy as PipelinePolicy
from jshard._sharding.policies import CPUOffloadPolicy as CPUOffloadPolicy
from jshard._sharding.policies import DataParallelMeshDims as DataParallelMeshDims
from jshard._sharding.policies import FullyShardPolicy as FullyShardPolicy
from jshard._sharding.policies import MixedPrecisionPolicy as MixedPrecisionPolicy
from jshard._sharding.policies import OffloadPolicy as OffloadPolicy
from jshard._sharding.stages import stage_layers as stage_layers
from jshard._sharding.unit import FSDPUnit as FSDPUnit
from jshard._step.collectives import float8_all_gather as float8_all_gather
from jshard._step.collectives import int8_all_gather as int8_all_gather
from jshard._step.pipeline import pipeline as pipeline
from jshard._step.scan import scan as scan
from jshard._step.unshard import unshard as unshard
from jshard._step.value_and_grad import value_and_grad as value_and_grad
from jshard.batch import global_batch as global_batch
from jshard.optim import offload_optimizer as offload_optimizer
from jshard.optim import shard_optimizer as shard_optimizer

__version__ = "0.1.0"

__all__ = [
    "AllGather",
    "AllReduce",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPUnit",
    "FullyShardPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "PipelinePolicy",
    "ReduceScatter",
    "checkpoint",
    "collectives",
    "flax",
    "float8_all_gather",
    "fully_shard",
    "global_batch",
    "int8_all_gather",
    "launch",
    "make_mesh",
    "offload_optimizer",
    "optim",
    "pipeline",
    "report",
    "reshard",
    "scan",
    "shard_optimizer",
    "stage_layers",
    "state_dict",
    "unshard",
    "value_and_grad",
]

_LAZY = ("checkpoint", "report", "launch", "flax")  # they import Orbax, Flax or the launcher: on first use


def __getattr__(name: str):
    if name in _LAZY:
        return _importlib.import_module(f"jshard.{name}")
    raise AttributeError(f"module 'jshard' has no attribute {name!r}")
