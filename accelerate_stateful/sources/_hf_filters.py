"""🤗 ``datasets``' non-batched ``filter()`` over Arrow data, as releases before 5.2 build it (datasets#8359).

Such a filter reads its input by whole Arrow tables and saves the input's position at the end of the table
it is reading, so a resume through its own state skips the rest of that table. Datasets 5.2 gives it its
input one row at a time; :func:`rows_one_at_a_time` does the same to a private copy of an older pipeline, so
its own state resumes it exactly, read at the top (``_hf_streams``) or as a composable source's child
(``_global``). Nothing here imports the package's other modules.
"""

from __future__ import annotations

from typing import Any

from datasets.iterable_dataset import (FilteredExamplesIterable, FormattedExamplesIterable,
                                       RebatchedArrowExamplesIterable)


def children(node: Any) -> list:
    """The steps a step of a ``datasets`` pipeline reads."""
    found = [getattr(node, "ex_iterable", None)] + list(getattr(node, "ex_iterables", None) or ())
    return [child for child in found if child is not None]


def table_filters(node: Any) -> list:
    """The non-batched ``filter()`` steps that read their input by whole Arrow tables (datasets#8359, fixed in
    datasets 5.2): such a filter saves the input's position at the end of the table it is reading, so a resume
    skips the rest of that table."""
    found = []
    if isinstance(node, FilteredExamplesIterable) and not node.batched:
        formatted = node.ex_iterable
        if (isinstance(formatted, FormattedExamplesIterable) and formatted.ex_iterable.iter_arrow
                and not isinstance(formatted.ex_iterable, RebatchedArrowExamplesIterable)):
            found.append(formatted)
    for child in children(node):
        found += table_filters(child)
    return found


def rows_one_at_a_time(node: Any) -> None:
    """Give every table-reading filter of the pipeline ``node`` (a private copy) its input one row at a time, as
    datasets 5.2 does, so that its own state resumes it exactly; a pipeline 5.2 built is left as it is."""
    for formatted in table_filters(node):
        formatted.ex_iterable = RebatchedArrowExamplesIterable(formatted.ex_iterable, batch_size=1)
