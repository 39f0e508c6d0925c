"""Tailing passes (extraction/tail.py): a commit wakes the run through NOTIFY, each pass is an ordinary run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from es_pipeline.dev.workload import run_workload
from es_pipeline.errors import SliceLocked
from es_pipeline.extraction.extractor import Extractor, ExtractResult
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.extraction.tail import (
    CHANNEL,
    GATHER_SECONDS,
    PASS_GAP,
    gather_seconds,
    notifications,
    tail,
    wait_for_commits,
)
from es_pipeline.store.conninfo import connect
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import source_events
from es_pipeline_tests.support.roles import StoreDsn


def test_a_commit_wakes_the_tailing_run_and_every_event_lands_once(dsn: StoreDsn, warehouse: Path) -> None:
    store = EventStore(dsn.writer)
    run_workload(store, streams=10, events=30, writers=1, rollback_rate=0, max_commit_delay=0)
    extractor = Extractor(dsn.extractor, None, warehouse)
    everything = SliceRange(0, 1023)
    assert extractor.run(everything).rows == 30
    seen: list[tuple[float, int]] = []

    def on_pass(result: ExtractResult) -> None:
        seen.append((time.monotonic(), result.rows))

    tailing = threading.Thread(target=lambda: seen.append(
        (0.0, tail(extractor, everything, run_id="tail-test", seconds=18, on_pass=on_pass, poll_seconds=5).passes)))
    tailing.start()
    time.sleep(1.0)
    committed = []
    for _ in range(3):
        run_workload(store, streams=10, events=10, writers=1, rollback_rate=0, max_commit_delay=0)
        committed.append(time.monotonic())
        time.sleep(PASS_GAP + 1.5)
    tailing.join(30)
    passes = [(t, n) for t, n in seen if t > 0]
    assert sum(n for _, n in passes) == 30 and len(passes) >= 2
    # Woken by the commits' NOTIFY, not by the 5 s poll: each batch of writes is in the lake within the
    # gap between two passes' starts (PASS_GAP) and the pass itself.
    assert all(any(0 <= t - c < PASS_GAP + 1.0 for t, _ in passes) for c in committed), (committed, passes)
    lake = DeltaTable(str(warehouse / "events")).to_pyarrow_table(columns=["stream_id", "version"])
    keys = list(zip(lake["stream_id"].to_pylist(), lake["version"].to_pylist(), strict=True))
    assert len(keys) == len(set(keys)) == len(source_events(dsn)) == 60


def test_a_tailing_run_holds_its_range_between_passes_and_another_run_is_told_who(
    dsn: StoreDsn, warehouse: Path
) -> None:
    """The passes share one session: its slice locks are held from the first pass to the last, so a hand
    run of the same range fails at once, naming the tailing run, and takes nothing of its events."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=5, events=10, writers=1, rollback_rate=0, max_commit_delay=0)
    extractor = Extractor(dsn.extractor, None, warehouse)
    everything = SliceRange(0, 1023)
    passes: list[int] = []
    tailing = threading.Thread(target=lambda: tail(
        extractor, everything, run_id="tail-holder", seconds=8, on_pass=lambda r: passes.append(r.rows),
        poll_seconds=1))
    tailing.start()
    time.sleep(3)  # its first pass has taken the locks and the 10 events
    with pytest.raises(SliceLocked, match="tail-holder"):
        Extractor(dsn.extractor, None, warehouse).run(everything, run_id="by-hand")
    run_workload(store, streams=5, events=10, writers=1, rollback_rate=0, max_commit_delay=0)
    tailing.join(30)
    assert sum(passes) == 20
    assert Extractor(dsn.extractor, None, warehouse).run(everything, run_id="after").rows == 0
    lake = DeltaTable(str(warehouse / "events")).to_pyarrow_table(columns=["stream_id", "version"])
    assert lake.num_rows == len(source_events(dsn)) == 20


def test_the_gathering_after_a_notification_outlasts_the_poll(dsn: StoreDsn) -> None:
    """The wait for a notification is bounded by the poll (2 s), the gathering after it is not: a pass begins
    PASS_GAP after the last one began, more than the poll, under a steady trickle of notifications."""
    with notifications(dsn.extractor) as listener, connect(dsn.writer, autocommit=True) as writer:
        assert listener is not None
        writer.execute("SELECT pg_notify(%s, '')", (CHANNEL,))
        started = time.monotonic()
        wait_for_commits(listener, 0.5, gather=1.5)
        # Lower bounds only where a busy machine could stretch the time: the gathering outlasted the poll.
        assert 1.5 <= time.monotonic() - started < 15
        started = time.monotonic()
        wait_for_commits(listener, 0.5, gather=6.0)  # nothing notified: the poll ends the wait, with no gathering after it
        assert 0.5 <= time.monotonic() - started < 6.0


def test_gathering_spaces_the_passes_and_stops_at_the_deadline() -> None:
    assert gather_seconds(began=100.0, now=100.3, left=60) == pytest.approx(PASS_GAP - 0.3)
    assert gather_seconds(began=100.0, now=100.0 + PASS_GAP, left=60) == GATHER_SECONDS  # a quiet spell: 1 s
    assert gather_seconds(began=100.0, now=100.3, left=0.5) == 0.5


def test_a_quiet_store_calls_on_idle_so_what_was_gathered_is_reported_without_a_next_pass(
    dsn: StoreDsn, warehouse: Path
) -> None:
    """A pass gathered for a later report must not wait for the next pass with rows: with the writers quiet or
    the horizon held, none comes before the run's end. Each probe that finds nothing calls `on_idle`."""
    store = EventStore(dsn.writer)
    extractor = Extractor(dsn.extractor, None, warehouse)
    everything = SliceRange(0, 1023)
    calls: list[str] = []
    tailing = threading.Thread(target=lambda: tail(
        extractor, everything, run_id="tail-idle", seconds=6, on_pass=lambda r: calls.append(f"pass {r.rows}"),
        on_idle=lambda: calls.append("idle"), poll_seconds=0.5))
    tailing.start()
    time.sleep(1.0)
    run_workload(store, streams=3, events=6, writers=1, rollback_rate=0, max_commit_delay=0)
    tailing.join(30)
    passes = [i for i, c in enumerate(calls) if c.startswith("pass")]
    assert sum(int(calls[i].split()[1]) for i in passes) == 6, calls
    assert calls[passes[-1] + 1:].count("idle") >= 3, calls  # no pass after the last, yet the run is told, probe by probe
