"""The replication transport an instance's configuration names: Redis pub/sub, or TCP
as the hub (the instance `replication.tcp.hub` names) or as one of its clients."""

from __future__ import annotations

from plait.config import InstanceConfig
from plait.core.backoff import Backoff
from plait.replication.handler import ReplicationHandler
from plait.replication.metrics import ReplicationMetrics
from plait.replication.redis_transport import RedisTransport
from plait.replication.tcp_client import TcpClient
from plait.replication.tcp_transport import TcpHub

Transport = RedisTransport | TcpHub | TcpClient


def make_transport(
    config: InstanceConfig, handler: ReplicationHandler, metrics: ReplicationMetrics
) -> Transport:
    """The transport of `config.replication` (not "none"), for `handler`; not started."""
    replication = config.replication
    backoff = Backoff(initial=replication.backoff_initial, cap=replication.backoff_cap)
    secret = replication.secret_value()
    if replication.transport == "redis":
        return RedisTransport(
            handler,
            replication.redis,
            channel=config.channel,
            secret=secret,
            backoff=backoff,
            metrics=metrics,
        )
    tcp = replication.tcp
    assert tcp is not None  # the configuration requires it with transport "tcp"
    if tcp.hub == config.instance_name:
        return TcpHub(handler, tcp, secret=secret, metrics=metrics)
    return TcpClient(handler, tcp, secret=secret, backoff=backoff, metrics=metrics)
