"""A node's ranks reach the job's store through one another: the node-local store.

At 16,384 ranks every request a rank sends the job's single ``TCPStore`` server on a fault is
16,384 requests, answered one at a time. So, when a job spans several nodes, each node's local
rank 0 hosts a small store of its own on the loopback interface, and its node's ranks hand each
other what they would otherwise each send the job's store:

- a **barrier**: each rank posts its payload and counts itself in on the node's store; the last
  of the node to arrive carries the node's payloads to the job's store as one block (weighing as
  many ranks as it holds), waits for the job's verdict and hands it back on the node's store;
- a **fault**: local rank 0's listener hears it on the job's store and copies it to the node's,
  where the node's other listeners wait;
- the **collective check**: ring neighbours on one node compare on the node's store; only a
  node's first rank posts its count to the job's store, for the previous node's last rank.

The job's server then sees O(nodes) requests per barrier and per fault, not O(ranks).

A loopback ``TCPStore`` rather than shared memory: its ``wait`` blocks without polling, its
server runs on a C++ thread of local rank 0's process (no GIL), and its failure is visible (a
reset connection) the moment that process dies. When it does, each of the node's survivors
records ``node_link_lost`` and goes on alone on the job's store (the flat protocol, which every
barrier accepts mixed with nodes' blocks); the dead rank itself is the launcher's to replace. A
replacement for local rank 0 finds the node's address taken by its predecessor and stays flat.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from resilient.runtime.coordination.pg import protect_store_port


class NodeLinkLost(RuntimeError):
    """The node's store is gone (its host, local rank 0, died)."""


def node_mode(setting: str, world_size: int, local_world_size: int) -> tuple[bool, bool]:
    """(barriers take blocks, this rank links to its node). ``auto``: when the job spans more than
    one node. Every rank of a job computes the same first value from the same config."""
    blocks = setting == "on" or (setting == "auto" and world_size > local_world_size)
    return blocks, blocks and local_world_size > 1


@dataclass
class NodeLink:
    """This rank's connections to its node's store, and the node's place in the job."""

    first: int  # the node's first global rank (torchrun numbers a node's ranks contiguously)
    size: int  # ranks on this node
    store: dist.Store  # the main thread's connection
    listener: dist.Store  # the fault listener's (never times out)
    monitor: dist.Store  # the monitor thread's
    leader: bool  # local rank 0: hosts the node's store and relays faults into it
    server: dist.Store | None = None  # held by the leader: the server lives as long as it does
    lost: str | None = None  # why the link is gone, once it is

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.size)

    def holds(self, rank: int) -> bool:
        return self.first <= rank < self.first + self.size

    def close(self) -> None:
        self.store = self.listener = self.monitor = self.server = None  # type: ignore[assignment]


def _connect(port: int, timeout: float) -> dist.Store:
    return dist.TCPStore(
        "127.0.0.1", port, None, False, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )


def link(
    job: dist.Store,
    key: str,
    rank: int,
    local_rank: int,
    size: int,
    timeout: float,
    forever: float,
    node: str | None = None,
) -> NodeLink | str:
    """Join this node's store (local rank 0 starts it and publishes where, under ``key`` in the
    job's store). Returns the link, or why this rank stays on the job's store alone. ``node``:
    which node this is (its host and launcher); a spare node that took a lost one's ranks finds
    the lost node's store published under the same key, and must not wait on its address."""
    node = node or socket.gethostname()
    first = rank - local_rank
    if local_rank == 0:
        server = dist.TCPStore(
            "127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        # (a peer's connection accepted while this rank builds a group is the store's, not gloo's)
        protect_store_port(server.port)
        token = uuid.uuid4().hex
        server.set("token", token)
        mine = f"{node} {server.port} {token}"
        if job.compare_set(key, "", mine).decode() != mine:
            return "local rank 0 of this launch attempt started before (this process replaces it)"
        listener, monitor = _connect(server.port, forever), _connect(server.port, timeout)
        return NodeLink(first, size, server, listener, monitor, True, server)
    try:
        host, port, token = job.get(key).decode().split()
        if host != node:
            return f"local rank 0's node store is on {host}, not here ({node})"
        protect_store_port(int(port))  # (a connection opened later, e.g. by a monitor thread)
        main = _connect(int(port), timeout)
        if main.get("token").decode() != token:
            return "the node store's address is another server's"
        listener, monitor = _connect(int(port), forever), _connect(int(port), timeout)
        return NodeLink(first, size, main, listener, monitor, False)
    except Exception as e:  # local rank 0 never published, or died since: the job's store alone
        return f"the node store of local rank 0 is unreachable ({type(e).__name__}: {e})"
