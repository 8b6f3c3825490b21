"""One YAML loader for every frozen config dataclass of quads-jax.

Each part of the system owns its config dataclass (``GRPOConfig`` beside the GRPO loss,
``MeshConfig`` beside the mesh builder, ...), frozen and validated in ``__post_init__``. This module
only knows how to turn plain data (YAML, dotted ``key=value`` overrides) into such a dataclass:

* unknown keys -> ``ValueError`` naming the dotted key and the keys that are allowed;
* wrong types -> ``ValueError`` naming the key, the value and the expected type;
* ``Literal`` fields -> the value must be one of the allowed strings;
* nested dataclasses, ``tuple[...]``, ``dict[str, ...]``, ``X | None`` are supported.

Range checks live in the dataclasses themselves; :func:`check` gives them one message format.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin, get_type_hints

import numpy as np
import yaml


def check(owner: str, field: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise ``ValueError("owner.field=value: allowed ...")`` when ``ok`` is false."""
    if not ok:
        raise ValueError(f"{owner}.{field}={value!r} is invalid; allowed: {allowed}")


def check_choice(owner: str, field: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    check(owner, field, value, value in choices, f"one of {list(choices)}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Convert plain data ``value`` to the annotated type ``tp`` or raise naming ``key``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ValueError(f"{key}=None is invalid; expected {_type_name(tp)}")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(f"{key}={value!r} is invalid; expected {_type_name(tp)} ({errors[0]})")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is invalid; allowed: one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}={value!r} is invalid; expected a mapping for {tp.__name__}")
        return from_dict(tp, value, prefix=key)
    if origin is tuple:
        args = get_args(tp)
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ValueError(f"{key}={value!r} is invalid; expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ValueError(f"{key}={value!r} is invalid; expected {len(args)} items")
        return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin in (dict, Mapping):
        key_tp, val_tp = get_args(tp) or (str, Any)
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}={value!r} is invalid; expected a mapping")
        return {_convert(key_tp, k, key): _convert(val_tp, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key}={value!r} is invalid; expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{key}={value!r} is invalid; expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{key}={value!r} is invalid; expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{key}={value!r} is invalid; expected a string")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ValueError(f"{key}={value!r} is invalid; expected {_type_name(tp)}")


def from_dict[T](cls: type[T], data: Mapping[str, Any] | None, *, prefix: str = "") -> T:
    """Build the frozen dataclass ``cls`` from plain data, checking keys and types.

    Args:
      cls: a dataclass type; its ``__post_init__`` does the range checks.
      data: a mapping of field name to plain value (nested mappings for nested dataclasses).
      prefix: the dotted path of ``data`` inside the whole config, used in error messages.
    """
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(
            f"unknown config key {where}{unknown[0]!s}; allowed keys of {cls.__name__}: "
            f"{sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, f"{prefix}.{name}" if prefix else name)
    try:
        return cls(**kwargs)
    except ValueError as err:
        if prefix:
            raise ValueError(f"in {prefix}: {err}") from None
        raise


def to_dict(config: Any) -> Any:
    """The plain-data form of a config dataclass (inverse of :func:`from_dict`), YAML-safe."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (tuple, list)):
        return [to_dict(v) for v in config]
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, np.dtype):  # ml_dtypes' too (bfloat16, float8_*: not numpy classes)
        return config.name
    if type(config).__module__.startswith("numpy"):  # numpy scalars
        return config.item()
    return config


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"rl.grpo.eps_hi=0.3"`` -> ``(["rl", "grpo", "eps_hi"], 0.3)``; value parsed as YAML."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is invalid; expected dotted.key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"override {item!r} has an empty key part; expected dotted.key=value")
    return parts, yaml.safe_load(raw) if raw.strip() else ""


def field_overrides(items: Sequence[str], flag: str) -> dict[str, Any]:
    """``FIELD=VALUE`` items of a command-line ``flag`` (``--w4a4-set``, ...) -> ``{field:
    value}`` for one flat config dataclass (values parsed as YAML; the caller's dataclass
    checks the fields and values)."""
    fields = {}
    for item in items:
        key, value = parse_override(item)
        if len(key) != 1:
            raise ValueError(f"{flag} {item!r}: one config field, not a dotted key")
        fields[key[0]] = value
    return fields


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each dotted ``key=value`` override set (keys checked later)."""
    out = _deep_copy(data)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(
                    f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section"
                )
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in ``top`` replaces ``base``."""
    out = _deep_copy(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = _deep_copy(v)
    return out


def read_yaml(path: str | os.PathLike, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a YAML mapping; an empty file is an empty mapping.

    A top-level ``base: other.yaml`` (relative to this file) is read first and this file's
    keys are merged over it, so that per-arm configs hold only what differs.
    """
    path = os.path.abspath(os.fspath(path))
    if path in _seen:
        raise ValueError(f"config file {path!r}: 'base' includes form a cycle {list(_seen)}")
    with open(path) as f:
        data = yaml.safe_load(f)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ValueError(f"config file {path!r}: base={base!r} must be a file name")
        data = merge(read_yaml(os.path.join(os.path.dirname(path), base), (*_seen, path)), data)
    return data


def load[T](cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Load ``cls`` from a YAML file (or defaults when ``path`` is None) plus dotted overrides."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides))
