"""plait's error tree: every error a caller can meet is a PlaitError of the kind that
says what the caller can do about it, and is exported from `plait`."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from http_api_helpers import MakeClient, StartApi
from plait import (
    ConfigError,
    Database,
    Instance,
    PlaitError,
    RemoteCallError,
    StateError,
)
from plait.ports import free_port
from stream_helpers import create_generator, create_table


def test_every_error_type_plait_defines_is_a_plait_error_exported_from_plait() -> None:
    import plait.errors

    defined = {
        name
        for name, value in vars(plait.errors).items()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == "plait.errors"
    }
    assert defined, "no error types found"
    for name in defined:
        assert issubclass(getattr(plait.errors, name), PlaitError), name
        assert getattr(plait, name) is getattr(plait.errors, name), f"{name} not exported"
        assert name in plait.__all__, name
    # The pure core's own contract errors are plait's too.
    from plait.core.positions import PositionError, SequenceWentBackwardsError

    assert issubclass(SequenceWentBackwardsError, PositionError)
    assert issubclass(PositionError, PlaitError)


async def test_a_closed_generator_is_a_state_error_not_a_configuration_error(
    db: Database,
) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    await gen.close()
    with pytest.raises(StateError, match="is closed") as closed:
        await gen.insert("INSERT INTO events (stream_id, instance_name) VALUES ({id}, 'w')")
    assert not isinstance(closed.value, ConfigError)


async def test_an_instance_used_in_the_wrong_state_is_a_state_error(dsn: str) -> None:
    config = {
        "instance_name": "w",
        "database": dsn,
        "streams": [{"name": "typing", "kind": "memory", "writers": ["w"]}],
        "replication": {"transport": "tcp", "tcp": {"hub": "w", "port": free_port()}},
    }
    instance = Instance(config)

    async def handler(args: Any) -> None:
        return None

    with pytest.raises(StateError, match="is not started"):
        instance.db  # noqa: B018 - the property is what raises
    async with instance:
        with pytest.raises(StateError, match="started already"):
            await instance.start()
        with pytest.raises(StateError, match="before start"):
            instance.register_endpoint("late", handler)


async def test_a_failed_remote_call_says_its_http_status(
    start_api: StartApi, make_client: MakeClient
) -> None:
    """The caller tells a 404 (no such stream there) from a 401 (secrets differ) from no
    answer at all by `status`, not by the message's words."""
    api = await start_api(secret="s3cret")
    wrong = make_client({"server": api.url}, secret="other")
    with pytest.raises(RemoteCallError) as refused:
        await wrong.call("server", "echo", 1)
    assert refused.value.status == 401
    right = make_client({"server": api.url}, secret="s3cret")
    with pytest.raises(RemoteCallError) as missing:
        await right.catch_up("server", "nosuchstream", 0, 5, 10)
    assert missing.value.status == 404
    nobody = make_client({"server": f"http://127.0.0.1:{free_port()}"}, retry_for=0.2)
    with pytest.raises(RemoteCallError, match="gave up") as unanswered:
        await nobody.call("server", "echo", 1)
    assert unanswered.value.status is None
