"""torch TCPStores that listen only where they are told.

Given a host name, a master TCPStore still binds every interface (`[::]`), and it authenticates nobody:
a one-node job's learner rendezvous and weight-sync store would be open to the network. The master here
listens on a socket bound to exactly `host` (runbase.net.bound_listener), handed to the store by its
descriptor; clients dial as usual.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from runbase.net import bound_listener


def master_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The store's server, listening on `host`:`port` only (port 0: a free one; read `.port`)."""
    sock = bound_listener(host, port)
    # detach(): the store owns the descriptor from here on; a Python socket object would close it
    # when collected while the store's server still polls it
    return dist.TCPStore(host, sock.getsockname()[1], None, is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=sock.detach())


def client_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the store at `host`:`port`, waiting up to `timeout` for it to come up."""
    return dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
