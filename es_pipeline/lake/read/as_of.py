"""`state_as_of('<stream type>', <moment>)`: each stream's state at a moment, from its history table
(lake/state/history.py), without the interval logic. DuckDB has it as a table macro (`DUCKDB_MACRO`, made on each
connection of lake/read/query.py); Spark SQL has no table macros, so lake/read/catalog.py writes each call out as
the same subquery (`as_of_spark`). A moment without a zone is UTC on both."""

from __future__ import annotations

import re
from typing import Any

from es_pipeline.errors import QueryFailed

AS_OF = "state_as_of"  # the name, on both engines
# The history table of a stream type, named as lake/state/typed_state.py's `table_name` names it, then `_history`.
_HISTORY_OF = "'stream_state_' || coalesce(nullif(trim(regexp_replace(lower({t}), '[^a-z0-9]+', '_', 'g'), '_'), ''), " \
    "'_') || '_history'"
_AS_OF_COLUMNS = ("h.tenant", "h.stream_id", "h.version_to AS version", "h.valid_from", "h.revision",
                  # A held stream's (docs/decisions/0051) history ends at its last good state: its current row says so.
                  "CASE WHEN h.valid_to IS NULL THEN q.quarantined END AS quarantined")
_HISTORY_ENVELOPE = ("tenant", "stream_id", "version_from", "version_to", "valid_from", "valid_to", "is_current",
                     "revision")
_HELD = ("LEFT JOIN (SELECT coalesce(tenant, '') AS tenant, stream_id, quarantined FROM stream_state "
         "WHERE quarantined IS NOT NULL) q ON q.tenant = h.tenant AND q.stream_id = h.stream_id")

# The state of every stream of a type at a moment: the history row whose interval holds it.
DUCKDB_MACRO = (
    f"CREATE OR REPLACE MACRO {AS_OF}(stream_type, moment) AS TABLE "
    f"SELECT {', '.join(_AS_OF_COLUMNS)}, h.* EXCLUDE ({', '.join(_HISTORY_ENVELOPE)}) "
    f"FROM query_table({_HISTORY_OF.format(t='stream_type')}) h {_HELD} "
    f"WHERE h.valid_from <= moment::TIMESTAMPTZ AND (h.valid_to IS NULL OR h.valid_to > moment::TIMESTAMPTZ)")


def as_of_spark(query: str, columns_of: Any) -> str:
    """`query` with each `state_as_of('<type>', <moment>)` written out as the subquery it stands for, for Spark SQL
    (which has no table macros); `columns_of(table)`: that history table's columns (KeyError: there is none)."""
    out, at = [], 0
    for found in re.finditer(rf"\b{AS_OF}\s*\(", query, re.IGNORECASE):
        if found.start() < at:
            continue
        args, end = _arguments(query, found.end())
        if len(args) != 2 or not re.fullmatch(r"\s*'[^']*'\s*", args[0]):
            raise QueryFailed("spark", f"{AS_OF} takes a stream type in quotes and a moment: "
                              f"{AS_OF}('account', TIMESTAMP '2026-10-31 23:59')", [])
        stream_type = args[0].strip()[1:-1]
        from es_pipeline.lake.state.history import table_name

        name = table_name(stream_type)
        try:
            fields = [c for c in columns_of(name) if c not in _HISTORY_ENVELOPE]
        except KeyError:
            raise QueryFailed("spark", f"no history table {name} in the lake: the reducer of {stream_type!r} keeps no "
                              "history (Domain.reducer(..., history=True))", []) from None
        moment = f"CAST(({args[1]}) AS TIMESTAMP)"
        out.append(query[at:found.start()])
        try:
            held = _HELD if "quarantined" in columns_of("stream_state") else ""
        except KeyError:
            held = ""
        columns = _AS_OF_COLUMNS if held else (*_AS_OF_COLUMNS[:-1], "CAST(NULL AS STRING) AS quarantined")
        out.append(f"(SELECT {', '.join([*columns, *(f'h.`{c}`' for c in fields)])} FROM {name} h {held} "
                   f"WHERE h.valid_from <= {moment} AND (h.valid_to IS NULL OR h.valid_to > {moment}))")
        at = end
    return "".join(out) + query[at:]


def _arguments(text: str, start: int) -> tuple[list[str], int]:
    """The comma-separated arguments of a call whose `(` ends at `start` (quotes and nested parentheses kept
    whole), and where its `)` ends."""
    args, depth, quote, begin = [], 0, "", start
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"`":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif ch == ")":
            args.append(text[begin:i])
            return args, i + 1
        elif ch == "," and not depth:
            args.append(text[begin:i])
            begin = i + 1
    raise QueryFailed("spark", f"{AS_OF}( is not closed", [])
