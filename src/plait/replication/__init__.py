"""Replication: moving positions and rows between instances (Redis pub/sub, TCP on one
host, HTTP calls), with the pure protocol in `plait.core`."""
