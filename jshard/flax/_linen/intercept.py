"""Units for Linen models whose code you do not change: chosen by module class, at call time.

[Note: intercepted units] ``jshard.flax.linen.fully_shard(Block)`` needs the model to
build ``Block`` from the wrapped class. A Hugging Face Flax model builds its layers
itself (``FlaxGPT2Block``, ``FlaxLlamaDecoderLayer``, ``FlaxBertLayer``), so
:class:`ModuleUnits` reaches them through Linen's method interception instead: while
it is active, every call of a selected module's method (and of the root module, which
owns what is left) is run through the same lifted transform that ``fully_shard``
applies (``transform.fsdp``), so the module gathers its unit by its scope path
when called and reshards after. Inside the lifted call the module's method is called
again on the rebound clone; a guard on (path, method), set for the lifted call, lets
that call (and Linen's wrapping of it) through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

from flax import linen as nn
from jax.sharding import Mesh

from jshard._sharding.policies import FullyShardPolicy
from jshard.flax._linen.transform import fsdp
from jshard.flax._paths import Path


@dataclasses.dataclass(frozen=True)
class ModuleUnits:
    """Make every Linen module of the given classes its own FSDP unit, without editing the model.

    The root module (the one ``apply`` is called on) becomes the root unit, holding the
    parameters no selected module owns (embeddings, final norm, head). Pass it as
    ``units=`` to :func:`jshard.flax.linen.shard_params` and
    :func:`jshard.flax.linen.value_and_grad`; see [Note: intercepted units].

    Args:
      classes: a Linen module class or a tuple of them (subclasses match too).
      mesh: the mesh (default :func:`jshard.make_mesh`).
      policy: the policy of the selected modules' units.
      root_policy: the policy of the root unit.
      methods: the methods that gather (default ``("__call__",)``).

    Example:
      >>> import flax.linen as nn
      >>> from jshard.flax import linen as jlinen
      >>> units = jlinen.ModuleUnits(nn.Dense)
      >>> units.selects(nn.Dense(3)), units.selects(nn.LayerNorm())
      (True, False)
    """

    classes: type | tuple[type, ...]
    mesh: Mesh | None = None
    policy: FullyShardPolicy = FullyShardPolicy()
    root_policy: FullyShardPolicy = FullyShardPolicy()
    methods: tuple[str, ...] = ("__call__",)

    def __post_init__(self):
        classes = self.classes if isinstance(self.classes, tuple) else (self.classes,)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise TypeError(
                f"ModuleUnits takes Linen module classes, got {bad[0] if bad else self.classes!r}; pass the class "
                "of the layers to shard, e.g. ModuleUnits(FlaxGPT2Block)."
            )
        object.__setattr__(self, "classes", classes)
        for name, p in (("policy", self.policy), ("root_policy", self.root_policy)):
            if not isinstance(p, FullyShardPolicy):
                raise TypeError(f"ModuleUnits `{name}` must be a jshard.FullyShardPolicy, got {type(p).__name__}.")
        if isinstance(self.methods, str) or not all(isinstance(m, str) for m in self.methods):
            raise TypeError(f"ModuleUnits `methods` must be a tuple of method names, got {self.methods!r}.")
        object.__setattr__(self, "methods", tuple(self.methods))

    def selects(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the selected classes.

        Example:
          >>> import flax.linen as nn
          >>> from jshard.flax import linen as jlinen
          >>> jlinen.ModuleUnits((nn.Dense, nn.Conv)).selects(nn.Conv(2, (3, 3)))
          True
        """
        return isinstance(module, self.classes)

    @contextlib.contextmanager
    def intercept(self) -> Iterator[None]:
        """While active, selected modules and the root gather their units when called.

        :func:`jshard.flax.linen.shard_params` and :func:`jshard.flax.linen.value_and_grad`
        enter it for you when given ``units=``.

        Example:
          >>> import flax.linen as nn
          >>> from jshard.flax import linen as jlinen
          >>> with jlinen.ModuleUnits(nn.Dense).intercept():
          ...     pass
        """
        with nn.intercept_methods(functools.partial(self._interceptor, set())):
            yield

    def _interceptor(self, inside: set[tuple[Path, str]], next_fun: Callable[..., Any], args: tuple, kwargs: dict,
                     context: Any) -> Any:
        """``inside``: the ``(path, method)`` calls now running through the lifted transform
        (owned by this activation of :meth:`intercept`)."""
        module, method = context.module, context.method_name
        scope = getattr(module, "scope", None)
        if method not in self.methods or scope is None:
            return next_fun(*args, **kwargs)
        path = tuple(scope.path)
        root = not path
        if not (root or self.selects(module)) or (path, method) in inside:
            return next_fun(*args, **kwargs)

        def call(clone: nn.Module, *a: Any, **k: Any) -> Any:
            return getattr(clone, method)(*a, **k)

        call.__name__ = method
        policy = self.root_policy if root else self.policy
        inside.add((path, method))
        try:
            return nn.transforms.lift_transform(fsdp, call, self.mesh, policy)(module, *args, **kwargs)
        finally:
            inside.discard((path, method))


def check_units(units: Any) -> None:
    if units is not None and not isinstance(units, ModuleUnits):
        raise TypeError(
            f"`units` must be a jshard.flax.linen.ModuleUnits, got {type(units).__name__}; pass "
            "units=jshard.flax.linen.ModuleUnits(LayerClass)."
        )


def intercepting(units: ModuleUnits | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if units is None else units.intercept()
