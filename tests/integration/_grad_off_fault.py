"""A training function that leaves autograd off when it faults (as an interrupt that lands inside
torch's own no-grad region does) and must find it on when it re-enters."""

import torch

import resilient

faulted = []  # (this process's memory: the fault fires once)


@resilient.wrap(hang_timeout=5)
def train(ctx: resilient.Context) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=opt)
    for step in ctx.steps(8):
        if step == 5 and not faulted:
            faulted.append(step)
            torch.set_grad_enabled(False)  # (and never back: the fault skips it)
            raise RuntimeError("fault with autograd off")
        loss = model(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()  # (raises "does not require grad" where autograd stayed off)
        opt.step()


if __name__ == "__main__":
    train()
