"""One rank of the layout test: FSDP2 over tensor parallel on a 2x2 mesh (env:// rendezvous, gloo).

For every DTensor the model and its AdamW state hold, the global indices the runtime's
resharding computes from the saved layout alone must select exactly this rank's local shard
out of the gathered tensor. Prints how many were checked; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from resilient.checkpoint.reshard import held_indices
from resilient.state.dtensor import MARK, to_portable


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])  # over the tensor-parallel shards: _StridedShard rows
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    tensors = [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
    kinds: set[str] = set()
    checked = 0
    for t in tensors:
        if not isinstance(t, DTensor):
            continue
        leaf = to_portable({"t": t})["t"]
        spec = leaf[MARK]
        kinds.update(p[0] for p in spec["placements"])
        idx = held_indices(spec, dist.get_rank())
        assert idx is not None
        full = t.full_tensor()
        picked = full[torch.meshgrid(*idx, indexing="ij")] if idx else full
        assert torch.equal(picked, leaf["local"]), (spec, idx, leaf["local"].shape)
        checked += 1
    print(f"checked {checked} kinds {sorted(kinds)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
