"""The base of plait's options models: a component's settings, with their defaults and
bounds written once, in a pydantic model that the component takes as it is and the
configuration extends (`TcpOptions`, `RedisOptions`, `HandlerOptions`,
`DatabaseTimeouts`).

A model built directly with a bad value raises pydantic's `ValidationError`, a
`ValueError` naming each setting. It is not turned into plait's `ConfigError` here:
pydantic runs a model's own `__init__` when it validates it inside another, so a
wrapped error would lose the setting's path in a configuration file's message
(`InstanceConfig.load` turns those into one `ConfigError`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, SecretStr


class Options(BaseModel):
    """Frozen, no unknown settings, no .inf or .nan (every interval and bound is a real
    number); the docstring under each field is its description (the configuration
    reference in docs/ is generated from them)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )


def revealed(secret: SecretStr | None) -> str | None:
    """A secret setting's value, for the one place that uses it (None when unset)."""
    return None if secret is None else secret.get_secret_value()
