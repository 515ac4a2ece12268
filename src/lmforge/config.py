"""Typed configuration, validated in one place: YAML file + dotted `key=value` overrides -> dataclass.

Every stage declares its config as (nested) dataclasses with defaults; `load_config` fills them
from an optional YAML file, then applies overrides such as `train.lr=3e-4` or
`model.init=path/to/model`, parsing each value by the declared type of its field
(int, float, bool, str, Path, Literal, Optional[...], list[...] / dict[...] through YAML).
Unknown keys and wrong types stop with a message naming the key, the source and the fix.
`to_dict` / `dump_yaml` write the resolved config back (a run's `config.yaml`).
It knows nothing about what any stage does with its config.

    from lmforge.config import load_config
    cfg = load_config(TrainConfig, "train.yaml", ["train.lr=3e-4"])
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")
_NONE_WORDS = {"null", "none", "~"}
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


class ConfigError(ValueError):
    """A config value or key a person must fix; the message says which and how."""


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build `cls` from its defaults, then the YAML file at `path`, then `key=value` overrides."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(loaded).__name__}")
        data = loaded or {}
    cfg = _build(cls, data, prefix="", source=source)
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.lr=3e-4")
        cfg = _override(cfg, key.strip().split("."), raw.strip(), full_key=key.strip())
    return cfg


def to_dict(cfg: Any) -> Any:
    """A plain, YAML-safe structure (Paths and enums as strings, tuples as lists)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {str(k): to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Path):
        return str(cfg)
    if isinstance(cfg, enum.Enum):
        return cfg.value
    return cfg


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints resolves `from __future__ import annotations` strings in the class's module.
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _unknown(key: str, where: str, valid: list[str], source: str) -> ConfigError:
    return ConfigError(f"{source}: unknown key {key!r}{f' in {where!r}' if where else ''}; "
                       f"valid keys: {', '.join(sorted(valid))}")


def _build(cls: type[T], data: dict, prefix: str, source: str) -> T:
    fields, hints = _fields(cls), _hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(str(key), prefix.rstrip("."), list(fields), source)
        tp = hints[key]
        if _is_dataclass_type(tp):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {prefix}{key} is a section; give a mapping of its keys "
                                  f"({', '.join(_fields(tp))}), not {value!r}")
            kwargs[key] = _build(tp, value, f"{prefix}{key}.", source)
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}", source)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a field without a default that the file did not give
        raise ConfigError(f"{source}: {prefix or cls.__name__ + ' '}is incomplete: {e}") from e


def _override(cfg: Any, parts: list[str], raw: str, full_key: str) -> Any:
    fields, hints = _fields(type(cfg)), _hints(type(cfg))
    head = parts[0]
    where = full_key[: -len(".".join(parts))].rstrip(".")
    if head not in fields:
        raise _unknown(head, where, list(fields), f"override {full_key}={raw}")
    tp = hints[head]
    if _is_dataclass_type(tp):
        if len(parts) == 1:
            raise ConfigError(f"override {full_key}={raw}: {full_key} is a section; set one of its keys, "
                              f"e.g. {full_key}.{next(iter(_fields(tp)))}=...")
        value = _override(getattr(cfg, head), parts[1:], raw, full_key)
    elif len(parts) > 1:
        raise ConfigError(f"override {full_key}={raw}: {'.'.join(full_key.split('.')[:-len(parts) + 1])} "
                          f"is a {_type_name(tp)} value, not a section")
    else:
        value = _parse(raw, tp, full_key)
    return dataclasses.replace(cfg, **{head: value})


def _parse(raw: str, tp: Any, key: str) -> Any:
    """A command-line string -> a value of type `tp` (strings stay strings; others via YAML)."""
    source = f"override {key}={raw}"
    if _is_optional(tp) and raw.lower() in _NONE_WORDS:
        return None
    base = _strip_optional(tp)
    if base in (str, Path) or typing.get_origin(base) is Literal and all(isinstance(a, str) for a in typing.get_args(base)):
        return _coerce(raw, tp, key, source)
    if base is float:  # YAML 1.1 reads "3e-4" as a string; float() does not
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{source}: {key} expects float, got {raw!r}") from None
    if base is bool:
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ConfigError(f"{source}: {key} expects bool (true/false), got {raw!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: {key} expects {_type_name(tp)}; {raw!r} is not valid YAML ({e})") from e
    return _coerce(value, tp, key, source)


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check (and widen where lossless: int -> float, str -> Path) `value` against `tp`."""
    def bad() -> ConfigError:
        return ConfigError(f"{source}: {key} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")

    if tp is Any:
        return value
    if _is_optional(tp):
        return None if value is None else _coerce(value, _strip_optional(tp), key, source)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: {key} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad()
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        val_tp = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, val_tp, f"{key}.{k}", source) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{source}: {key} must be one of {[m.value for m in tp]}, got {value!r}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise bad()
        return Path(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise bad()
    return value


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _strip_optional(tp: Any) -> Any:
    if not _is_optional(tp):
        return tp
    rest = [a for a in typing.get_args(tp) if a is not type(None)]
    return rest[0] if len(rest) == 1 else Union[tuple(rest)]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "")
