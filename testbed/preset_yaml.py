"""A preset file's values, read as OmegaConf reads them, on libyaml.

`OmegaConf.to_container(OmegaConf.load(path), resolve=True)` parses with
PyYAML's pure-Python loader, ~20 ms for a preset file; a simulated run reads
about seven (hardware, engine, link, model), a tenth of a second of its
start-up. `load_yaml` gives the same values with OmegaConf's rules (its
loader's implicit resolvers: floats such as 1e-3, no timestamps; a duplicate
key refused) on PyYAML's C parser, ~1 ms a file. A file that OmegaConf would
treat otherwise (interpolations, a top level that is not a mapping) is read
by OmegaConf itself."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf


@lru_cache(maxsize=1)
def _loader() -> type:
    from omegaconf._utils import get_yaml_loader      # the loader OmegaConf.load uses: its rules, not a copy
    rules = get_yaml_loader()
    base = getattr(yaml, "CSafeLoader", None)
    if base is None:                # PyYAML built without libyaml: OmegaConf's own loader
        return rules

    class PresetLoader(base):
        yaml_implicit_resolvers = rules.yaml_implicit_resolvers

        def construct_mapping(self, node: yaml.Node, deep: bool = False) -> Any:
            keys = set()
            for key_node, _ in node.value:
                if key_node.tag != yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                    continue
                if key_node.value in keys:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found duplicate key {key_node.value}", key_node.start_mark)
                keys.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    return PresetLoader


def load_yaml(path: str | Path) -> Any:
    """OmegaConf.to_container(OmegaConf.load(path), resolve=True), faster."""
    with open(path, encoding="utf-8") as f:
        data = yaml.load(f, Loader=_loader())
    if data is None:
        return {}
    if not isinstance(data, dict) or not _plain(data):
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return data


def _plain(value: Any) -> bool:
    """Values OmegaConf passes through unchanged: no interpolation, no type it would refuse or convert."""
    if isinstance(value, str):
        return "${" not in value
    if isinstance(value, dict):
        return all(type(k) in (str, int) and _plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(map(_plain, value))
    return value is None or type(value) in (int, float, bool)
