"""The caller's side: a lease on a running server."""
from .client import Client, InferResult, StreamResponse  # noqa: F401
