"""`Result`: how far one update brought its table, whatever its kind: the `events` version it holds now and the one
it held before (for the snapshots, over `stream_state`: that table's version, `over`), the events it folded, where the work ran, and, when it is short of the `events` version it read,
why. The kind's own figures (keys updated, rows per typed table, …) ride along in `figures`.

A tailing run reports a table only when its result `caught_up` (lake/follow.py): a table short of events reported
as kept up would be stale while reported fresh.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

Ran = Literal["local", "spark"]  # where an update ran: this process (pyarrow, delta-rs), or Spark


@dataclass(frozen=True)
class Result:
    table: str
    events_version: int  # the version of `events` the table holds now (of `over`: its source)
    previous_events_version: int  # the one it held before; -1: built whole (a first build, or a rebuild)
    events_folded: int  # events this update folded (the increment's, or all of them on a whole build; source rows)
    engine: Ran = "local"
    rows: int | None = None  # the table's rows after the update, where the update counted them
    figures: Mapping[str, int | str | bool] = field(default_factory=dict)  # the kind's own, as its asset shows them
    short: str | None = None  # why the table is short of `events_version` (None: it holds every event of it)
    over: str = "events"  # the table its position is over: `events`, or `stream_state` (the snapshots)

    @property
    def worked(self) -> bool:
        """Whether the update folded events (else the table was up to date)."""
        return bool(self.events_folded)

    @property
    def caught_up(self) -> bool:
        """Whether the table holds every event of the `events` version the update read."""
        return self.short is None

    @property
    def full_rebuild(self) -> bool:
        return self.previous_events_version < 0

    def per(self, figure: str) -> dict[str, int]:
        """A figure the kind gives per table (`<figure>/<table>`: rows written, values overflowed), by table."""
        prefix = f"{figure}/"
        return {k[len(prefix):]: int(v) for k, v in self.figures.items() if k.startswith(prefix)}

    def listed(self, figure: str) -> tuple[str, ...]:
        """A figure that lists names (", "-joined; "-": none), as a tuple."""
        text = str(self.figures.get(figure, "-"))
        return () if text == "-" else tuple(text.split(", "))

    def with_figures(self, **figures: int | str | bool) -> Result:
        """This result with `figures` set beside (or over) its own."""
        return replace(self, figures={**self.figures, **figures})

    def metadata(self) -> dict[str, int | str | bool]:
        """The update's figures, as its asset's materialization shows them."""
        out: dict[str, int | str | bool] = {} if self.rows is None else {"dagster/row_count": self.rows}
        if self.over != "events":  # its version is its source's; the rows it took from it are its figures
            return {**out, **self.figures, f"{self.over}_version": self.events_version, "engine": self.engine}
        out.update({"events_folded": self.events_folded, **self.figures, "events_version": self.events_version,
                    "full_rebuild": self.full_rebuild, "engine": self.engine})
        if self.short is not None:
            out["short_of_events"] = self.short
        return out
