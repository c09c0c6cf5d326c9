"""Instance configuration: YAML in, clear `ConfigError`s out (R-OP-4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from plait.config import InstanceConfig
from plait.errors import ConfigError
from plait.options import Options
from plait.replication.handler_options import HandlerOptions
from plait.replication.redis_options import RedisOptions
from plait.replication.tcp_options import TcpOptions
from plait.storage.timeouts import DatabaseTimeouts

GOOD = """
instance_name: worker1
streams:
  - name: events
    tables: [{name: events}]
    writers: [master, worker1]
  - name: typing
    kind: memory
    writers: [master]
http: {port: 8082, secret: s3cret}
replication:
  transport: tcp
  tcp: {hub: master, port: 9093}
"""


def test_a_yaml_file_becomes_a_config_with_stream_specs(tmp_path: Path) -> None:
    path = tmp_path / "plait.yaml"
    path.write_text(GOOD)
    config = InstanceConfig.from_yaml(path)
    assert config.instance_name == "worker1"
    assert config.channel == "plait.plait"
    spec = config.streams[0].to_spec()
    assert (spec.sequence, spec.writers) == ("events_seq", ("master", "worker1"))
    assert config.http.secret is not None
    assert "s3cret" not in repr(config)  # secrets stay out of logs
    assert config.replication.tcp is not None
    assert config.replication.tcp.hub == "master"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "instance_name: Field required"),
        ({"instance_name": "a b"}, "instance_name: String should match"),
        ({"instance_name": "a", "colour": 1}, "colour: Extra inputs are not permitted"),
        ({"instance_name": "a", "replication": {"transport": "tcp"}}, "needs a tcp section"),
        ({"instance_name": "a", "replication": {"transport": "kafka"}}, "transport"),
        ({"instance_name": "a", "streams": [{"name": "t", "kind": "memory"}]}, "writers listed"),
        ({"instance_name": "a", "streams": [{"name": "bad name", "tables": []}]}, "stream name"),
        ({"instance_name": "a", "streams": [{"name": "e"}]}, "needs at least one table"),
        (
            {"instance_name": "a", "streams": [{"name": "e", "tables": [{"name": "e"}]}] * 2},
            "listed twice",
        ),
        (
            {"instance_name": "a", "replication": {"catch_up_page": 500, "catch_up_page_max": 100}},
            "catch_up_page must not exceed",
        ),
        # YAML's .inf and .nan are floats too: no setting means "never" by them.
        (
            {"instance_name": "a", "fence_after": float("inf")},
            "fence_after: Input should be a finite number",
        ),
        (
            {"instance_name": "a", "replication": {"announce_interval": float("nan")}},
            "announce_interval: Input should be a finite number",
        ),
    ],
)
def test_bad_configs_say_what_is_wrong(value: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="invalid plait configuration") as err:
        InstanceConfig.load(value)
    assert message in str(err.value)


def test_bad_files_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        InstanceConfig.from_yaml(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("instance_name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        InstanceConfig.from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top"):
        InstanceConfig.from_yaml(tmp_path / "list.yaml")
    # A value of the wrong kind: the message names the file, as YAML errors do.
    (tmp_path / "port.yaml").write_text("instance_name: a\nhttp:\n  port: notaport\n")
    with pytest.raises(ConfigError) as err:
        InstanceConfig.from_yaml(tmp_path / "port.yaml")
    assert str(err.value).startswith(f"invalid configuration file {tmp_path / 'port.yaml'}: ")
    assert "http.port" in str(err.value)


@pytest.mark.parametrize(
    ("options", "values", "named"),
    [
        (TcpOptions, {"ping_interval": 0}, "ping_interval"),
        (RedisOptions, {"connect_timeout": -1}, "connect_timeout"),
        (HandlerOptions, {"catch_up_page": 500, "catch_up_page_max": 100}, "catch_up_page"),
        (DatabaseTimeouts, {"keepalives_count": 0}, "keepalives_count"),
        (TcpOptions, {"pingg_interval": 5}, "pingg_interval"),
    ],
)
def test_an_options_model_built_with_a_bad_value_names_the_setting(
    options: type[Options], values: dict[str, Any], named: str
) -> None:
    """The components' options, built directly (not from a configuration file), check
    their bounds once, in the model, and name the setting."""
    with pytest.raises(ValidationError, match=named):
        options(**values)
