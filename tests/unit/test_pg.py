"""Process-group helpers that need no process group: the NCCL environment and backend resolution."""

from __future__ import annotations

import os

import torch

from resilient.runtime.pg import nccl_env, resolve_backend


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
