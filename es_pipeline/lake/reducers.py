"""Reducers: plain functions that fold one event onto a stream's state, registered per stream type.

A reducer has a `revision`: bump it when its logic changes, and `stream_state` rebuilds that stream
type (alone) from `events`, and new snapshots are taken (docs/architecture.md, "Tables").

Register a new stream type in a few lines:

    @reducer("order", revision=1)
    def order(state: dict, event: Event) -> dict:
        if event.event_type == "OrderPlaced":
            return {**state, "status": "placed", "total": event.payload["total"]}
        raise UnknownEventType(event)

Policy for an event type a reducer does not know: the run fails naming stream, version and type
(`UnknownEventType`); with `skip_unknown=True` the event is skipped and counted instead.
A reducer that raises, or a payload missing a field (`KeyError`), fails the run naming the stream,
version and field; nothing of that run is committed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

State = dict[str, Any]


class Event(NamedTuple):
    """One event as a reducer sees it (a named tuple: made once per event folded, so it must be cheap)."""

    stream_id: str
    version: int
    event_type: str
    payload: dict[str, Any]


class UnknownEventType(Exception):
    def __init__(self, event: Event) -> None:
        self.event = event
        super().__init__(f"no reducer case for event type {event.event_type!r}")


@dataclass(frozen=True)
class Reducer:
    stream_type: str
    revision: int
    fold: Callable[[State, Event], State]


REGISTRY: dict[str, Reducer] = {}


def reducer(stream_type: str, *, revision: int) -> Callable[[Callable[[State, Event], State]], Callable[[State, Event], State]]:
    def register(fn: Callable[[State, Event], State]) -> Callable[[State, Event], State]:
        REGISTRY[stream_type] = Reducer(stream_type, revision, fn)
        return fn

    return register


@reducer("cart", revision=1)
def cart(state: State, event: Event) -> State:
    items: dict[str, int] = dict(state.get("items", {}))
    prices: dict[str, float] = dict(state.get("prices", {}))
    p = event.payload
    if event.event_type == "ItemAdded":
        items[p["sku"]] = items.get(p["sku"], 0) + int(p.get("qty", 1))
        if "unit_price" in p:
            prices[p["sku"]] = float(p["unit_price"])
        status = "open"
    elif event.event_type == "ItemRemoved":
        items.pop(p["sku"], None)
        prices.pop(p["sku"], None)
        status = "open"
    elif event.event_type == "CheckedOut":
        status = "checked_out"
    else:
        raise UnknownEventType(event)
    total = round(sum(q * prices.get(sku, 0.0) for sku, q in items.items()), 2)
    return {"items": items, "prices": prices, "total": total, "status": status}


@reducer("account", revision=1)
def account(state: State, event: Event) -> State:
    balance = float(state.get("balance", 0.0))
    s = dict(state)
    p = event.payload
    if event.event_type == "Opened":
        s.update(owner=p["owner"], currency=p["currency"], status="open", balance=0.0, overdraft_attempts=0)
    elif event.event_type == "Deposited":
        s["balance"] = round(balance + float(p["amount"]), 2)
    elif event.event_type == "Withdrawn":
        amount = float(p["amount"])
        if amount > balance:
            s["overdraft_attempts"] = int(s.get("overdraft_attempts", 0)) + 1
        s["balance"] = round(balance - amount, 2)
    elif event.event_type == "Closed":
        s["status"] = "closed"
    else:
        raise UnknownEventType(event)
    return s


def revisions() -> dict[str, int]:
    return {t: r.revision for t, r in REGISTRY.items()}
