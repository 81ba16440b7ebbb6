"""testbed/preset_yaml.py: a preset file's values exactly as OmegaConf reads them."""
import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from testbed.model.config import CONF_DIR
from testbed.preset_yaml import load_yaml


def omegaconf_values(path: Path):
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}


# (the files that interpolate go through OmegaConf itself: test_interpolation_goes_through_omegaconf)
PLAIN = [p for p in sorted(CONF_DIR.rglob("*.yaml")) if "${" not in p.read_text()]


@pytest.mark.parametrize("path", PLAIN, ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_every_conf_file_reads_as_omegaconf_reads_it(path):
    # json.dumps keeps key order and tells 1 from 1.0 and from true
    assert json.dumps(load_yaml(path)) == json.dumps(omegaconf_values(path))


def test_scalars_follow_omegaconf_rules(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("a: 1e-3\nb: 2001-12-14\nc: 1_000\nd: .5\ne: -.inf\nf: 'x'\ng: [1, 2.0, true, null]\nh: 0x10\n")
    values = load_yaml(path)
    assert json.dumps(values) == json.dumps(omegaconf_values(path))
    assert values["a"] == 0.001 and values["b"] == "2001-12-14" and values["c"] == 1000


def test_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("a: 1\nb: 2\na: 3\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="found duplicate key a"):
        load_yaml(path)


def test_interpolation_goes_through_omegaconf(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("a: 4\nb: ${a}\n")
    assert load_yaml(path) == {"a": 4, "b": 4}
    (tmp_path / "e.yaml").write_text("")
    assert load_yaml(tmp_path / "e.yaml") == {}
