"""Device mesh, logical-axis rules (MaxText style) and the NamedShardings of the trainer.

Mesh axes are always ``(data, fsdp, expert, tensor)``; sizes come from :class:`MeshConfig`
(``-1`` = all remaining devices). Every array dimension gets a *logical* name (``embed``,
``mlp``, ``heads``, ``experts``, ``vocab``, ``layers``, ``batch``, ``seq``); ONE rules table per
preset maps logical names to mesh axes:

==========  ==============================  =================  ====================
logical     ``fsdp`` (default)              ``tp``             ``dp``
==========  ==============================  =================  ====================
batch       (data, fsdp, expert)            (data, fsdp, exp.)  (data, fsdp, exp.)
embed       fsdp                            -                  -
mlp, heads  tensor                          tensor             -
vocab       tensor                          tensor             -
experts     expert                          expert             -
layers/seq  -                               -                  -
==========  ==============================  =================  ====================

A mesh axis whose size does not divide the dimension is dropped for that dimension (that
dimension is then replicated over it), and a mesh axis is used at most once per array: so any
model runs on any mesh, and sharding changes speed, never results.

Logical names of parameters are derived from the model config by dimension size, with the
stacked-expert dimension recognised by its path (``experts``): the model code carries no
sharding annotations, and a renamed leaf still shards sensibly.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from quads_jax.config import check, check_choice

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")
LOGICAL_RULES: dict[str, dict[str, tuple[str, ...]]] = {
    "fsdp": {"batch": BATCH_AXES, "embed": ("fsdp",), "mlp": ("tensor",), "heads": ("tensor",),
             "vocab": ("tensor",), "experts": ("expert",)},
    "tp": {"batch": BATCH_AXES, "mlp": ("tensor",), "heads": ("tensor",), "vocab": ("tensor",),
           "experts": ("expert",)},
    "dp": {"batch": BATCH_AXES},
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape and sharding preset.

    Attributes:
      data, fsdp, expert, tensor: mesh axis sizes; exactly one may be -1 (the rest of devices).
      rules: a key of :data:`LOGICAL_RULES`.
      num_devices: how many devices the mesh spans: the first ``num_devices`` of
        ``jax.devices()`` (e.g. one GPU of a host for a quick run, the others left free), or -1
        (all of them).
      distributed: call ``jax.distributed.initialize`` first: ``auto`` (when the environment
        names a coordinator or several processes), ``on`` or ``off``.
    """

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1
    rules: Literal["fsdp", "tp", "dp"] = "fsdp"
    num_devices: int = -1
    distributed: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        sizes = [self.data, self.fsdp, self.expert, self.tensor]
        for name, v in zip(MESH_AXES, sizes, strict=True):
            check("MeshConfig", name, v, v == -1 or v >= 1, "an integer >= 1, or -1 (the rest)")
        check("MeshConfig", "fsdp", self.fsdp, sizes.count(-1) <= 1,
              "at most one of data/fsdp/expert/tensor may be -1")
        check_choice("MeshConfig", "rules", self.rules, tuple(LOGICAL_RULES))
        check("MeshConfig", "num_devices", self.num_devices,
              self.num_devices == -1 or self.num_devices >= 1, "an integer >= 1, or -1 (all)")

    def axis_sizes(self, num_devices: int) -> tuple[int, ...]:
        """Concrete sizes for ``num_devices`` devices (resolving -1); ValueError if impossible."""
        sizes = [self.data, self.fsdp, self.expert, self.tensor]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ValueError(
                    f"MeshConfig {dict(zip(MESH_AXES, sizes, strict=True))}: the fixed axes "
                    f"(product {fixed}) do not divide the {num_devices} devices"
                )
            sizes[sizes.index(-1)] = num_devices // fixed
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"MeshConfig {dict(zip(MESH_AXES, sizes, strict=True))}: product "
                f"{math.prod(sizes)} != {num_devices} devices; set one axis to -1"
            )
        return tuple(sizes)


def maybe_initialize_distributed(mode: str = "auto") -> bool:
    """Call ``jax.distributed.initialize()`` when asked or when the environment says so.

    ``auto`` initialises when ``JAX_COORDINATOR_ADDRESS`` is set or ``JAX_NUM_PROCESSES`` > 1
    (set by the launcher on every host). Returns True when initialised.
    """
    if mode == "off":
        return False
    env_says = bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or int(
        os.environ.get("JAX_NUM_PROCESSES", "1")
    ) > 1
    if mode == "on" or env_says:
        if not jax.distributed.is_initialized():
            jax.distributed.initialize()
        return True
    return False


def make_mesh(config: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with axes ``(data, fsdp, expert, tensor)`` over ``devices`` (default: the first
    ``config.num_devices`` of ``jax.devices()``, or all of them)."""
    if devices is None:
        devices = jax.devices()
        if config.num_devices != -1:
            if config.num_devices > len(devices):
                raise ValueError(
                    f"MeshConfig.num_devices={config.num_devices}: only {len(devices)} "
                    f"{devices[0].platform} device(s) here; need 1-{len(devices)} or -1 (all)")
            devices = devices[:config.num_devices]
    devices = list(devices)
    sizes = config.axis_sizes(len(devices))
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def spec_for(
    logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: str
) -> PartitionSpec:
    """PartitionSpec of one array from its logical dimension names under preset ``rules``."""
    table = LOGICAL_RULES[rules]
    used: set[str] = set()
    out: list[Any] = []
    for name, dim in zip(logical, shape, strict=True):
        axes = []
        size = 1
        for ax in table.get(name, ()) if name else ():
            n = mesh.shape[ax]
            if ax in used or n == 1 or dim % (size * n):
                continue
            axes.append(ax)
            size *= n
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


def param_logical_axes(path: str, shape: Sequence[int], model_config: Any) -> tuple[str | None, ...]:
    """Logical names of a parameter's dimensions, derived from sizes in ``model_config``.

    The stacked expert dimension is the first dimension of size ``num_experts`` of a leaf whose
    path contains ``experts``; leading layer-stack dimensions get ``layers``.
    """
    c = model_config
    head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    sizes = {
        c.hidden_size: "embed",
        c.vocab_size: "vocab",
        c.num_attention_heads * head_dim: "heads",
        c.num_key_value_heads * head_dim: "heads",
        c.intermediate_size: "mlp",
        2 * c.intermediate_size: "mlp",
        c.moe_intermediate_size: "mlp",
        2 * c.moe_intermediate_size: "mlp",
    }
    names: list[str | None] = []
    expert_done = "experts" not in path.lower()
    stacked = path.startswith("layers")  # the model stacks each layer group on dim 0
    for dim in shape:
        if stacked and not names:
            names.append("layers")
            continue
        if not expert_done and dim == c.num_experts:
            names.append("experts")
            expert_done = True
        elif dim == c.hidden_size:  # embed wins ties: it is the FSDP axis
            names.append("embed")
        elif dim == c.num_hidden_layers and not names:
            names.append("layers")
        else:
            names.append(sizes.get(dim))
    return tuple(names)


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def param_shardings(params: Any, mesh: Mesh, rules: str, model_config: Any) -> Any:
    """A NamedSharding for every leaf of ``params`` (arrays or ShapeDtypeStructs)."""

    def one(path, leaf):
        shape = tuple(leaf.shape)
        logical = param_logical_axes(_path_str(path), shape, model_config)
        return NamedSharding(mesh, spec_for(logical, shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(one, params)


def like_params_shardings(tree: Any, params_struct: Any, p_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of a tree (optimizer state) whose sub-trees mirror ``params``.

    Every sub-tree with the params' structure (Adam's mu / nu, ...) gets the params' shardings;
    every other leaf (step counts, scalars) is replicated.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    mirrors = lambda x: jax.tree.structure(x) == params_struct  # noqa: E731

    def one(sub):
        return p_shardings if mirrors(sub) else jax.tree.map(lambda _: replicated, sub)

    return jax.tree.map(one, tree, is_leaf=mirrors)


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules: str) -> NamedSharding:
    """Batch-major arrays ``[B, ...]``: B over the data-parallel axes, the rest replicated."""
    logical = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, spec_for(logical, shape, mesh, rules))


def batch_axes_dividing(mesh, n: int) -> tuple[str, ...]:
    """The batch axes (``BATCH_AXES`` order) of ``mesh`` (a Mesh or AbstractMesh) that split
    ``n`` rows: each taken while the product so far times its size divides ``n``; axes of size 1
    are skipped. Empty for an empty mesh."""
    if mesh.empty:
        return ()
    axes, size = [], 1
    for a in BATCH_AXES:
        if a in mesh.axis_names and mesh.shape[a] > 1 and n % (size * mesh.shape[a]) == 0:
            axes.append(a)
            size *= mesh.shape[a]
    return tuple(axes)


def device_memory_metrics(devices: Sequence[Any] | None = None) -> dict[str, float]:
    """``mem/peak_gib_max`` / ``mem/peak_gib_min`` / ``mem/in_use_gib_max`` over the local
    devices that report memory (``Device.memory_stats``: GPUs; a CPU reports none, and then
    the dict is empty): the memory per GPU of a sharded run."""
    stats = [s for s in ((d.memory_stats() or {}) for d in (devices or jax.local_devices()))
             if "peak_bytes_in_use" in s]
    if not stats:
        return {}
    gib = 2.0 ** 30
    peak = [s["peak_bytes_in_use"] / gib for s in stats]
    return {"mem/peak_gib_max": max(peak), "mem/peak_gib_min": min(peak),
            "mem/in_use_gib_max": max(s.get("bytes_in_use", 0) / gib for s in stats)}


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
