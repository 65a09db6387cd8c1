"""Packing: token sequences cut into rows of exactly ``seq_len`` tokens, the remainder carried over.

Row ``k`` is a pure function of the source's sequence of documents and the
settings, so a packer resumes exactly and elastically like every global
sequence (see ``_global``). What is left of the document a row ended in (the
carry) is part of the position, so a resume neither reads a document again nor
replays the source.
"""

from __future__ import annotations

import array as _array

from typing import Any, Optional

import numpy as np
import torch

from ..errors import CheckpointError, UnsupportedConfigError
from ._global import Cursor, GlobalStream, check_child, check_source, open_source
from ._merge import next_token
from .filtered import Filtered

_ENDINGS = ("drop", "pad")


class Packed(GlobalStream):
    """Packs documents of token ids into rows of exactly ``seq_len`` tokens.

    Documents are read in the source's order and laid end to end; a row is cut
    every ``seq_len`` tokens, so a document longer than what is left of a row
    goes on in the next row (and the rows after it). Empty documents add
    nothing.

    Each row is a dict of two ``torch.long`` tensors of shape ``(seq_len,)``:

    - ``input_ids``: the tokens;
    - ``position_ids``: each token's position in its piece of document, starting
      at 0 where a document starts *and* at the start of every row (the part of
      a document carried into a row is a piece of its own there). A 0 therefore
      marks every boundary a model must not attend across, which is what
      🤗 ``DataCollatorWithFlattening`` produces and what 🤗 Transformers' flash
      attention reads (``cu_seq_lens`` from the zeros of ``position_ids``), and a
      row never continues positions that it cannot attend to.

    The default collate stacks rows into ``(batch, seq_len)`` tensors.

    Args:
        source: A sequence of documents: a map-style dataset, a
            ``datasets.Dataset`` or ``IterableDataset``, a stateful iterable or
            another of this package's sources. A document is a dict holding its
            token ids under ``key``, or the token ids themselves (a list or
            tuple of ints, or a 1-D integer tensor or array).
        seq_len: Tokens in each row, at least 1.
        key: The field of a dict document that holds its token ids.
        last: What becomes of the tokens left at the source's end, fewer than
            ``seq_len``: ``"drop"`` leaves them out (no partial row; the
            default), ``"pad"`` makes a last row of them filled up with
            ``pad_id`` tokens, the padding being one more piece whose
            ``position_ids`` start at 0 (mask ``input_ids == pad_id`` out of
            the loss with a ``pad_id`` that is no real token).
        pad_id: The token that fills the last row with ``last="pad"``.

    Position (the ``"position"`` of ``state_dict()``): ``{"source": <the
    source's position after the last document read>, "carry": [<the tokens of
    that document not yet in a row>], "seq_len": ..., "documents": <the
    source's documents read this epoch>, "offset": <where the carry begins in
    its document>}``. The carry is at most what is left of one document, so it
    is short unless documents are much longer than a row. ``documents`` and
    ``offset`` name the next token as (document, offset): what ``samples``
    names a row's pieces by (a position written before they were recorded
    lacks them). Over a :class:`Filtered`, the marks the loader notes at each
    batch's end also hold the filter's items drawn when the last document was
    read, which that document was: ``samples`` names the source items of a
    step's documents by them.

    Examples:
        >>> docs = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}]
        >>> [row["position_ids"].tolist() for row in Packed(docs, seq_len=4)]
        [[0, 1, 2, 0], [0, 1, 2, 3]]
    """

    def __init__(self, source: Any, seq_len: int, *, key: str = "input_ids", last: str = "drop",
                 pad_id: int = 0) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise UnsupportedConfigError(
                f"Packed(seq_len={seq_len!r}): a row must hold at least one token; pass seq_len as an int >= 1"
            )
        if last not in _ENDINGS:
            raise UnsupportedConfigError(
                f"Packed(last={last!r}) is not a way to end: pass last='drop' to leave out the tokens that do not fill "
                "a last row, or last='pad' to fill it with pad_id"
            )
        if isinstance(pad_id, bool) or not isinstance(pad_id, int):
            raise UnsupportedConfigError(f"Packed(pad_id={pad_id!r}): the padding token must be an int token id")
        check_source(source, "Packed's source")
        self.source, self.seq_len, self.key, self.last, self.pad_id = source, seq_len, key, last, pad_id

    def settings(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "key": self.key, "last": self.last, "pad_id": self.pad_id}

    def children(self) -> dict[str, Any]:
        return {"source": self.source}

    def check_position(self, position: Any) -> None:
        if not isinstance(position, dict) or set(position) - {"seq_len", "documents", "offset"} != {
                "source", "carry"} or not isinstance(position["carry"], list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in position["carry"]) or not all(
                isinstance(position.get(key, 0), int) and not isinstance(position.get(key, 0), bool)
                and position.get(key, 0) >= 0 for key in ("documents", "offset")) or (
                "documents" in position) != ("offset" in position):
            raise CheckpointError(
                f"the saved position of a Packed source is not one it wrote (got {str(position)[:200]}); resume from a "
                "checkpoint written with this source, or start the run without loading"
            )
        saved = position.get("seq_len", self.seq_len)  # (not recorded before this release)
        if saved != self.seq_len:
            raise CheckpointError(
                f"the checkpoint's Packed source cut rows of seq_len={saved!r}, this one cuts rows of "
                f"seq_len={self.seq_len}, so every row after the resume would differ; resume with "
                f"Packed(seq_len={saved!r}), or start a fresh run"
            )
        check_child(self.source, position["source"])

    def open(self, position: Optional[Any], epoch: int) -> Cursor:
        if position is None:
            return _PackCursor(self, open_source(self.source, None, epoch), [], 0, 0)
        self.check_position(position)
        return _PackCursor(self, open_source(self.source, position["source"], epoch), list(position["carry"]),
                           position.get("documents"), position.get("offset", 0))


    def agree(self, positions: list) -> tuple[list, list[str]]:
        """Passed on to the source when it is a global sequence (``GlobalStream.agree``): a share's source
        position is where its packer has read to, which is what the source's shares agree on."""
        if not isinstance(self.source, GlobalStream):
            return positions, []
        below, lines = self.source.agree([None if p is None else p["source"] for p in positions])
        agreed = [
            None if position is None and child is None
            else {"source": child, "carry": [], "documents": 0, "offset": 0} if position is None
            else dict(position, source=child)
            for position, child in zip(positions, below)
        ]
        return agreed, lines


class _PackCursor:
    """Rows from a cursor over documents; ``tokens[start:]`` is the carry.

    ``counted`` is the source's documents read this epoch (``None`` where a position written before it was
    recorded does not say), ``offset`` where ``tokens`` begins in the last of them.
    """

    def __init__(self, packed: Packed, documents: Cursor, carry: list, counted: Optional[int], offset: int) -> None:
        self._packed, self._documents = packed, documents
        self._tokens, self._start = np.asarray(carry, dtype=np.int64), 0
        self._read = 0  # documents read by this cursor, to name one in an error
        self._counted, self._offset = counted, offset
        self._ended = False
        # Over a filter: its source items drawn when the last document was read (that document was the last of
        # them: a filter returns as soon as it keeps one), for the marks. Its position says so at the start.
        self._drawn = documents.mark()[0] if isinstance(packed.source, Filtered) else None

    def __next__(self) -> dict:
        size = self._packed.seq_len
        ids: list = []
        positions: list = []
        have = 0
        while have < size:
            if self._start == len(self._tokens) and not self._next_document():
                if not have or self._packed.last == "drop":
                    raise StopIteration
                ids.append(np.full(size - have, self._packed.pad_id, dtype=np.int64))
                positions.append(np.arange(size - have))
                break
            piece = self._tokens[self._start:self._start + size - have]
            self._start += len(piece)
            have += len(piece)
            ids.append(piece)
            positions.append(np.arange(len(piece)))
        # concatenate copies: a row never shares memory with the carry
        return {"input_ids": torch.from_numpy(np.concatenate(ids)),
                "position_ids": torch.from_numpy(np.concatenate(positions).astype(np.int64, copy=False))}

    def _next_document(self) -> bool:
        """Make the next non-empty document the carry; False at the source's end."""
        while not self._ended:
            try:
                document = next(self._documents)
            except StopIteration:
                self._ended = True
                return False
            self._read += 1
            if self._counted is not None:
                self._counted += 1
            if self._drawn is not None:
                self._drawn = self._documents.mark()[0]
            self._tokens, self._start, self._offset = _token_ids(document, self._packed.key, self._read), 0, 0
            if len(self._tokens):
                return True
        return False

    def position(self) -> dict:
        position = {"source": self._documents.position(), "carry": self._tokens[self._start:].tolist(),
                    "seq_len": self._packed.seq_len}
        if self._counted is not None:
            position["documents"], position["offset"] = self._counted, self._offset + self._start
        return position

    def mark(self) -> Optional[tuple[int, ...]]:
        """The next token as (document of the epoch, offset in it), and over a filter the filter's items drawn
        when the last document was read (``_merge.last_read``); ``None`` where the count is not known."""
        if self._counted is None:
            return None
        at = next_token(self._counted, self._offset + self._start, self._start < len(self._tokens))
        return at if self._drawn is None else (*at, self._drawn)


def _list_ids(tokens: Any) -> np.ndarray:
    """A list of ints as int64, the fast way where it is exact: ``array('q')`` takes Python and NumPy ints and
    refuses anything else (a float, a string, an int beyond int64); the rest, and a list that starts with a
    bool, go to NumPy's inference, whose dtype :func:`_token_ids` then judges."""
    if not len(tokens):
        return np.zeros(0, dtype=np.int64)
    if type(tokens[0]) is not bool:
        try:
            return np.frombuffer(_array.array("q", tokens), dtype=np.int64)
        except (TypeError, OverflowError):
            pass
    return np.array(tokens)


def _token_ids(document: Any, key: str, number: int) -> np.ndarray:
    """The token ids of a document as a 1-D int64 array, or an error that names the document."""
    tokens = document
    if isinstance(document, dict):
        if key not in document:
            raise UnsupportedConfigError(
                f"document {number} read by Packed has no {key!r} field (it has {sorted(map(str, document))[:10]}); "
                f"pass key= the field that holds its token ids, or tokenize the documents first"
            )
        tokens = document[key]
    if isinstance(tokens, torch.Tensor):
        array = tokens.detach().cpu().numpy() if _integer_dtype(tokens) else None
    elif isinstance(tokens, np.ndarray):
        array = tokens
    elif isinstance(tokens, (list, tuple)):
        array = _list_ids(tokens)
    else:
        array = None
    if array is not None and array.ndim == 1 and array.dtype.kind in "iu":
        return array.astype(np.int64, copy=False)
    if isinstance(tokens, (list, tuple)) and any(type(t) is not int for t in tokens):
        bad = next(t for t in tokens if type(t) is not int)
        shown = f"a {type(bad).__name__} ({bad!r:.40})"
    else:
        shown = f"a {type(tokens).__name__} ({tokens!r:.60})"
    raise UnsupportedConfigError(
        f"document {number} read by Packed holds {shown} where token ids (ints) belong; tokenize the text first "
        f"(a list of ints or a 1-D integer tensor{'' if not isinstance(document, dict) else f' under {key!r}'})"
    )


def _integer_dtype(tokens: torch.Tensor) -> bool:
    return not tokens.dtype.is_floating_point and not tokens.dtype.is_complex and tokens.dtype != torch.bool
