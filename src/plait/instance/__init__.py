"""One plait process (`Instance`, in `runtime`) and how it builds its HTTP API and its
replication transport from its configuration."""

from plait.instance.runtime import Instance

__all__ = ["Instance"]
