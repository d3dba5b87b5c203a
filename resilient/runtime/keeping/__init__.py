"""Where state goes besides the in-memory ring (shared memory, the store copy, durable
checkpoints), when it is kept, and where a (re)started process takes it from."""
