"""Billing: a second team package beside the shop, in the same code location (its own domain)."""
