"""Small elementwise steps of the packed forward compiled into one kernel each (torch.compile),
with their eager code as the fallback. Each eager version moves its tensor through memory two or
three times; a big MoE's forward spent 30% of its time in them on an H100 (BENCHMARKS.md).

The default dynamic mode keeps the widths static (aligned, vectorized loads) and makes a
dimension dynamic at its first change: two compiles per function at most, seconds once per
process. Switched off for good, with the reason, the first time a compile or a call fails (no
Triton, say); the caller then runs the eager code.
"""

from __future__ import annotations

import torch


class Compiled:
    ok = True
    why = ""
    fns: dict = {}


def compiled(fn, *args) -> torch.Tensor | None:
    """`fn(*args)` compiled; None once the compiled path has failed (the caller runs `fn` eagerly)."""
    if not Compiled.ok:
        return None
    try:
        if fn not in Compiled.fns:
            Compiled.fns[fn] = torch.compile(fn, fullgraph=True)
        return Compiled.fns[fn](*args)
    except torch.OutOfMemoryError:  # the pack's size, not the compile: the caller's to handle
        raise
    except Exception as e:  # inductor raises many types (no Triton, a backend error): fall back for good
        Compiled.ok, Compiled.why = False, f"{type(e).__name__}: {str(e)[:200]}"
        return None


def compiled_path() -> str:
    return "compiled" if Compiled.ok else f"eager ({Compiled.why})"
