"""The shop's reducers, as plain functions (a team's own tests: no lake, no store)."""

from shop.domain import account, cart, domain, sku_sales

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


def test_the_domain_registers_both_reducers_an_upcaster_and_a_projection() -> None:
    # cart's revision counts its upcaster: registering one rebuilds the carts (docs/domain.md)
    assert domain.revisions() == {"cart": 2, "account": 1}
    assert list(domain.projections) == ["sku_sales"]


def test_old_cart_payloads_reach_the_reducer_in_todays_shape() -> None:
    event = domain.upcast("cart", Event("c-1", 1, "ItemAdded", {"sku": "a", "qty": 2, "price": 3.0}))
    assert event.payload == {"sku": "a", "qty": 2, "unit_price": 3.0}
    assert domain.upcast("account", Event("a-1", 1, "ItemAdded", {"price": 1})).payload == {"price": 1}  # carts only


def test_sku_sales_counts_units_and_removals_and_keeps_the_last_price() -> None:
    state = fold(sku_sales, [("ItemAdded", {"sku": "a", "qty": 2, "unit_price": 1.5}), ("ItemRemoved", {"sku": "a"}),
                             ("ItemAdded", {"sku": "a", "unit_price": 2.0})])
    assert state == {"units_added": 3, "removals": 1, "last_price": 2.0, "last_cart": "s-1"}
