"""Import from and export to HF transformers Qwen3-MoE checkpoints (``config.json`` +
``*.safetensors``, one file or sharded with ``model.safetensors.index.json``).

Loading streams: each safetensors file is memory-mapped, and each leaf of the parameter tree is
assembled from its tensors (experts stacked as ``[n_layers, E, ...]``, gate/up fused) one leaf
at a time, or, with a mesh, one device shard at a time through
``jax.make_array_from_callback``, so a 30B checkpoint never sits twice in host memory.
Export plans the whole file layout from the shapes first, then writes tensor by tensor into a
temporary directory that is renamed into place at the end: nothing is left half-written.

Experts are exported in the per-expert layout of the released checkpoints
(``mlp.experts.{e}.gate_proj.weight``); both that layout and transformers' fused one
(``mlp.experts.gate_up_proj``) are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from quads_jax.models.config import ModelConfig
from quads_jax.models.transformer import init_params

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


# ------------------------------------------------------------------------- safetensors I/O
class SafetensorsFile:
    """A memory-mapped safetensors file: ``tensor(name)`` is a lazy numpy view."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from e
        header.pop("__metadata__", None)
        self.header = header
        self._data_start = 8 + n
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _st_header(entries: list[tuple[str, tuple[int, ...], np.dtype]]) -> tuple[bytes, int]:
    header, offset = {}, 0
    for name, shape, dtype in entries:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _ST_NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, offset


# ------------------------------------------------------------------------- name mapping
@dataclasses.dataclass(frozen=True)
class Piece:
    """One HF tensor placed into a leaf: ``dest`` has an int for each stacked axis and a
    ``(start, stop)`` range for each axis of the tensor, in order."""

    name: str
    dest: tuple[int | tuple[int, int], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in (d for d in self.dest if isinstance(d, tuple)))


def _leaf_pieces(config: ModelConfig, fused_experts: bool) -> dict[tuple, list[Piece]]:
    """Map each leaf path of the tree to the HF tensors that fill it."""
    c = config
    h, d = c.hidden_size, c.head_dim
    full = lambda n: (0, n)
    out: dict[tuple, list[Piece]] = {
        ("embed",): [Piece("model.embed_tokens.weight", (full(c.vocab_size), full(h)))],
        ("final_norm",): [Piece("model.norm.weight", (full(h),))],
    }
    if not c.tie_word_embeddings:
        out[("lm_head",)] = [Piece("lm_head.weight", (full(c.vocab_size), full(h)))]
    q_out, kv_out = c.num_attention_heads * d, c.num_key_value_heads * d
    for gi, (kind, start, stop) in enumerate(c.layer_groups):
        g = ("layers", gi)
        for j, i in enumerate(range(start, stop)):
            pre = f"model.layers.{i}."
            def put(path, name, *ranges, j=j, g=g):
                out.setdefault(g + path, []).append(Piece(name, (j, *ranges)))

            put(("input_norm",), pre + "input_layernorm.weight", full(h))
            put(("post_attn_norm",), pre + "post_attention_layernorm.weight", full(h))
            for proj, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                put(("attn", proj), pre + f"self_attn.{proj}.weight", full(rows), full(h))
            put(("attn", "o_proj"), pre + "self_attn.o_proj.weight", full(h), full(q_out))
            put(("attn", "q_norm"), pre + "self_attn.q_norm.weight", full(d))
            put(("attn", "k_norm"), pre + "self_attn.k_norm.weight", full(d))
            if kind == "dense":
                n = c.intermediate_size
                put(("mlp", "gate_up"), pre + "mlp.gate_proj.weight", (0, n), full(h))
                put(("mlp", "gate_up"), pre + "mlp.up_proj.weight", (n, 2 * n), full(h))
                put(("mlp", "down"), pre + "mlp.down_proj.weight", full(h), full(n))
                continue
            n, e_count = c.moe_intermediate_size, c.num_experts
            put(("mlp", "router"), pre + "mlp.gate.weight", full(e_count), full(h))
            gu, dn = ("mlp", "experts", "gate_up"), ("mlp", "experts", "down")
            if fused_experts:
                put(gu, pre + "mlp.experts.gate_up_proj", full(e_count), full(2 * n), full(h))
                put(dn, pre + "mlp.experts.down_proj", full(e_count), full(h), full(n))
                continue
            for e in range(e_count):
                ex = pre + f"mlp.experts.{e}."
                put(gu, ex + "gate_proj.weight", e, (0, n), full(h))
                put(gu, ex + "up_proj.weight", e, (n, 2 * n), full(h))
                put(dn, ex + "down_proj.weight", e, full(h), full(n))
    return out


def _fill(pieces: list[Piece], files: dict[str, SafetensorsFile], region: tuple[slice, ...],
          dtype) -> np.ndarray:
    """The part ``region`` (concrete slices over the leaf's axes) of a leaf, from its pieces."""
    out = np.zeros(tuple(s.stop - s.start for s in region), dtype)
    for p in pieces:
        out_idx, src_idx = [], []
        for dst, reg in zip(p.dest, region, strict=True):
            if isinstance(dst, int):
                if not reg.start <= dst < reg.stop:
                    break
                out_idx.append(dst - reg.start)
            else:
                lo, hi = max(dst[0], reg.start), min(dst[1], reg.stop)
                if lo >= hi:
                    break
                out_idx.append(slice(lo - reg.start, hi - reg.start))
                src_idx.append(slice(lo - dst[0], hi - dst[0]))
        else:
            out[tuple(out_idx)] = files[p.name].tensor(p.name)[tuple(src_idx)].astype(dtype)
    return out


# ------------------------------------------------------------------------- load
def _open_checkpoint(path: str) -> dict[str, SafetensorsFile]:
    """tensor name -> the open file holding it."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: has no 'weight_map' dict")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            raise ValueError(f"path: {path!r} holds no *.safetensors file")
    opened = {n: SafetensorsFile(os.path.join(path, n)) for n in names}
    return {key: f for f in opened.values() for key in f.keys()}


def read_config(path: str) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory's ``config.json``."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"path: {path!r} has no config.json")
    with open(cfg_path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
    return ModelConfig.from_hf_dict(d)


def load_hf(
    path: str | os.PathLike,
    *,
    dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    shardings: Any = None,
) -> tuple[ModelConfig, dict]:
    """Read an HF Qwen3-MoE checkpoint directory into ``(config, params)``.

    Args:
      path: directory with ``config.json`` and ``*.safetensors``.
      dtype: leaf dtype (default: the config's ``param_dtype``, float32); the returned config's
        ``param_dtype`` is set to it.
      mesh: place every leaf on this mesh (replicated unless ``shardings`` says otherwise).
      shardings: a tree of ``jax.sharding.Sharding`` like the params, or a callable
        ``(leaf_path: tuple, shape) -> Sharding``; one device shard is read at a time.
    Raises ValueError naming a missing tensor, or a tensor with its expected and found shape.
    """
    path = os.fspath(path)
    config = read_config(path)
    if dtype is not None:
        config = config.replace(param_dtype=dtype)
    files = _open_checkpoint(path)
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in files)
    leaf_pieces = _leaf_pieces(config, fused)
    for pieces in leaf_pieces.values():
        for p in pieces:
            if p.name not in files:
                raise ValueError(f"checkpoint {path!r}: tensor {p.name!r} is missing "
                                 f"(expected shape {list(p.shape)})")
            found = files[p.name].shape(p.name)
            if found != p.shape:
                raise ValueError(f"checkpoint {path!r}: tensor {p.name!r} has shape "
                                 f"{list(found)}, expected {list(p.shape)}")
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = []
    for key_path, spec in flat:
        lp = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path)
        pieces = leaf_pieces[lp]
        np_dtype = jnp.dtype(config.param_dtype)
        sharding = _sharding_for(lp, spec.shape, mesh, shardings)
        if sharding is None:
            full = tuple(slice(0, n) for n in spec.shape)
            leaves.append(jnp.asarray(_fill(pieces, files, full, np_dtype)))
            continue

        def cb(index, pieces=pieces, shape=spec.shape, np_dtype=np_dtype):
            region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
            return _fill(pieces, files, region, np_dtype)

        leaves.append(jax.make_array_from_callback(spec.shape, sharding, cb))
    return config, jax.tree_util.tree_unflatten(treedef, leaves)


def _sharding_for(leaf_path, shape, mesh, shardings):
    if shardings is None:
        if mesh is None:
            return None
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if callable(shardings):
        return shardings(leaf_path, shape)
    node = shardings
    for k in leaf_path:
        node = node[k]
    return node


# ------------------------------------------------------------------------- save
def _export_tensors(
    config: ModelConfig, params: dict
) -> Iterator[tuple[str, tuple, np.dtype, Callable]]:
    """``(hf_name, shape, leaf dtype, fetch)`` per tensor; ``fetch()`` returns its host array."""
    leaf_pieces = _leaf_pieces(config, fused_experts=False)
    for lp, pieces in leaf_pieces.items():
        leaf = params
        for k in lp:
            leaf = leaf[k]
        if not isinstance(leaf, jax.Array | np.ndarray):
            raise ValueError(f"params{list(lp)}: a {type(leaf).__name__} cannot be exported; "
                             "save_hf takes master (unquantized) weights")
        for p in pieces:
            want = tuple(1 if isinstance(d, int) else d[1] for d in p.dest)
            if any(a > b for a, b in zip(want, leaf.shape, strict=False)) or len(want) != leaf.ndim:
                raise ValueError(f"params{list(lp)}: shape {tuple(leaf.shape)} does not fit "
                                 f"tensor {p.name!r} of the config")
            idx = tuple(d if isinstance(d, int) else slice(*d) for d in p.dest)
            fetch = lambda leaf=leaf, idx=idx: np.asarray(leaf[idx])
            yield p.name, p.shape, np.dtype(leaf.dtype), fetch


def save_hf(
    config: ModelConfig,
    params: dict,
    path: str | os.PathLike,
    *,
    dtype=None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
) -> None:
    """Write ``params`` as an HF checkpoint that ``Qwen3MoeForCausalLM.from_pretrained`` loads.

    Args:
      dtype: tensor dtype on disk (default: each leaf's dtype).
      max_shard_bytes: split into ``model-0000i-of-0000n.safetensors`` + index above this.
      overwrite: replace an existing non-empty ``path``.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and os.listdir(path) and not overwrite:
        raise ValueError(f"path: {path!r} exists and is not empty; pass overwrite=True")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be >= 1")
    tensors = list(_export_tensors(config, params))
    disk = {name: np.dtype(jnp.dtype(dtype or d)) for name, _, d, _ in tensors}
    shards: list[list[tuple]] = [[]]
    size = 0
    for t in tensors:
        nbytes = int(np.prod(t[1])) * disk[t[0]].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.tmp-")
    try:
        weight_map, total = {}, 0
        for si, shard in enumerate(shards):
            fname = SINGLE_FILE if len(shards) == 1 else (
                f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors")
            header, nbytes = _st_header([(n, s, disk[n]) for n, s, _, _ in shard])
            with open(os.path.join(tmp, fname), "wb") as f:
                f.write(header)
                for name, _, _, fetch in shard:
                    f.write(np.ascontiguousarray(fetch().astype(disk[name])).tobytes())
                    weight_map[name] = fname
            total += nbytes
        if len(shards) > 1:
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
        hf = config.to_hf_dict()
        hf["torch_dtype"] = jnp.dtype(dtype or tensors[0][2]).name
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(tmp: str, path: str) -> None:
    """Move the finished ``tmp`` to ``path`` (an old ``path`` is removed only afterwards)."""
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    old = tmp + ".old"
    os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
