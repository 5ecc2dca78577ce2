"""What `specport bench --speculative` adds up: per engine, over all prompts and per category.

Each prompt's figures (its median per-token time over the rounds, its token count, whether its
tokens equal plain greedy's, its draft statistics) are added to the whole run and to the
prompt's category, so a category's speed-up is computed exactly as the run's is: plain's summed
time over the engine's, on that category's prompts alone. Separate from the run loop
(speculative.py) so the two group levels share one implementation.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from specport.runtime.speculative.metrics import SpecDecodingStats

ALL = "\x00all"  # the whole run's group key (no category can be this)
COPY_N = 3  # the n-gram length of ``copied_share``: prompt lookup's usual match length


def copied_share(prompt: Sequence[int], answer: Sequence[int], n: int = COPY_N) -> float | None:
    """The share of the answer's n-grams that occur in the prompt: how much of what the model
    wrote it could have copied from the request (summaries and answers from a passage copy a
    lot, open chat little), which bounds what drafting from the prompt can gain."""
    grams = [tuple(answer[i : i + n]) for i in range(len(answer) - n + 1)]
    if not grams:
        return None
    seen = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    return sum(g in seen for g in grams) / len(grams)


def _empty() -> dict[str, Any]:
    return {"seconds": 0.0, "tokens": 0, "equal": True, "drafted": 0, "accepted": 0, "steps": 0}


class SpecTally:
    """Per group (the run, each category), per engine: summed time, tokens and drafts."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.groups: dict[str, dict[str, dict[str, Any]]] = {}
        self.prompts: dict[str, int] = {}
        self.copied: dict[str, list[float]] = {}  # per group: each prompt's ``copied_share``

    def add(
        self,
        category: str | None,
        per: dict[str, list[float]],  # seconds per token, one per round
        counts: dict[str, int],  # tokens made
        equal: dict[str, bool],  # tokens equal plain greedy's in every round
        stats: dict[str, dict[str, Any]],  # the last round's speculative metrics
        copied: float | None = None,  # copied_share of plain greedy's answer
        cpu: dict[str, list[float]] | None = None,  # decoding CPU s per token, one per round
    ) -> None:
        """One prompt's rounds, to the run and to its category."""
        keys = [ALL] if category is None else [ALL, category]
        for key in keys:
            self.prompts[key] = self.prompts.get(key, 0) + 1
            if copied is not None:
                self.copied.setdefault(key, []).append(copied)
            group = self.groups.setdefault(key, {name: _empty() for name in self.names})
            for name in self.names:
                _add(group[name], per[name], counts[name], equal[name], stats.get(name, {}))
                rounds = (cpu or {}).get(name)
                if rounds:  # engines whose CPU time is known
                    group[name]["cpu_seconds"] = (
                        group[name].get("cpu_seconds", 0.0)
                        + statistics.median(rounds) * counts[name]
                    )

    @property
    def categories(self) -> list[str]:
        return [key for key in self.groups if key != ALL]

    def rows(
        self, category: str | None = None, overheads: dict[str, list[float]] | None = None
    ) -> list[dict[str, Any]]:
        """A row per engine for the run (``category`` None) or one category."""
        group = self.groups[ALL if category is None else category]
        plain_s = group["plain"]["seconds"]
        rows = [
            _row(name, group[name], plain_s, (overheads or {}).get(name)) for name in self.names
        ]
        plain_cpu = group["plain"].get("cpu_seconds")
        for row, name in zip(rows, self.names):
            spent = group[name].get("cpu_seconds")
            if plain_cpu and spent:  # the same ratio from decoding CPU time (load-steady)
                row["cpu_speedup_vs_plain"] = round(plain_cpu / spent, 3)
        return rows

    def copied_share(self, category: str | None = None) -> float | None:
        """The mean ``copied_share`` of the group's prompts."""
        shares = self.copied.get(ALL if category is None else category)
        return round(statistics.mean(shares), 3) if shares else None

    def category_reports(self) -> list[dict[str, Any]]:
        """Per category, in the order first seen: its prompt count, copied share and rows."""
        return [
            {
                "category": c,
                "prompts": self.prompts[c],
                "answer_ngrams_in_prompt": self.copied_share(c),
                "rows": self.rows(c),
            }
            for c in self.categories
        ]


def _add(t: dict[str, Any], per: list[float], count: int, equal: bool, one: dict[str, Any]) -> None:
    t["seconds"] += statistics.median(per) * count
    t["tokens"] += count
    t["equal"] &= equal
    for key in ("drafted", "accepted", "steps"):
        t[key] += int(one.get(key, 0))
    for what, steps in one.get("choices", {}).items():
        chose = t.setdefault("choices", {})  # auto: steps per choice
        chose[what] = chose.get(what, 0) + steps
    t.setdefault("positions", SpecDecodingStats()).merge(
        SpecDecodingStats(
            drafted_per_pos=list(one.get("drafted_per_position", [])),
            accepted_per_pos=list(one.get("accepted_per_position", [])),
        )
    )


def _row(
    name: str, t: dict[str, Any], plain_s: float, overheads: list[float] | None
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "engine": name,
        "decode_tok_per_s": round(t["tokens"] / t["seconds"], 2) if t["seconds"] else None,
        "speedup_vs_plain": round(plain_s / t["seconds"], 3) if t["seconds"] else None,
        "tokens_equal_plain": t["equal"],
    }
    if overheads:  # wall minus onnxruntime time per decode step, median over runs
        row["step_overhead_ms"] = round(statistics.median(overheads), 3)
    if t["steps"]:
        row["mean_accepted_length"] = round(1 + t["accepted"] / t["steps"], 3)
        if t["drafted"]:
            row["acceptance_rate"] = round(t["accepted"] / t["drafted"], 3)
        positions = t.get("positions")
        if positions is not None and positions.drafted_per_pos:
            # where drafts stop paying, and how often adaptive K drafted at all
            rates = positions.acceptance_rate_per_pos
            row["acceptance_rate_per_position"] = [round(r, 3) for r in rates]
            row["steps_that_drafted"] = round(positions.drafted_per_pos[0] / t["steps"], 3)
    if t.get("choices"):  # auto: steps per choice, counted like the steps above
        row["choices"] = dict(sorted(t["choices"].items(), key=lambda kv: -kv[1]))
    return row


def format_category_table(report: dict[str, Any]) -> str:
    """Per category, per engine: speed-up vs plain (accepted tokens per step); plain's cell
    is its own tok/s. A dagger marks an engine whose tokens were not plain greedy's."""
    groups = report.get("categories") or []
    if not groups:
        return ""
    names = [r["engine"] for r in groups[0]["rows"]]
    header = ["category", "prompts", "copied", *names]
    lines = [header]
    for g in groups:
        share = g.get("answer_ngrams_in_prompt")
        cells = [g["category"], str(g["prompts"]), "-" if share is None else f"{100 * share:.0f}%"]
        for r in g["rows"]:
            cells.append(_cell(r))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))
        )
        for line in lines
    )
    return (
        "per category: speed-up vs plain in wall time (accepted tokens per step) and in CPU "
        "time (cpu, decoding alone); plain: its tok/s; "
        f"copied: share of plain greedy's answer {COPY_N}-grams found in the prompt; "
        "† = tokens differ from plain greedy's\n" + text
    )


def _cell(r: dict[str, Any]) -> str:
    dagger = "" if r["tokens_equal_plain"] else "†"
    if r["engine"] == "plain":
        return f"{r['decode_tok_per_s'] or 0:.1f} tok/s"
    mal = r.get("mean_accepted_length")
    steps = "" if mal is None else f" ({mal:.2f})"
    cpu = r.get("cpu_speedup_vs_plain")
    by_cpu = "" if cpu is None else f" cpu {cpu:.2f}x"
    return f"{r['speedup_vs_plain'] or 0:.2f}x{dagger}{steps}{by_cpu}"
