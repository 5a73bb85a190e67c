"""The GPU path (docs/gpu.md): CUDA driver calls, device tensors by IPC, pinned arenas.
Imported only where a GPU path is asked for."""
