"""``resilient launch``: a torchrun-compatible launcher on torch.distributed.elastic for hard faults."""
