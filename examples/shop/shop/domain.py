"""The shop's domain: how its carts and accounts fold into `stream_state`.

Built from es_pipeline's public API (`es_pipeline.domain`) alone; es_pipeline finds it through
`ES_PIPELINE_DOMAIN=shop.domain`, or the code location in `shop/definitions.py` names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from es_pipeline.domain import Domain, Event, State, UnknownEventType

domain = Domain("shop")


class Cart(TypedDict):
    """A cart's state: its table `stream_state_cart` has these columns (a TypedDict, or a dataclass as below)."""

    items: dict[str, int]
    prices: dict[str, float]
    total: float
    status: str


@dataclass
class Account:
    owner: str | None
    currency: str | None
    status: str | None
    balance: float
    overdraft_attempts: int | None


@domain.upcaster("ItemAdded", version=1, stream_types=["cart"])
def item_added_with_unit_price(payload: dict) -> dict:
    """Carts written before unit prices carried `price`: today's shape names it `unit_price`. The shop reads no
    schema version (`Domain("shop")`: every payload is version 1), so this takes payloads of either shape."""
    if "price" in payload and "unit_price" not in payload:
        payload = {k: v for k, v in payload.items() if k != "price"} | {"unit_price": payload["price"]}
    return payload


# history=True: every state each cart has been in, in `stream_state_cart_history` (how many carts were open at noon).
@domain.reducer("cart", revision=1, state=Cart, history=True)
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


# history="daily": each account's state at the end of each (UTC) day it changed (month-end balances).
@domain.reducer("account", revision=1, state=Account, history="daily")
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


class SkuSales(TypedDict):
    """What `sku_sales` keeps per product: units added to carts, removals, and the last price and cart seen (the
    last ones in the lake's order: docs/domain.md)."""

    units_added: int
    removals: int
    last_price: float | None
    last_cart: str | None


@domain.projection("sku_sales", events=["ItemAdded", "ItemRemoved"], key="sku", revision=1, state=SkuSales)
def sku_sales(state: State, event: Event) -> State:
    """A cross-stream projection: every cart's item events, folded per product (the payload's `sku`)."""
    s = {"units_added": 0, "removals": 0, "last_price": None, "last_cart": None, **state}
    p = event.payload
    if event.event_type == "ItemAdded":
        s["units_added"] += int(p.get("qty", 1))
        if "unit_price" in p:
            s["last_price"] = float(p["unit_price"])
    else:
        s["removals"] += 1
    s["last_cart"] = event.stream_id
    return s
