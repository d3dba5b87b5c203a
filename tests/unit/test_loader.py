"""A tracked DataLoader resumes mid-epoch: the same batches, the same global RNG stream after."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from resilient.state import Registry


class Noisy(Dataset):
    """Each read draws from the reading process's RNG (an augmentation)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


def _loader(workers: int, generator: bool) -> DataLoader:
    g = torch.Generator().manual_seed(7) if generator else None
    return DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=workers, generator=g)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True])
def test_a_loader_resumed_mid_epoch_continues_as_if_never_stopped(workers: int, generator: bool) -> None:
    torch.manual_seed(0)
    reg = Registry()
    ref = _loader(workers, generator)
    reg.add("loader", ref)
    it = iter(ref)
    seen = [next(it) for _ in range(3)]
    state = copy.deepcopy(reg.capture())  # the snapshot after the 3rd batch (the RNGs included)
    rest = [*it, torch.rand(3)]  # what a fault-free run sees next: the epoch's rest, then a draw
    epoch2 = [*ref]

    # a restart: everything rebuilt, the global RNG moved on, then the snapshot restored
    torch.manual_seed(123)
    again = _loader(workers, generator)
    reg2 = Registry()
    reg2.add("loader", again)
    reg2.load("loader", state["loader"])
    torch.set_rng_state(state["__rng__"]["torch"])
    resumed = [*again, torch.rand(3)]
    assert len(seen) + len(resumed) - 1 == len(ref)  # nothing consumed is read as a new batch
    for a, b in zip(rest, resumed, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(epoch2, [*again], strict=True):  # and the next epoch is the same as well
        assert torch.equal(a, b)


def test_a_tracked_loader_stays_a_loader_of_its_own_class() -> None:
    class Mine(DataLoader):
        pass

    loader = Mine(list(range(8)), batch_size=2)
    Registry().add("data", loader)
    assert isinstance(loader, Mine) and [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert loader.state_dict()["consumed"] == 4


def test_an_iterable_dataset_is_read_again_up_to_the_restored_position() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(10))

    reg = Registry()
    loader = DataLoader(Stream(), batch_size=3)
    reg.add("loader", loader)
    it = iter(loader)
    next(it)
    state = copy.deepcopy(reg.capture()["loader"])
    again = DataLoader(Stream(), batch_size=3)
    reg2 = Registry()
    reg2.add("loader", again)
    reg2.load("loader", state)
    assert [b.tolist() for b in again] == [[3, 4, 5], [6, 7, 8], [9]]


def _stateful(workers: int, generator: bool, persistent: bool = False):  # type: ignore[no-untyped-def]
    sdl = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    g = torch.Generator().manual_seed(7) if generator else None
    return sdl.StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=workers, generator=g,
                                  persistent_workers=persistent)  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True])
@pytest.mark.parametrize("at", [3, 10])  # mid-pass, and after the pass's last batch (10 a pass)
def test_a_stateful_loader_resumed_continues_as_if_never_stopped(
    workers: int, generator: bool, at: int
) -> None:
    # torchdata's StatefulDataLoader resumes its position itself; tracked, its iterator is
    # re-created without drawing its seeds from the restored RNG again, its worker processes
    # read the consumed batches again (their RNGs are no part of its state), and a pass restored
    # at its end goes on with the next one
    torch.manual_seed(0)
    reg = Registry()
    ref = _stateful(workers, generator)
    reg.add("loader", ref)
    it = iter(ref)
    seen = [next(it) for _ in range(at)]
    state = copy.deepcopy(reg.capture())
    rest = [*it, torch.rand(3)]  # the pass's rest (nothing at its end), then a draw
    epoch2 = [*ref]

    torch.manual_seed(123)
    again = _stateful(workers, generator)
    reg2 = Registry()
    reg2.add("loader", again)
    reg2.load("loader", state["loader"])
    torch.set_rng_state(state["__rng__"]["torch"])
    if at == len(ref):  # (an epoch loop's next iter() is the next pass, as in the first run)
        resumed = [torch.rand(3)]
        nxt = [*again]
    else:
        resumed = [*again, torch.rand(3)]
        nxt = [*again]
    assert len(seen) + len(resumed) - 1 == len(ref)
    for a, b in zip(rest, resumed, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(epoch2, nxt, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_restored_at_its_pass_s_end_begins_the_next_pass_at_the_next_iter(workers: int) -> None:
    # a manual epoch loop (`if step % len(loader) == 0: batches = iter(loader)`) restored at an
    # epoch's first step: the snapshot came after the last batch, before the next iter(); the
    # next iter() is the next epoch, as in the run that was not stopped (not the old one's end:
    # StopIteration, every time, found by the soak in examples/train_pipeline.py)
    torch.manual_seed(0)
    reg = Registry()
    ref = _loader(workers, False)
    reg.add("loader", ref)
    first = [*ref]
    state = copy.deepcopy(reg.capture())  # every batch of the pass yielded
    epoch2 = [*ref]

    torch.manual_seed(123)
    again = _loader(workers, False)
    reg2 = Registry()
    reg2.add("loader", again)
    reg2.load("loader", state["loader"])
    torch.set_rng_state(state["__rng__"]["torch"])
    resumed = [*again]
    assert len(resumed) == len(first) == len(epoch2)
    for a, b in zip(epoch2, resumed, strict=True):
        assert torch.equal(a, b)
