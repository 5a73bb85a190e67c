"""The server's process roles: coordinator, batcher, workers (python -m shmserve.server.<role>)."""
