"""The cluster launcher files validate against Ray's own schema and fit tidegraph's runs."""

from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("name", ["ray_cluster.yaml", "ray_cluster_gcp.yaml"])
def test_cluster_file_is_valid_for_ray_and_installs_tidegraph(name):
    config = yaml.safe_load((ROOT / name).read_text())
    # as `ray up` does: fill in the provider's defaults, then check against the schema file
    # inside the ray package (raises when invalid)
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = {k: v for k, v in types.items() if k != config["head_node_type"]}
    assert sum(v["max_workers"] for v in workers.values()) <= config["max_workers"]
    assert any(v["min_workers"] >= 1 for v in workers.values())  # one replica not on spot
    spot = [v["node_config"] for v in workers.values() if v["min_workers"] == 0]
    assert spot, "spot workers allowed"
    assert any("tidegraph" in c for c in config["setup_commands"])


def test_schema_rejects_what_it_should():
    config = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    config["available_node_types"]["head"]["not_a_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))
