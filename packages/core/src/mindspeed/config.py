"""Typed configs: dataclasses are the single source of truth for YAML recipes and CLI overrides.

A recipe is a YAML mapping whose keys are the fields of a (nested) dataclass; ``key=value``
overrides use dotted paths (``model.num_layers=4``) and YAML syntax for values. Unknown keys
and values of the wrong type are errors that name the key and suggest the closest field.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override that does not fit the config's dataclass."""


def from_dict(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, recursively and strictly.

    Args:
        cls: the dataclass type.
        data: field values; missing fields keep their defaults.
        path: dotted prefix used in error messages.

    Raises:
        ConfigError: on an unknown key (with a suggestion) or a value of the wrong type.
    """
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [key for key in data if key not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"; did you mean {path + close[0]!r}?" if close else ""
        name = getattr(cls, "__section_name__", cls.__name__)
        raise ConfigError(f"unknown config key {path + key!r} for {name}{hint} (known: {', '.join(fields)})")
    values = {name: _coerce(hints[name], value, f"{path}{name}") for name, value in data.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{path or cls.__name__}: {err}") from err


def recipe_section(name: str | None = None, keys: Iterable[str] = ()) -> Callable[[type[T]], type[T]]:
    """Class decorator (above ``@dataclass``) of a suite's extension of a core recipe section.

    A dataclass subclass lists its base's fields first; a recipe's keys keep the order users know
    (``--print-config``, the ``known:`` list of an unknown key) when ``keys`` gives it.

    Args:
        name: the section's name in messages (``unknown config key 'train.x' for TrainConfig``;
            default: the class name).
        keys: every field of the class, in the order of the recipe's keys (default: as declared).

    Raises:
        TypeError: when ``keys`` is not exactly the class's fields.
    """

    def apply(cls: type[T]) -> type[T]:
        own = cls.__dataclass_fields__  # type: ignore[attr-defined]
        order = tuple(keys)
        if order:
            names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
            if sorted(order) != sorted(names):
                raise TypeError(f"{cls.__name__}: keys {order} are not its fields {tuple(names)}")
            rest = {k: v for k, v in own.items() if k not in order}  # ClassVar / InitVar pseudo-fields
            cls.__dataclass_fields__ = {**{k: own[k] for k in order}, **rest}  # type: ignore[attr-defined]
        if name is not None:
            cls.__section_name__ = name  # type: ignore[attr-defined]
        return cls

    return apply


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(hint)
        if type(None) in options and (value is None or value == "None"):  # YAML's null; Python's spelling too
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(option, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: got {value!r}")
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, get_args(hint)))}")
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping of {hint.__name__} fields, got {value!r}")
        return from_dict(hint, value, key + ".")
    if origin in (list, tuple, typing.Sequence) or hint in (list, tuple):
        args = get_args(hint)
        item = args[0] if args else Any
        if isinstance(value, str):  # "a,b" on the command line: items as written for strings, else YAML scalars
            value = [v.strip() if item is str else yaml.safe_load(v) for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        items = [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or hint is tuple else items
    if origin in (dict, Mapping) or hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "1e-4" as a string
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if isinstance(hint, type) and issubclass(hint, Path):
        return Path(value)
    return value


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into the nested mapping ``{"a": {"b": 1}, "c": "x"}``.

    Values are parsed as YAML scalars (``true``, ``3``, ``1e-4``, ``[1, 2]``).
    """
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.steps=10)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return nested


def merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict update that returns a new dict."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: Iterable[str] = ()) -> T:
    """Build ``cls`` from an optional YAML recipe plus ``key=value`` overrides.

    Raises:
        ConfigError: naming the file, the key or the override that does not fit.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from err
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        data = dict(loaded)
    return from_dict(cls, merge(data, parse_overrides(overrides)))


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain data (for YAML dumps and run reports)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))
