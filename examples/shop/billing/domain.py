"""Billing's domain: invoices. Registered beside the shop's (a second `Domain`, merged in one code location)."""

from __future__ import annotations

from dataclasses import dataclass

from es_pipeline.domain import Domain, Event, State, UnknownEventType

domain = Domain("billing")


@dataclass
class Invoice:
    amount: float | None
    paid: bool


@domain.reducer("invoice", revision=1, state=Invoice)
def invoice(state: State, event: Event) -> State:
    if event.event_type == "InvoiceIssued":
        return {"amount": float(event.payload["amount"]), "paid": False}
    if event.event_type == "InvoicePaid":
        return {**state, "paid": True}
    raise UnknownEventType(event)
