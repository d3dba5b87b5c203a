"""The step loop: what ``ctx.track``, ``ctx.steps`` and ``ctx.epochs`` do, under either engine,
and what one generation holds."""
