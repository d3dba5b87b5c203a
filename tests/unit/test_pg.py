"""Process-group helpers that need no process group: the NCCL environment and backend resolution."""

from __future__ import annotations

import os

import torch

from resilient.runtime.coordination.pg import nccl_env, resolve_backend


def test_nccl_env_sets_what_in_process_recovery_needs():
    env: dict[str, str] = {"PATH": "/bin"}
    got = nccl_env(env)
    assert got == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
    assert env == {"PATH": "/bin", **got}


def test_nccl_env_keeps_the_users_values():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    got = nccl_env(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert got == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}


def test_nccl_env_with_a_dict_leaves_the_process_environment_alone():
    before = dict(os.environ)
    nccl_env({})
    assert dict(os.environ) == before


def test_resolve_backend():
    assert resolve_backend("gloo") == "gloo"
    assert resolve_backend("nccl") == "nccl"
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")


def test_abort_uses_the_nccl_abort_for_nccl_groups(monkeypatch):
    import torch.distributed as dist

    from resilient.runtime.coordination.pg import Group

    calls: list[str] = []
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda *a, **k: calls.append("abort"))
    g = Group(backend="nccl", generation=3, store_port=1234)
    assert g.abort() == 1
    assert g.abort() == 0  # idempotent
    assert calls == ["abort"]


def test_gloo_abort_never_touches_listeners_or_store_connections():
    import socket

    from resilient.runtime.coordination.pg import Group

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    store_like = socket.create_connection(listener.getsockname())  # peer port == "store" port
    served, _ = listener.accept()
    other_listener = socket.socket()
    other_listener.bind(("127.0.0.1", 0))
    other_listener.listen()
    peer = socket.create_connection(other_listener.getsockname())
    accepted, _ = other_listener.accept()
    try:
        fds = {
            s.fileno(): f"socket:[{__import__('os').fstat(s.fileno()).st_ino}]"
            for s in (listener, store_like, served, peer)
        }
        g = Group(backend="gloo", generation=0, store_port=listener.getsockname()[1], _sockets=fds)
        assert g.abort() == 1  # only the gloo-like peer connection
        assert accepted.recv(1) == b""  # its far end sees the connection closed at once
        store_like.sendall(b"x")
        assert served.recv(1) == b"x"  # the store connection still works
    finally:
        for s in (listener, store_like, served, other_listener, peer, accepted):
            s.close()


def test_a_node_store_connection_accepted_while_a_group_is_built_survives_its_abort():
    # the node leader hosts its node's store: a peer's connection that the server accepts while
    # the leader builds its group (a monitor thread's, opened late) is not one of gloo's
    import os
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from resilient.runtime.coordination import node
    from resilient.runtime.coordination.pg import Group, _socket_inodes

    job = dist.HashStore()
    got = node.link(job, "node/k", rank=0, local_rank=0, size=2, timeout=5.0, forever=5.0)
    assert isinstance(got, node.NodeLink)
    before = _socket_inodes()
    late = dist.TCPStore("127.0.0.1", got.server.port, None, False, timeout=timedelta(seconds=5))
    late.set("x", "1")  # (the server has accepted it: its end is now one of this process's fds)
    peer_listener = socket.socket()
    peer_listener.bind(("127.0.0.1", 0))
    peer_listener.listen()
    gloo_like = socket.create_connection(peer_listener.getsockname())
    far, _ = peer_listener.accept()
    try:
        new = {fd: ino for fd, ino in _socket_inodes().items() if before.get(fd) != ino}
        far_ino = f"socket:[{os.fstat(far.fileno()).st_ino}]"
        new = {fd: ino for fd, ino in new.items() if ino != far_ino and fd != peer_listener.fileno()}
        g = Group(backend="gloo", generation=0, store_port=12345, _sockets=new)  # (the job store's elsewhere)
        assert g.abort() == 1  # the gloo-like connection only
        assert far.recv(1) == b""
        assert late.get("x") == b"1" and got.store.get("x") == b"1"  # the node store's links still work
    finally:
        for s in (peer_listener, gloo_like, far):
            s.close()
        got.close()
