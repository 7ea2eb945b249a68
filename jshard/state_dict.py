"""Full and sharded state dicts of sharded trees, and loading them (see ``docs/checkpoint.md``)."""

from jshard._state.pretrained import load_pretrained as load_pretrained
from jshard._state.state_dict import full_state_dict as full_state_dict
from jshard._state.state_dict import load_full_state_dict as load_full_state_dict
from jshard._state.state_dict import load_sharded_state_dict as load_sharded_state_dict
from jshard._state.state_dict import sharded_state_dict as sharded_state_dict

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "load_pretrained",
    "load_sharded_state_dict",
    "sharded_state_dict",
]
