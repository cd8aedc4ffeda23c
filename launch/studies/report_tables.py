"""The report's Markdown tables: a row per run (or sweep point), and a sweep's summary,
a row per condition and algorithm (also ``markdown_table`` for compare)."""
from __future__ import annotations

from .labels import algorithm_label, fmt, short
from .report_groups import Cell, algorithms, combinations, condition_axes, matches, metric
from .results import RunRecord, SweepData, first_round_reaching, flat, times_to_target


INTERPOLATED = "interpolated"  # the label of a figure that lies between evaluations


def _cell(v, digits: int = 2) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}"


def run_rows(runs: list[RunRecord], target: float, keys: list[str]) -> list[list[str]]:
    rows = []
    for r in runs:
        tt = times_to_target(r.curve, target) if target else {}
        final, best = r.final_accuracy(), r.best_accuracy()
        rows.append([*(fmt(r.params.get(k, flat(r.config).get(k))) for k in keys), r.status,
                     str(int(r.curve.rounds[-1])) if len(r.curve) else "0",
                     _cell(final * 100 if final is not None else None), _cell(best * 100 if best is not None else None),
                     _cell(r.curve.mb_up[-1] if len(r.curve) else None, 1),
                     _cell(r.curve.emulated_s[-1] if len(r.curve) else None, 1),
                     *([_cell(first_round_reaching(r.curve, target), 0), _cell(tt["rounds"], 1),
                        _cell(tt["emulated_s"], 1), _cell(tt["mb_up"], 1)] if target else [])])
    return rows


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def run_head(keys: list[str], target: float) -> list[str]:
    head = [short(k) for k in keys] + ["status", "rounds", "final acc (%)", "best acc (%)", "MB up", "emulated s"]
    if target:
        t = f"{target * 100:g}%"
        # The "to" figures lie between evaluations (results.time_to_target): labelled so, beside
        # the first round that reached it, the launcher's figure.
        head += [f"first round at {t}", f"rounds to {t} ({INTERPOLATED})", f"emulated s to {t} ({INTERPOLATED})",
                 f"MB up to {t} ({INTERPOLATED})"]
    return head


def summary_rows(data: SweepData) -> tuple[list[str], list[list[str]]]:
    """One row per (condition, algorithm): means over repetitions."""
    conds = condition_axes(data)
    head = [short(k) for k in conds] + ["algorithm", "runs", "final acc (%)", "best acc (%)"]
    if data.target:
        head += [f"reached {data.target * 100:g}%", f"emulated s to {data.target * 100:g}% ({INTERPOLATED})"]
    rows = []
    for combo in combinations(data, conds):
        for algo in algorithms(data):
            runs = [r for r in data.completed if r.algorithm == algo and matches(r, combo)]
            if not runs:
                continue
            row = [*(fmt(v) for v in combo.values()), algorithm_label(algo), str(len(runs)),
                   _cell(Cell([metric(r, "final_accuracy", 0) for r in runs]).mean()),
                   _cell(Cell([metric(r, "best_accuracy", 0) for r in runs]).mean())]
            if data.target:
                cell = Cell([metric(r, "tt_emulated_s", data.target) for r in runs])
                row += [f"{len(cell.reached)}/{len(runs)}", _cell(cell.mean(), 1)]
            rows.append(row)
    return head, rows
