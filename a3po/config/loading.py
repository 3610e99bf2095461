"""Building a checked :class:`~a3po.config.train.TrainConfig` from YAML files, plain dicts and
overrides: every value's type against the field's annotation (generic over the types, so a new
field needs no change here), then the sections' own range and cross-field checks; every error
names the source (file, preset or 'overrides') and the dotted field."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
import types
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from a3po.config.errors import ConfigError
from a3po.config.train import RENAMED_FIELDS, TrainConfig

# A config is a few hundred YAML nodes. Aliases let a few hundred bytes stand for billions
# ("billion laughs"): nodes are counted as if every alias were expanded, and past this the text
# is refused before anything walks (or prints) the expanded value.
MAX_YAML_NODES = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlRefused(yaml.YAMLError):
    """YAML that parses but is refused as a config (too large once its aliases are expanded)."""


def _expanded_nodes(root: yaml.Node) -> int:
    """Nodes under ``root`` with every alias expanded, counted in time linear in the distinct
    nodes (an alias is the very node object it names: memoised by identity)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) not in sizes:
            children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else (
                node.value if isinstance(node, yaml.SequenceNode) else [])
            sizes[id(node)] = 1 + sum(size(c) for c in children)
            if sizes[id(node)] > MAX_YAML_NODES:
                raise YamlRefused(f"refused: its aliases expand to more than {MAX_YAML_NODES} YAML nodes "
                                  f"(line {node.start_mark.line + 1}); a config has a few hundred")
        return sizes[id(node)]

    return size(root)


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float, as YAML 1.2 and ``--set`` do (YAML 1.1 wants
    a dot, ``1.0e-4``, and PyYAML would return the string '1e-4'); refuses a key repeated in a
    mapping (PyYAML keeps the last silently) and text whose aliases expand past
    :data:`MAX_YAML_NODES`."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_nodes(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue  # keys merged in by `<<` may be overridden; non-scalar keys fail later anyway
                key = self.construct_object(key_node)
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {_short.repr(key)} (first at line {first_line[key] + 1})",
                        key_node.start_mark)
                first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML config text (files and ``--set`` values alike): safe, 1e-4 is a float."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


# Values in error messages: bounded in depth and width, whatever the value holds.
_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxtuple, _short.maxdict = 3, 8, 8, 8
_short.maxstring, _short.maxother, _short.maxlong = 120, 120, 60

# A number written as text (YAML 1.1 leaves 1e-4 a string). Not nan/inf: no field means them.
_NUMERIC_TEXT = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?")


def _describe(tp: Any) -> str:
    """What a field of type ``tp`` expects, for error messages."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, tuple, set, frozenset):
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a float", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _got(value: Any) -> str:
    return "null" if value is None else f"{_short.repr(value)} ({type(value).__name__})"


def _check(tp: Any, value: Any, source: str, dotted: str) -> Any:
    """``value`` as a value of field type ``tp`` (e.g. 3.0 -> 3 for an int, '1e-4' -> 1e-4 for a
    float), or :class:`ConfigError` naming ``source`` and ``dotted``. Generic over the types, so
    a new field needs no change here."""

    def bad(expected: str | None = None) -> ConfigError:
        return ConfigError(f"{source}: {dotted}: expected {expected or _describe(tp)}, got {_got(value)}")

    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: X's own message (it may be a nested section's)
            return _check(options[0], value, source, dotted)
        for option in options:
            try:
                return _check(option, value, source, dotted)
            except ConfigError:
                pass
        raise bad()
    if value is None:
        raise bad(f"{_describe(tp)} (the field is not optional)")
    if origin is Literal:
        if value in args:
            return value
        raise bad()
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return _build(tp, value, source, dotted)
        raise bad()
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)  # by value; a member is its own value
        except ValueError:
            raise bad() from None
    if tp is bool:
        if isinstance(value, bool):  # YAML already made true/false/yes/no bools; 0/1 are not
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 3.0, or 1e3 written for 1000
            return int(value)
        raise bad()
    if tp is float:
        if isinstance(value, str) and _NUMERIC_TEXT.fullmatch(value.strip()):
            number = float(value.replace("_", ""))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise bad()
        if not math.isfinite(number):
            raise bad("a finite float")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):  # set from code
            return os.fspath(value)
        raise bad()
    if origin in (list, tuple, set, frozenset):
        if not isinstance(value, (list, tuple)):
            raise bad()
        item = args[0] if args else Any
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):  # tuple[int, str]: per position
            if len(args) != len(value):
                raise bad()
            return tuple(_check(a, v, source, f"{dotted}[{i}]")
                         for i, (a, v) in enumerate(zip(args, value, strict=True)))
        return origin(_check(item, v, source, f"{dotted}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad()
        kt, vt = args or (Any, Any)
        return {_check(kt, k, source, f"{dotted}.<key>"): _check(vt, v, source, f"{dotted}.{k}")
                for k, v in value.items()}
    if isinstance(tp, type) and not isinstance(value, tp):
        raise bad()
    return value


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)  # resolves the string annotations of `from __future__ import annotations`


def _build(cls: type, values: dict[str, Any], source: str, path: str = "") -> Any:
    """``cls`` from ``values``: unknown and missing fields, every value's type (recursing into
    nested sections) and then ``__post_init__``'s ranges, each error naming ``source`` and the
    dotted field."""
    here = f"{source}.{path}" if path else source
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {path or 'top level'}: expected a mapping of fields, got {_got(values)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(values) - set(fields)
    renamed = {f"{path}.{n}" if path else n for n in map(str, unknown)} & set(RENAMED_FIELDS)
    if renamed:
        old = min(renamed)
        raise ConfigError(f"{source}: {old} was renamed {RENAMED_FIELDS[old]} (same meaning)")
    if unknown:
        raise ConfigError(f"{here}: unknown field(s) {sorted(map(str, unknown))}; valid: {sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{here}: missing field(s) {missing}")
    types_ = _field_types(cls)
    kwargs = {}
    for name, value in values.items():
        dotted = f"{path}.{name}" if path else name
        tp = types_[name]
        if value is None and dataclasses.is_dataclass(tp):
            value = {}  # an empty section (`rl:` with nothing under it) keeps the defaults
        kwargs[name] = _check(tp, value, source, dotted)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, KeyError) as e:  # __post_init__'s ranges, checked names
        msg = str(e.args[0]) if e.args else type(e).__name__
        prefix = path if path and not msg.startswith(f"{path}.") else ""
        raise ConfigError(f"{source}: {prefix + ': ' if prefix else ''}{msg}") from None


def config_from_dict(values: dict[str, Any], where: str = "config") -> TrainConfig:
    """A checked TrainConfig from plain values; errors start with ``where`` (e.g. the file)."""
    return _build(TrainConfig, values, where)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            values = load_yaml(f.read())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not a config: nested too deeply") from None
    except YamlRefused as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {_got(values)}")
    return values


def load_config(path: str | Path) -> TrainConfig:
    """Load a TrainConfig from YAML; errors name the file and the field."""
    return config_from_dict(_read_yaml(path), where=str(path))


def _overlay(cfg: TrainConfig, sections: dict[str, Any], where: str) -> TrainConfig:
    """``cfg`` with ``sections`` laid over it field by field, checked; errors start with ``where``."""
    base = config_to_dict(cfg)
    for section, sub in sections.items():
        if isinstance(base.get(section), dict) and sub is None:
            continue  # an empty section changes nothing (not: back to the defaults)
        if isinstance(sub, dict) and isinstance(base.get(section), dict):
            base[section].update(sub)
        else:
            base[section] = sub
    return config_from_dict(base, where=where)


def merge_yaml(cfg: TrainConfig, path: str | Path) -> TrainConfig:
    """``cfg`` with the sections of a YAML file laid over it field by field."""
    return _overlay(cfg, _read_yaml(path), str(path))


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["rl"]["variant"] = cfg.rl.variant.value
    d["device"], d["dtype"] = cfg.device.value, cfg.dtype.value
    return d


def _leaves(values: dict[str, Any], path: str = "") -> list[str]:
    """The dotted names of the fields ``values`` sets (``{"rl": {"variant": "sync"}}`` -> ``rl.variant``)."""
    out = []
    for name, value in values.items():
        dotted = f"{path}.{name}" if path else str(name)
        out += _leaves(value, dotted) if isinstance(value, dict) and value else [dotted]
    return out


def _at(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def file_fields(path: str | Path) -> list[str]:
    """The dotted names of the fields the YAML file ``path`` sets."""
    return _leaves(_read_yaml(path))


def replaced_file_values(path: str | Path, from_file: TrainConfig, final: TrainConfig) -> list[str]:
    """One line per field that the YAML file ``path`` sets and that a later layer (an option given
    on the command line) changed between ``from_file`` (the config as the file left it) and
    ``final``: a setting given twice is resolved in the later one's favour, said aloud, never
    silently. Empty when nothing the file set was replaced."""
    file_d, final_d = config_to_dict(from_file), config_to_dict(final)
    return [f"{dotted}: {_at(final_d, dotted)!r} from the command line replaces {_at(file_d, dotted)!r} from {path}"
            for dotted in file_fields(path) if _at(file_d, dotted) != _at(final_d, dotted)]


def with_overrides(cfg: TrainConfig, **sections: Any) -> TrainConfig:
    """Copy ``cfg`` replacing fields per section, e.g. ``with_overrides(cfg, rl={"steps": 5})``;
    checked like a file (laid over it the same way), errors start with 'overrides'."""
    return _overlay(cfg, sections, "overrides")
