"""How the harness words a failed request in its reports (one line, bounded)."""
from __future__ import annotations


def error_text(e: BaseException) -> str:
    msg = getattr(e, "msg", None) or str(e) or repr(e)
    return f"{type(e).__name__}: {msg}"[:200]
