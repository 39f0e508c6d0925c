"""The shop's accounts as a declared fold (es_pipeline.declared): a summary the engines compute natively.

`ES_PIPELINE_DOMAIN=shop.summary` folds the carts with shop.domain's Python reducer and the accounts by declaration:
a first build aggregates every account in one query (DuckDB in process), no Python call per event. The same events
as shop.domain's `account` reducer, kept another way: the balance an exact decimal, the deposits counted.
"""

from __future__ import annotations

import pyarrow as pa

from es_pipeline.declared import count, first, last, last_of, total
from es_pipeline.domain import Domain
from shop import domain as python_domain

summary = Domain("shop-summary")
summary.upcaster("ItemAdded", version=1, stream_types=["cart"])(python_domain.item_added_with_unit_price)
summary.reducer("cart", revision=1, state=python_domain.Cart, history=True)(python_domain.cart)


# `stream_state_account`'s columns under this domain (an Arrow schema: a decimal column needs its precision).
ACCOUNT_SUMMARY = pa.schema([("owner", pa.string()), ("currency", pa.string()), ("status", pa.string()),
                             ("balance", pa.decimal128(38, 2)), ("deposits", pa.int64()), ("withdrawals", pa.int64())])


ACCOUNT_FIELDS = {  # also what bench/declared_fold.py measures
    "owner": first("owner", of=["Opened"]),
    "currency": last("currency", of=["Opened"]),
    "status": last_of({"Opened": "open", "Closed": "closed"}),
    "balance": total("amount", add=["Deposited"], subtract=["Withdrawn"], scale=2),
    "deposits": count(of=["Deposited"]),
    "withdrawals": count(of=["Withdrawn"]),
}
summary.declare("account", revision=1, state=ACCOUNT_SUMMARY, fields=ACCOUNT_FIELDS)
