"""Rows of figures, their per-repetition ratios, and the targets they are judged against.

Every figure is recorded per repetition. Systems run interleaved inside a repetition (A, B, A,
B ...), so a row's ratio to its floor (or to DCP) is computed within each repetition and the
report gives the median of those ratios: the disk here swings 2-3x between runs, and a ratio of
two numbers taken seconds apart cancels most of that swing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.common import median, minimum

OK, SKIPPED, NOT_IMPLEMENTED, ERROR = "ok", "skipped", "not implemented yet", "error"


@dataclass
class Row:
    id: str
    section: str
    label: str
    unit: str = "s"  # "s" (lower is better), "x" (a ratio), "B" (bytes)
    floor: str | None = None  # row id of the floor this figure is divided by
    dcp: str | None = None  # row id of the DCP figure it is compared with
    status: str = OK
    note: str = ""
    values: dict[int, float] = field(default_factory=dict)  # repetition -> value
    extra: dict[str, Any] = field(default_factory=dict)
    # filled by finalize()
    min: float | None = None
    median: float | None = None
    ratio_floor: float | None = None
    ratio_dcp: float | None = None
    ratios_floor: list[float] = field(default_factory=list)
    ratios_dcp: list[float] = field(default_factory=list)


@dataclass
class Target:
    id: str
    text: str  # what the issue asks
    value: float | None
    limit: float
    op: str  # "<=" or ">=" or "<"
    detail: str = ""
    profile: str | None = None  # path of the profile explaining a failure
    analysis: str = ""

    @property
    def passed(self) -> bool | None:
        if self.value is None:
            return None
        if self.op == "<=":
            return self.value <= self.limit
        if self.op == "<":
            return self.value < self.limit
        return self.value >= self.limit

    @property
    def verdict(self) -> str:
        p = self.passed
        return "n/a" if p is None else ("PASS" if p else "FAIL")


class Results:
    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.targets: list[Target] = []
        self.meta: dict[str, Any] = {}
        self.sections: dict[str, Any] = {}  # free-form data per section (curves, plans, notes)
        self.notes: list[str] = []

    def row(self, id: str, section: str, label: str, **kw: Any) -> Row:
        r = self.rows.get(id)
        if r is None:
            r = self.rows[id] = Row(id, section, label, **kw)
        return r

    def add(self, id: str, rep: int, value: float | None) -> None:
        if value is not None:
            self.rows[id].values[rep] = float(value)

    def skip(self, id: str, section: str, label: str, note: str, status: str = SKIPPED) -> Row:
        r = self.row(id, section, label)
        r.status, r.note = status, note
        return r

    def finalize(self) -> None:
        for r in self.rows.values():
            vals = list(r.values.values())
            r.min, r.median = minimum(vals), median(vals)
            r.ratios_floor = self._ratios(r, r.floor)
            r.ratios_dcp = self._ratios(r, r.dcp)
            r.ratio_floor = median(r.ratios_floor)
            r.ratio_dcp = median(r.ratios_dcp)

    def _ratios(self, r: Row, other: str | None) -> list[float]:
        o = self.rows.get(other) if other else None
        if o is None:
            return []
        return [r.values[k] / o.values[k] for k in sorted(r.values) if k in o.values and o.values[k] > 0]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Results:
        """Rebuild a run from its JSON (to regenerate the report without measuring again)."""
        res = cls()
        res.meta, res.sections, res.notes = data["meta"], data["sections"], data["notes"]
        for d in data["rows"]:
            d = dict(d)
            d["values"] = {int(k): v for k, v in d["values"].items()}
            res.rows[d["id"]] = Row(**d)
        res.finalize()
        return res

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "rows": [asdict(r) for r in self.rows.values()],
            "targets": [{**asdict(t), "passed": t.passed, "verdict": t.verdict} for t in self.targets],
            "sections": self.sections,
            "notes": self.notes,
        }
