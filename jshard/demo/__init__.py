"""The demo: a small Flax transformer trained fully sharded (``python -m jshard.demo``).

``train.py`` runs it, ``model.py`` is the model (shared with the planner and the
benchmarks), ``plan.py`` plans that model on a mesh larger than the machine
(``python -m jshard.report --plan``).

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
