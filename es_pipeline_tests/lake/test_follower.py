"""What a tailing run's Follower hands over to report, and when (pure bookkeeping: the follows themselves are
stand-ins here; test_small_increments and defs/test_events run the real ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from es_pipeline.domain import NO_DOMAIN
from es_pipeline.lake import follow as follow_module
from es_pipeline.lake.follow import Follower


@dataclass
class _Done:
    worked: bool
    events_folded: int = 0
    caught_up: bool = True

    def metadata(self) -> dict[str, Any]:
        return {"events_folded": self.events_folded}


def _follower(monkeypatch: pytest.MonkeyPatch, follows: list[dict[str, Any] | Exception]) -> Follower:
    """A Follower whose follows answer `follows` in turn (a dict: the tables done; an exception: raised)."""
    answers = iter(follows)

    def next_follow(*_: Any, **__: Any) -> dict[str, Any]:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(follow_module, "follow", next_follow)
    return Follower("/nowhere", NO_DOMAIN, connect=lambda: None, frontier=lambda conn: 0, gap=0)  # type: ignore[arg-type,return-value]


def test_a_table_the_latest_follow_skipped_keeps_its_figures_for_a_later_report(monkeypatch: pytest.MonkeyPatch) -> None:
    follower = _follower(monkeypatch, [
        {"stream_state": _Done(True, 5), "stream_catalog": _Done(True, 5)},
        {"stream_catalog": _Done(True, 2), "event_type_daily": _Done(False)},  # stream_state's turn taken
        {"stream_state": _Done(False), "stream_catalog": _Done(False)},
    ])
    follower.update(force=True)
    follower.update(force=True)
    # Reported now, after a report of events that the skipped table did not fold, it would claim to be up to date.
    assert follower.flush() == {"stream_catalog": {"events_folded": 7, "updates": 2},
                                "event_type_daily": {"events_folded": 0, "up_to_date": True}}
    assert follower.flush() == {}  # handed over once
    follower.update(force=True)
    # Its figures, now that a follow covered it; and a table found up to date, reported too (not behind events).
    assert follower.flush() == {"stream_state": {"events_folded": 5, "updates": 1},
                                "stream_catalog": {"events_folded": 0, "up_to_date": True}}


def test_a_failed_follow_drops_what_it_gathered_and_reports_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    follower = _follower(monkeypatch, [{"stream_state": _Done(True, 3), "stream_catalog": _Done(False)},
                                       ValueError("reducer raised")])
    follower.update(force=True)
    with pytest.raises(ValueError):
        follower.update(force=True)
    follower.update(force=True)  # stopped for the run: no follow asked
    assert follower.flush() == {}


def test_a_table_the_follow_left_short_of_events_is_not_reported_as_kept_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A follow that folded some events but stopped short (a change feed it could not read, events held for the
    frontier) is not reported: after a report of `events`, it would tell the automation the table kept up."""
    follower = _follower(monkeypatch, [
        {"events_typed": _Done(True, 4, caught_up=False), "sku_sales": _Done(True, 2, caught_up=False),
         "stream_catalog": _Done(True, 6)},
        {"events_typed": _Done(False, caught_up=False), "sku_sales": _Done(True, 1)},
    ])
    follower.update(force=True)
    assert follower.flush() == {"stream_catalog": {"events_folded": 6, "updates": 1}}
    follower.update(force=True)
    # The projection caught up: its figures of both follows; the typed tables, still short, nothing.
    assert follower.flush() == {"sku_sales": {"events_folded": 3, "updates": 2}}
