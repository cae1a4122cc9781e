"""YAML run configs: read, apply `--set key=value` overrides, validate every key and value."""

from __future__ import annotations

import contextlib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import yaml

from tracelm.io.files import MiB, read_regular_text
from tracelm.state.errors import TracelmError, cut, shown
from tracelm.state.run_config import RunConfig

_SCALARS = (int, float, str, bool)


def _apply_override(tree: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise TracelmError(f"--set {item!r}: expected key=value")
    node = tree
    *parents, leaf = key.split(".")
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise TracelmError(f"--set {key}: {p} is not a section")
        node = child
    try:
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        node[leaf] = raw
    except ValueError as e:  # an integer past Python's limit of digits
        raise TracelmError(f"--set {key}: cannot read {shown(raw)}: {str(e).split(';')[0]}") from None


def _check(value: Any, kind: Any, key: str) -> Any:
    """Check one YAML value against a field's annotated type; return it converted."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        return _check(value, next(o for o in options if o is not type(None)), key)
    if origin is tuple:
        args = typing.get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of X (a mapping: its items as pairs)
            items = value if isinstance(value, list | tuple) else [value]
            items = list(value.items()) if isinstance(value, dict) else items
            return tuple(_check(x, args[0], key) for x in items)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise TracelmError(f"config key {key}: expected {len(args)} values, got {value!r}")
        return tuple(_check(x, a, key) for x, a in zip(value, args, strict=True))
    if attrs.has(kind):
        if not isinstance(value, dict):
            raise TracelmError(f"config key {key}: expected a section of keys, got {value!r}")
        return _build(kind, value, key + ".")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise TracelmError(f"config key {key}: {shown(value)} is too large for a number") from None
    if kind is float and isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) and JSON's NaN as text
        with contextlib.suppress(ValueError):
            return float(value)
    if kind in _SCALARS and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise TracelmError(f"config key {key}: expected {kind.__name__}, got {shown(value)}")
    return value


def _build(cls: type, tree: dict[str, Any], prefix: str = "") -> Any:
    fields = {f.name: f for f in attrs.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in tree:
        if key not in fields:
            raise TracelmError(f"unknown config key {prefix}{key} (known: {', '.join(fields)})")
    kwargs = {k: _check(val, hints[k], prefix + k) for k, val in tree.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        message = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)  # attrs' in_ adds 3 more args
        bad = next((f"{prefix}{k}" for k in kwargs if k in message), prefix.rstrip(".") or "config")
        raise TracelmError(f"config key {bad}: {cut(message)}") from None


PACKAGED = Path(__file__).resolve().parents[1] / "configs"  # configs shipped in the package (configs/ links here)


def packaged_configs() -> list[str]:
    """Names of the configs shipped with tracelm (`tracelm run smollm2` reads configs/smollm2.yaml)."""
    return sorted(p.stem for p in PACKAGED.glob("*.yaml"))


def positional_is_model(value: str) -> bool:
    """`tracelm run CONFIG_OR_MODEL`: False for a YAML config (a .yaml or .yml path, or the name of a packaged
    config that is no file here), True for anything else (a registry name, a model file or folder, hf:ORG/REPO)."""
    if Path(value).suffix in (".yaml", ".yml"):
        return False
    return Path(value).expanduser().exists() or value not in packaged_configs()


def config_path(path: str | Path) -> Path:
    """A config file: `path` itself, or a packaged config named `path` (with or without .yaml)."""
    p = Path(path)
    if p.exists():
        return p
    shipped = PACKAGED / (p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml")
    if p.parent == Path(".") and shipped.exists():
        return shipped
    names = packaged_configs()
    if p.stem in names:  # configs/smollm2.yaml outside the source tree: the packaged one has that name
        hint = f"; the packaged config of that name is named without a path: `tracelm run {p.stem}`"
    else:
        hint = f", nor a packaged config (packaged: {', '.join(names)}; named without a path)"
    raise TracelmError(f"{path}: no such config file{hint}; a model is named with --model NAME")


def _model_file(name: str, config: Path) -> str:
    """A config's relative `model` or `tokenizer` path: from the working directory, else beside the config, else in
    the model cache (TRACELM_HOME/models: where a packaged config's files that tracelm cannot download go)."""
    from tracelm.io.registry import home

    if Path(name).expanduser().exists():
        return name
    for base in (config.parent, home() / "models"):
        if (base / name).exists():
            return str(base / name)
    return name


def load_run_config(path: str | Path | None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read a YAML config (a path, or the name of a packaged config; the defaults when None), apply overrides,
    validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = config_path(path)
        text = read_regular_text(path, "config", 16 * MiB)
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise TracelmError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
        except (ValueError, RecursionError) as e:  # an integer past Python's limit of digits, a nest too deep
            raise TracelmError(f"{path}: not a config tracelm reads: {str(e).split(';')[0]}") from None
        if not isinstance(tree, dict):
            raise TracelmError(f"{path}: a config is a mapping of keys, got {type(tree).__name__}")
        for key in ("model", "tokenizer"):  # a relative path: see _model_file
            model = tree.get(key)
            if isinstance(model, str) and ("/" in model or model.endswith((".gguf", ".bin"))):
                tree[key] = _model_file(model, Path(path))
    for item in overrides:
        _apply_override(tree, item)
    return _build(RunConfig, tree)


def config_as_dict(cfg: RunConfig) -> dict[str, Any]:
    return attrs.asdict(cfg, value_serializer=lambda _i, _f, v: list(v) if isinstance(v, tuple) else v)


def run_config_from_dict(tree: dict[str, Any], source: str = "config") -> RunConfig:
    """Rebuild a RunConfig from `config_as_dict` output (e.g. a trace header), validating every key."""
    if not isinstance(tree, dict):
        raise TracelmError(f"{source}: a config is a mapping of keys, got {type(tree).__name__}")
    try:
        return _build(RunConfig, dict(tree))
    except TracelmError as e:
        raise TracelmError(f"{source}: {e}") from None


def record_from_dict(cls: type, tree: dict[str, Any], prefix: str = "") -> Any:
    """Rebuild any attrs record of the run config (e.g. SamplingParams) from a dict, validating every key."""
    if not isinstance(tree, dict):
        raise TracelmError(f"{prefix or cls.__name__}: expected a mapping of keys, got {type(tree).__name__}")
    return _build(cls, dict(tree), prefix)
