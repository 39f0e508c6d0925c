"""Declared folds (es_pipeline/declared.py, lake/state/declared_build.py), without a store: a declaration's
refusals, and random streams folded three ways that must agree: the equivalent Python reducer written here (exact
decimals), the declaration's own fold one event at a time, and the aggregation of a first build on DuckDB and on
Spark."""

from __future__ import annotations

import json
import re
from datetime import date
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from es_pipeline.declared import count, first, last, last_of, maximum, minimum, total
from es_pipeline.domain import Domain, Event
from es_pipeline.errors import DomainError
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state import declared_build, declared_spark
from es_pipeline.lake.state.fold import read_payload
from es_pipeline.lake.state.stream_state import update_stream_state

FIELDS = {
    "owner": first("owner", of=["Opened"]),
    "status": last_of({"Opened": "open", "Frozen": "frozen", "Closed": "closed"}),
    "balance": total("amount", add=["Deposited"], subtract=["Withdrawn"], scale=2),
    "deposits": count(of=["Deposited"]),
    "events": count(),
    "largest": maximum("amount", of=["Deposited"]),
    "smallest": minimum("amount", of=["Withdrawn"]),
    "note": last("text", of=["Noted", "Opened"]),
    "meta": last("meta", of=["Noted"]),  # a nested value, nulls inside kept
    "frozen_mark": last_of({"Frozen": None, "Audited": True}),  # a null the fold sets
    "fees": total("fee", add=["Audited"], scale=8),  # many places: digits, never "0E-8"
}
TYPES = ["Opened", "Deposited", "Withdrawn", "Frozen", "Noted", "Closed", "Audited"]


def python_reducer(state: dict[str, Any], event: Event) -> dict[str, Any]:
    """What a team would write by hand for FIELDS (and what the declaration must equal)."""
    s = {"balance": "0.00", "deposits": 0, "events": 0, **state}
    p, t = event.payload, event.event_type
    s["events"] += 1
    if t == "Opened" and p.get("owner") is not None and s.get("owner") is None:
        s["owner"] = p["owner"]
    if t in ("Opened", "Frozen", "Closed"):
        s["status"] = {"Opened": "open", "Frozen": "frozen", "Closed": "closed"}[t]
    if t in ("Deposited", "Withdrawn") and p.get("amount") is not None:
        if isinstance(p["amount"], bool):
            raise ValueError("not an amount")
        amount = _decimal(p["amount"], "0.01")
        s["balance"] = str((Decimal(s["balance"]) + (amount if t == "Deposited" else -amount)).quantize(Decimal("0.01")))
    if t in ("Deposited", "Withdrawn") and p.get("amount") is not None and not isinstance(p["amount"], (int, float)):
        raise ValueError("a least or greatest amount is a number")
    if t == "Deposited":
        s["deposits"] += 1
        if p.get("amount") is not None:
            s["largest"] = p["amount"] if s.get("largest") is None else max(s["largest"], p["amount"])
    if t == "Withdrawn" and p.get("amount") is not None:
        s["smallest"] = p["amount"] if s.get("smallest") is None else min(s["smallest"], p["amount"])
    if t in ("Noted", "Opened") and p.get("text") is not None:
        s["note"] = p["text"]
    if t == "Noted" and p.get("meta") is not None:
        s["meta"] = p["meta"]
    if t in ("Frozen", "Audited"):
        s["frozen_mark"] = None if t == "Frozen" else True
    s.setdefault("fees", "0.00000000")
    if t == "Audited" and p.get("fee") is not None:
        if isinstance(p["fee"], bool):
            raise ValueError("not an amount")
        fee = _decimal(p["fee"], "1e-8")
        s["fees"] = format((Decimal(s["fees"]) + fee).quantize(Decimal("1e-8")), "f")
    return s


def _decimal(value: Any, quantum: str) -> Decimal:
    try:
        return Decimal(str(value)).quantize(Decimal(quantum), rounding=ROUND_HALF_UP)
    except InvalidOperation:
        raise ValueError(f"{value!r} is not an amount") from None


amounts = st.one_of(st.integers(-10_000, 10_000), st.decimals("-10000", "10000", places=2).map(float),
                    st.decimals("0", "999", places=3).map(str), st.none(), st.just(1.0), st.just(1),
                    st.just(2**64 + 1), st.just(1e20), st.just(" 12.5"), st.just(0.1 + 0.2),
                    st.sampled_from([5e-7, -5e-7, 5.1e-5, "5e-7", "0.5E-3"]))  # exponents, rounding at the places
# Texts of amounts that Python's Decimal and the engines' casts may read otherwise: a control character Spark's cast
# trims and Python refuses, spaces, an exponent, no leading digit, a digit of another script, an underscore.
ODD_AMOUNTS = ["\x015", "5\x01", " 5", "5 ", "1e2", "-.5", "1.5E+2", "\u0661\u0662", "1_0", "+5", "\u00a05"]
payloads = st.fixed_dictionaries({}, optional={
    "owner": st.sampled_from(["ann", "bob", None, 2**70]), "amount": amounts, "text": st.text(max_size=5),
    "meta": st.dictionaries(st.sampled_from(["a", "b"]),  # nested: an integer past 64 bits, a double to orjson
                            st.one_of(st.none(), st.integers(0, 3), st.just(2**70), st.just(-(2**63) - 1)), max_size=2),
    "fee": st.one_of(st.decimals("0", "1", places=9).map(str), st.just(0), st.sampled_from(ODD_AMOUNTS))})
# How a payload is written: as json.dumps writes it, or twisted as no such writer would: a key twice (JSON allows it;
# Python reads the last), a lone surrogate escape, text after the value (not JSON: the Python fold fails on it), also
# as crafted against Spark's build's end mark.
TWISTS = ("plain",) * 12 + ("twice", "surrogate", "trailing", "crafted", "comma", "nan")
# Only twists DuckDB reads (a key twice), so that its build keeps the type and its own check decides: with a payload it
# refuses in a draw (most draws of TWISTS have one), the whole type is the Python fold's, and a key twice goes unseen.
READ_BY_DUCKDB = ("plain",) * 5 + ("twice", "comma", "nan")


def _streams(twists: tuple[str, ...]) -> st.SearchStrategy[Drawn]:
    return st.lists(st.lists(st.tuples(st.sampled_from(TYPES), payloads, st.sampled_from(twists)), min_size=1,
                             max_size=12), min_size=1, max_size=12)


streams = _streams(TWISTS)
Drawn = list[list[tuple[str, dict[str, Any], str]]]


def _text(payload: dict[str, Any], twist: str) -> str:
    text = json.dumps(payload)
    if twist == "twice":
        return text[:-1] + (", " if payload else "") + '"amount": 7, "text": "again"}'
    if twist == "surrogate":
        return text[:-1] + (", " if payload else "") + '"text": "\\ud800"}'
    if twist == "trailing":
        return text + "]"
    if twist == "comma":  # a comma before the closing brace: DuckDB's reader takes it, Python's refuses it
        return text[:-1] + (',}' if payload else '"z": 1,}')
    if twist == "nan":  # a lowercase nan: the same
        return text[:-1] + (", " if payload else "") + '"z": nan}'
    if twist == "crafted":  # text after the value that ends Spark's build's parse where its end mark would
        return text + ',"\\u0001"]x'
    return text


def _events(drawn: Drawn, gaps: list[int]) -> pa.Table:
    rows = []
    for i, events in enumerate(drawn):
        for version, (event_type, payload, twist) in enumerate(events, start=1):
            if i < len(gaps) and version == gaps[i]:
                continue  # a version on its way: the stream folds up to it only
            rows.append({"tenant": "t" if i % 3 else None, "stream_id": f"s{i}", "stream_type": "account",
                         "version": version, "event_type": event_type, "payload": _text(payload, twist),
                         "payload_encoding": "json", "recorded_at": 1_700_000_000_000_000 + version})
    return pa.Table.from_pylist(rows, schema=pa.schema([
        ("tenant", pa.string()), ("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int64()),
        ("event_type", pa.string()), ("payload", pa.string()), ("payload_encoding", pa.string()),
        ("recorded_at", pa.timestamp("us", tz="UTC"))]))


Built = dict[tuple[str, str], dict[str, Any]]


def _agree(drawn: Drawn, gaps: list[int], built: Built, left: set[tuple[str, str]], odd: Any) -> None:
    """Each stream folded by hand, by the declaration, and by the engine (`built`, or `left` to the Python fold):
    equal states; the streams left are those with a gap or a failing event, and may be those `odd` says."""
    for i, events in enumerate(drawn):
        key = ("t" if i % 3 else "", f"s{i}")
        missing = gaps[i] if i < len(gaps) and 1 <= gaps[i] <= len(events) else None
        run = events[: missing - 1] if missing else events  # the contiguous run from version 1
        gap = missing if missing and missing < len(events) else None  # the last version missing is no gap
        by_hand: dict[str, Any] = {}
        by_declaration: dict[str, Any] = {}
        failed = False
        for version, (event_type, payload, twist) in enumerate(run, start=1):
            try:
                event = Event(f"s{i}", version, event_type, read_payload(_text(payload, twist)))  # as the fold reads it
                by_hand = python_reducer(by_hand, event)
            except ValueError:
                failed = True
                break
            by_declaration = declared_fold(by_declaration, event)
        if failed:
            with pytest.raises(ValueError):
                for version, (event_type, payload, twist) in enumerate(run, start=1):
                    by_declaration = declared_fold(by_declaration, Event(f"s{i}", version, event_type,
                                                                         read_payload(_text(payload, twist))))
        else:
            assert by_declaration == by_hand
        if not run and not gap:
            assert key not in left and key not in built  # no event of it in the lake
            continue
        if gap or failed:
            assert key in left and key not in built  # the Python fold parks, quarantines: exactly as for any reducer
            continue
        if any(odd(payload, twist) for _, payload, twist in events):
            # A value the engine's JSON reader reads otherwise than Python's: such a stream may be the Python fold's,
            # and then it is exact as any reducer's.
            assert (key in built) != (key in left)
            if key in left:
                continue
        else:
            assert key in built and key not in left, events
        row = built[key]
        assert json.loads(row["state"]) == by_hand
        assert list(json.loads(row["state"])) == sorted(by_hand)  # keys sorted, nulls left out, as the fold writes
        assert (row["version"], row["folded"], row["revision"], row["skipped"]) == (len(run), len(run), 1, 0)


def _declared() -> tuple[Domain, Any]:
    domain = Domain("declared")
    return domain, domain.declare("account", revision=1, fields=FIELDS)


_DOMAIN, DECLARED = _declared()


def declared_fold(state: dict[str, Any], event: Event) -> dict[str, Any]:
    return DECLARED.fold(state, event)


def _duckdb_odd(payload: dict[str, Any], twist: str) -> bool:
    # An integer past 2**53 is a double to DuckDB's JSON reader; a key twice or a lone surrogate it refuses or reads
    # otherwise (its stream, or its whole type, then the Python fold's); an amount's text its cast may refuse where
    # Python's Decimal reads it (another script's digits, an underscore).
    # An amount written with an exponent (DuckDB's cast rounds it otherwise: its stream is Python's); an integer of 19
    # digits or more within a value kept whole (DuckDB keeps it, orjson makes a double of it past 64 bits).
    return (twist != "plain" or _past_doubles(payload)
            or any(payload.get(name) in ODD_AMOUNTS for name in ("amount", "fee"))
            or any("e" in json.dumps(payload.get(name)).lower() for name in ("amount", "fee") if name in payload)
            or re.search(r"[0-9]{19}", json.dumps(payload.get("meta"))) is not None)


@pytest.mark.parametrize("twists", [TWISTS, READ_BY_DUCKDB], ids=["every-twist", "read-by-duckdb"])
@settings(max_examples=80, deadline=None)
@given(data=st.data(), gaps=st.lists(st.integers(0, 12), max_size=12))
def test_random_streams_fold_alike_by_hand_by_the_declaration_and_by_duckdb(twists: tuple[str, ...], data: st.DataObject,
                                                                          gaps: list[int]) -> None:
    drawn = data.draw(_streams(twists))
    native = declared_build.build(_events(drawn, gaps), declared_build.native_types(_DOMAIN))
    built = {(r["tenant"], r["stream_id"]): r for r in native.out.to_pylist()}
    left = set(zip(native.left["tenant"].to_pylist(), native.left["stream_id"].to_pylist(), strict=True))
    surrogate = any(twist in ("surrogate", "trailing", "crafted") for events in drawn for _, _, twist in events)
    _agree(drawn, gaps, built, left, (lambda *_: True) if surrogate else _duckdb_odd)  # refused: the type is Python's


def _spark_odd(payload: dict[str, Any], twist: str) -> bool:
    # Besides DuckDB's: an amount that is not plain digits (" 12.5", 1e20, "1.12E-7", 0.30000000000000004), an integer
    # past 38 digits: Spark's reader and Python's may differ there, so the stream may be the Python fold's.
    # A character past U+FFFF is written as a surrogate pair, which Spark's build leaves to Python with lone ones.
    amounts = [payload.get(name) for name in ("amount", "fee") if payload.get(name) is not None]
    return (_duckdb_odd(payload, twist) or isinstance(payload.get("owner"), int)
            or any(not re.fullmatch(r"-?[0-9]+(\.[0-9]+)?", str(a)) or len(str(a)) > 16 for a in amounts)
            or re.search(r"\\u[dD][89abAB]", json.dumps(payload)) is not None)


# Payloads each engine's reader reads otherwise than the fold's (found by review, 2026-11-29): each stream after an
# Opened, by itself, so that nothing else leaves it to Python. Drawn by the property tests too, but rarely clean.
READ_OTHERWISE = [
    ("Deposited", '{"amount": 5e-07}'),  # DuckDB's cast rounds an exponent up: 0.01, Python's Decimal 0.00
    ("Withdrawn", '{"amount": -5e-07}'),
    ("Audited", '{"fee": "5e-9"}'),
    ("Deposited", '{"amount": 5,}'),  # a comma before the brace: DuckDB's reader takes it, Python's refuses it
    ("Closed", '{"a": [1, 2, ], "b": 1}'),  # in a type no field reads
    ("Noted", '{"text": "x", "y": nan}'),  # a lowercase nan
    ("Noted", '{"meta": {"b": inf}}'),
    ("Noted", '{"meta": {"b": 1180591620717411303424}}'),  # past 64 bits: a double to orjson, digits to the engines
    ("Noted", '{"meta": [-9223372036854775809]}'),
]


def _read_otherwise_agree(built: Built, left: set[tuple[str, str]]) -> None:
    for i, (event_type, text) in enumerate(READ_OTHERWISE):
        key = ("", f"odd{i}")
        try:
            expected = DECLARED.fold(DECLARED.fold({}, Event(key[1], 1, "Opened", {"owner": "ann"})),
                                     Event(key[1], 2, event_type, read_payload(text)))
        except ValueError:  # the fold fails (not JSON, not an amount): the stream is the Python fold's
            assert key in left and key not in built, text
            continue
        assert (key in left) != (key in built), text
        if key in built:
            assert json.loads(built[key]["state"]) == expected, text


def _read_otherwise() -> pa.Table:
    rows = [{"tenant": None, "stream_id": f"odd{i}", "stream_type": "account", "version": v, "event_type": t,
             "payload": p, "payload_encoding": "json", "recorded_at": 1_700_000_000_000_000 + v}
            for i, (event_type, text) in enumerate(READ_OTHERWISE)
            for v, t, p in ((1, "Opened", '{"owner": "ann"}'), (2, event_type, text))]
    return pa.Table.from_pylist(rows, schema=_events([], []).schema)


def test_payloads_duckdb_reads_otherwise_leave_their_stream_to_python() -> None:
    native = declared_build.build(_read_otherwise(), declared_build.native_types(_DOMAIN))
    built = {(r["tenant"], r["stream_id"]): r for r in native.out.to_pylist()}
    _read_otherwise_agree(built, set(zip(native.left["tenant"].to_pylist(), native.left["stream_id"].to_pylist(),
                                         strict=True)))


def test_payloads_spark_reads_otherwise_leave_their_stream_to_python(spark: Any) -> None:
    native = declared_spark.build(spark.createDataFrame(_read_otherwise()), declared_build.native_types(_DOMAIN))
    try:
        built = {(r["tenant"], r["stream_id"]): r.asDict() for r in native.out.collect()}
        left = {(r["tenant"], r["stream_id"]) for r in native.left.collect()}
    finally:
        native.unpersist()
    _read_otherwise_agree(built, left)


@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])  # a shrink is minutes
@given(drawn=st.lists(streams, min_size=8, max_size=8), gaps=st.lists(st.integers(0, 12), max_size=96))
def test_random_streams_fold_alike_by_hand_by_the_declaration_and_by_spark(spark: Any, drawn: list[Drawn],
                                                                         gaps: list[int]) -> None:
    """As on DuckDB, on Spark (lake/state/declared_spark.py): several draws' streams in one build each time."""
    everything = [events for draw in drawn for events in draw]
    events = spark.createDataFrame(_events(everything, gaps))
    native = declared_spark.build(events, declared_build.native_types(_DOMAIN))
    try:
        built = {(r["tenant"], r["stream_id"]): r.asDict() for r in native.out.collect()}
        left = {(r["tenant"], r["stream_id"]) for r in native.left.collect()}
    finally:
        native.unpersist()
    assert built  # not all left to Python
    _agree(everything, gaps, built, left, _spark_odd)


def _lake(warehouse: Path, rows: list[tuple[str, str | None, int, str, dict[str, Any]]]) -> None:
    """An `events` table of (stream id, stream type, version, event type, payload) rows, in the lake's schema."""
    n = len(rows)
    sid, stream_type, version, event_type, payload = (list(c) for c in zip(*rows, strict=True))
    columns: dict[str, Any] = {
        "global_position": range(1, n + 1), "tx_id": range(1, n + 1), "stream_id": sid, "stream_type": stream_type,
        "version": version, "slice": [0] * n, "event_type": event_type, "payload": [json.dumps(p) for p in payload],
        "metadata": ["{}"] * n, "recorded_at": [1_700_000_000_000_000 + i for i in range(n)], "event_date": [date(2023, 11, 14)] * n,
        "batch_id": [1] * n, "payload_encoding": ["json"] * n, "tenant": [""] * n}
    write_deltalake(EVENTS.ensure_arrow(warehouse), pa.table(
        {f.name: pa.array(list(columns[f.name])).cast(f.type) for f in EVENTS.schema}, schema=EVENTS.schema),
        mode="append")


def test_a_spark_build_of_declared_types_alone_starts_no_python_fold_and_other_types_are_still_folded(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`stream_state` built from nothing on Spark: where `events` holds declared types alone (told by its log's count
    of rows against the aggregation's), no Python fold runs and the figures are the aggregation's; one event of another
    type (or of none) and the Python workers fold it beside, each row as the fold gives it."""
    accounts = [("a1", "account", 1, "Opened", {"owner": "ann"}), ("a1", "account", 2, "Deposited", {"amount": 12.5}),
                ("a1", "account", 3, "Withdrawn", {"amount": 2.25}), ("a2", "account", 1, "Opened", {"owner": "bob"}),
                ("a2", "account", 2, "Frozen", {})]
    expected = {}
    for sid in ("a1", "a2"):
        state: dict[str, Any] = {}
        for row in accounts:
            if row[0] == sid:
                state = python_reducer(state, Event(sid, row[2], row[3], row[4]))
        expected[sid] = state
    answers: list[Any] = []
    real = declared_spark.Native.python_events
    monkeypatch.setattr(declared_spark.Native, "python_events",
                        lambda self, *a: answers.append(real(self, *a)) or answers[-1])
    others: list[tuple[str, str | None, int, str, dict[str, Any]]] = [("c1", "cart", 1, "ItemAdded", {"sku": "x"}),
                                                                      ("n1", None, 1, "Lost", {})]
    for extra in ([], others):
        warehouse = tmp_path / f"lake{len(extra)}"
        _lake(warehouse, accounts + extra)
        result = update_stream_state(Engine("spark", spark), warehouse, domain=_DOMAIN)
        assert (answers[-1] is None) == (not extra), "the Python workers start only for what is not declared"
        assert result.engine == "spark" and result.events_folded == len(accounts) + len(extra)
        assert result.figures["streams_updated"] == 2 + len(extra)
        assert result.figures["streams_without_reducer"] == len(extra)
        rows = {r["stream_id"]: r for r in DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table().to_pylist()}
        assert {k: json.loads(rows[k]["state"]) for k in expected} == expected
        assert {k: (r["revision"], r["version"]) for k, r in rows.items()} == {
            "a1": (1, 3), "a2": (1, 2), **{sid: (0, 1) for sid, *_ in extra}}
    # In process too, and an increment after: a stream of no type (NULL) holds no later update back.
    warehouse = tmp_path / "in_process"
    _lake(warehouse, accounts + others)
    assert update_stream_state(Engine("local"), warehouse, domain=_DOMAIN).figures["streams_without_reducer"] == 2
    _lake(warehouse, [("a2", "account", 3, "Closed", {})])
    assert update_stream_state(Engine("local"), warehouse, domain=_DOMAIN).events_folded == 1
    rows = {r["stream_id"]: r for r in DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table().to_pylist()}
    assert json.loads(rows["a2"]["state"]) == python_reducer(expected["a2"], Event("a2", 3, "Closed", {}))


def _past_doubles(payload: dict[str, Any]) -> bool:
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) >= 2**53 for v in payload.values())


def test_a_declaration_that_cannot_be_said_so_is_refused_in_one_line() -> None:
    domain = Domain("d")
    cases = [
        (lambda: total("amount", scale=30), "scale"),
        (lambda: total("amount", add=["A"], subtract=["A"]), "both adds and subtracts"),
        (lambda: total("amount", subtract=["W"]), "adds every event type"),
        (lambda: last("a.b"), "top-level payload field"),
        (lambda: count(of=[]), "event types"),
        (lambda: last_of({}), "mapping of event type"),
        (lambda: last_of({"A": object()}), "JSON cannot hold"),
        (lambda: domain.declare("x", revision=1, fields={}), "declares no field"),
        (lambda: domain.declare("x", revision=1, fields={"n": lambda s, e: s}), "needs a Python reducer"),
        (lambda: domain.declare("x", revision=1, fields={"bad name": count()}), "letters, digits"),
    ]
    for make, words in cases:
        with pytest.raises(DomainError, match=words) as refused:
            make()
        assert "\n" not in str(refused.value)


def test_an_upcaster_of_a_type_a_declaration_reads_is_refused_whichever_comes_first() -> None:
    domain = Domain("d")
    domain.declare("account", revision=1, fields={"balance": total("amount", add=["Deposited"])})
    domain.upcaster("Deposited", version=1)(lambda p: p)
    with pytest.raises(DomainError, match="an upcaster rewrites"):
        _ = domain.folds
    other = Domain("e")
    other.upcaster("Noted", version=1)(lambda p: p)  # a type the declaration does not read: no matter
    other.declare("account", revision=1, fields={"balance": total("amount", add=["Deposited"])})
    assert other.folds["account"].declared is not None
