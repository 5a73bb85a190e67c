"""Network fronts: processes that serve the engine to callers over HTTP (KServe v2)."""
