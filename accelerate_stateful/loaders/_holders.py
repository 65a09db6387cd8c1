"""What keeps a live pass's iterator reachable at a save, where the program may believe it let it go.

A checkpoint records a pass whose iterator the program still reaches as live, and the resumed run continues
it. That is right for a loop that holds its iterator (``for batch in dl:`` around the save); it is not what a
program meant that dropped its iterator (``del it``) while an exception it kept (``self.last_error = exc``)
still holds, through its traceback, the frame of a function that had returned with the iterator in a local
variable. The uninterrupted run then starts the next epoch at its next ``iter()``; the resumed one would
continue the saved pass. Both are reachable iterators: the difference is intent, which no rule can read,
so the save says it (one warning naming the variable and the function), never silently.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import Any, Optional


def kept_by_a_traceback(iterator: Any) -> Optional[str]:
    """Where ``iterator`` is held only through a finished frame that a traceback keeps: that frame's variable,
    function and line, in words; ``None`` when a running frame, a generator or any other object holds it.

    A query: it reads the referrers (a scan of the heap, cheaper than the collection the save made), and it
    leaves no garbage. Frame objects it touches are dropped before it returns: one kept in a reference cycle
    (a list of frames that holds this function's own frame) would keep other threads' frames past their end,
    with their last locals, and CPython 3.12's collector crashes on some of those (a ``multiprocessing``
    feeder thread's pickled ``BytesIO`` buffer: "deallocated BytesIO object has exported buffers").
    """
    holders = gc.get_referrers(iterator)
    if not all(isinstance(holder, types.FrameType) for holder in holders):
        return None  # a list, a dict, a generator: the program keeps it on purpose
    running = _running_frame_ids()
    if any(id(holder) in running for holder in holders):
        return None  # a loop that runs: the pass is live
    kept = [h for h in holders if any(isinstance(r, types.TracebackType) for r in gc.get_referrers(h))]
    return _where(kept[0], iterator) if kept else None


def _where(frame: types.FrameType, iterator: Any) -> str:
    names = [name for name, value in frame.f_locals.items() if value is iterator]
    variable = f"the variable `{names[0]}`" if names else "a variable"
    code = frame.f_code
    return f"{variable} of {code.co_name}() ({code.co_filename}:{frame.f_lineno})"


def _running_frame_ids() -> set[int]:
    """The ids of every thread's running frames; no frame object outlives the call (see above)."""
    ids: set[int] = set()
    for top in sys._current_frames().values():
        frame: Optional[types.FrameType] = top
        while frame is not None:
            ids.add(id(frame))
            frame = frame.f_back
        del top  # the last thread's top frame may be this function's own: a local holding it is a cycle
    return ids
