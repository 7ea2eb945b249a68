"""jshard: FSDP2-style fully sharded data parallel training for JAX and Flax."""

from jshard import collectives as collectives
from jshard._api import CPUOffloadPolicy as CPUOffloadPolicy
from jshard._api import DataParallelMeshDims as DataParallelMeshDims
from jshard._api import FullyShardPolicy as FullyShardPolicy
from jshard._api import MixedPrecisionPolicy as MixedPrecisionPolicy
from jshard._api import OffloadPolicy as OffloadPolicy
from jshard._collectives import int8_all_gather as int8_all_gather
from jshard._fully_shard import fully_shard as fully_shard
from jshard._fully_shard import reshard as reshard
from jshard._fully_shard import unshard as unshard
from jshard._mesh import make_mesh as make_mesh
from jshard._offload import offload_optimizer as offload_optimizer
from jshard._scan import scan as scan
from jshard._step import value_and_grad as value_and_grad
from jshard._unit import FSDPUnit as FSDPUnit

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPUnit",
    "FullyShardPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "collectives",
    "fully_shard",
    "int8_all_gather",
    "make_mesh",
    "offload_optimizer",
    "reshard",
    "scan",
    "unshard",
    "value_and_grad",
]
