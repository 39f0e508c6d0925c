"""The shop's reducers, as plain functions (a team's own tests: no lake, no store)."""

from shop.domain import account, cart, domain

from es_pipeline.domain import Event, UnknownEventType


def fold(reducer, events):  # type: ignore[no-untyped-def]
    state: dict = {}
    for version, (event_type, payload) in enumerate(events, start=1):
        state = reducer(state, Event("s-1", version, event_type, payload))
    return state


def test_a_cart_totals_its_items_at_their_unit_price() -> None:
    state = fold(cart, [("ItemAdded", {"sku": "a", "qty": 2, "unit_price": 1.5}), ("ItemAdded", {"sku": "b"}),
                        ("ItemRemoved", {"sku": "b"}), ("CheckedOut", {})])
    assert state == {"items": {"a": 2}, "prices": {"a": 1.5}, "total": 3.0, "status": "checked_out"}


def test_an_account_counts_overdraft_attempts() -> None:
    state = fold(account, [("Opened", {"owner": "o", "currency": "EUR"}), ("Deposited", {"amount": 5}),
                           ("Withdrawn", {"amount": 7})])
    assert (state["balance"], state["overdraft_attempts"], state["status"]) == (-2.0, 1, "open")


def test_an_event_type_without_a_case_is_unknown() -> None:
    try:
        fold(cart, [("Teleported", {})])
    except UnknownEventType as exc:
        assert exc.event.event_type == "Teleported"
    else:
        raise AssertionError("no UnknownEventType")


def test_the_domain_registers_both_reducers() -> None:
    assert domain.revisions() == {"cart": 1, "account": 1}
