"""What every exactness report shares: its verdict and its JSON form.

A report is a frozen dataclass whose ``cases`` each carry ``rejected`` (``check.CheckReport``
against the exact reference, ``two_sample.TwoSampleReport`` against a plain server)."""

from __future__ import annotations

import dataclasses
import json


class VerdictReport:
    """Mixin for report dataclasses with a ``cases`` field of objects with a ``rejected`` flag."""

    @property
    def passed(self) -> bool:
        return not any(case.rejected for case in self.cases)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["verdict"] = self.verdict
        return json.dumps(data, indent=2, default=float)
