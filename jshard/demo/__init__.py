"""The demo: a small Flax transformer trained fully sharded (``python -m jshard.demo``).

``train.py`` runs it, ``model.py`` is the model (shared with the planner and the
benchmarks); ``plan.py`` and ``llama3.py`` are plan builders for that model and a
Llama-3-8B shape (``python -m jshard.report plan jshard.demo.llama3:build_nnx``);
``moe.py`` is a Mixtral-style mixture of experts in Flax NNX and ``moe_train.py`` shards and
trains it on a ``(data, expert)`` mesh (``python -m jshard.demo --experts 4``, and the
Mixtral-8x7B plan builder ``jshard.demo.moe_train:build_mixtral``).

Example:
  >>> from jshard.demo import load_text
  >>> len(load_text()) > 10_000
  True
"""

from jshard.demo.train import Vocab as Vocab
from jshard.demo.train import load_text as load_text
from jshard.demo.train import main as main
from jshard.demo.train import simulate_cpu_devices as simulate_cpu_devices

__all__ = ["Vocab", "load_text", "main", "simulate_cpu_devices"]
