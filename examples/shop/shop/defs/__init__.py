"""The shop's defs folder: what `dg` loads (one component: es_pipeline over the shop's and billing's domains)."""
