"""``fedemu traces``: convert trace files to fedemu's own format, and summarise one.

``convert`` reads FedScale pickles, Mahimahi traces and fedemu CSVs (node/net/
trace_files.py) and writes one fedemu CSV: entries of the same name in several inputs
(FedScale's two files name the same clients) are merged into one entry with every
field. ``stats`` prints what a file holds (entries, fields, time span, the
distribution of rates, compute and availability) and draws it.
"""
from __future__ import annotations

import math
from pathlib import Path

import click
import numpy as np

from fedemu.node.net import trace_files
from fedemu.node.net.trace_files import RATE_FIELDS, TraceTable
from fedemu.node.net.traces import TraceError

FORMAT_CHOICE = click.Choice(["auto", *trace_files.FORMATS])
# convert's averaging window for Mahimahi traces: a packet is 1,500 bytes, so 1 ms steps
# alternate between 12 Mbit/s bursts and nothing; 100 ms gives a rate to 0.12 Mbit/s.
MAHIMAHI_WINDOW_MS = 100


@click.group("traces")
def traces() -> None:
    """Trace files: convert them to fedemu's CSV, or summarise one."""


@traces.command("convert")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="The fedemu CSV to write.")
@click.option("--format", "fmt", type=FORMAT_CHOICE, default="auto", show_default=True,
              help="The inputs' format (auto: told by their content).")
@click.option("--direction", type=click.Choice(["auto", "up", "down", "both"]), default="auto", show_default=True,
              help="Mahimahi inputs: the link(s) they describe (auto: a file named *.up the uplink, *.down the "
                   "downlink, any other both).")
@click.option("--window-ms", type=click.IntRange(min=1), default=MAHIMAHI_WINDOW_MS, show_default=True,
              help="Mahimahi inputs: the rate written is the delivery opportunities' averaged over windows of "
                   "this many ms (equal consecutive windows merge into one row).")
def convert(inputs: tuple[str, ...], out: str, fmt: str, direction: str, window_ms: int) -> None:
    """Convert trace files (FedScale pickles, Mahimahi traces, fedemu CSVs) into one fedemu CSV."""
    fields = {"auto": None, "up": ("up_bytes_per_s",), "down": ("down_bytes_per_s",), "both": RATE_FIELDS}[direction]
    try:
        merged = merge([trace_files.read(path, fmt, fields, window_ms) for path in inputs])
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)  # -o runs/population.csv before any run made runs/
    with open(tmp, "w", newline="") as f:
        rows = trace_files.write_csv(merged, f)
    tmp.replace(out)  # a reader never sees half a file
    click.echo(f"{out}: {len(merged.entries)} entries, {rows} rows ({', '.join(sorted(merged.fields()))})")


def merge(tables: list[TraceTable]) -> TraceTable:
    """One table with every entry of ``tables``; an entry named in several gets the
    fields of each (a field in two of them, or two different periods, is an error)."""
    merged = TraceTable(" + ".join(t.source for t in tables), "fedemu")
    origin: dict[tuple[str, str], str] = {}
    for table in tables:
        for entry, fields in table.entries.items():
            target = merged.entries.setdefault(entry, {})
            for name, series in fields.items():
                if name in target:
                    raise TraceError(f"entry {entry!r} has {name} in both {origin[entry, name]} and {table.source}")
                target[name] = series
                origin[entry, name] = table.source
            if entry in table.periods:
                if merged.periods.get(entry, table.periods[entry]) != table.periods[entry]:
                    raise TraceError(f"entry {entry!r} repeats every {merged.periods[entry]:g} s in one input and "
                                     f"every {table.periods[entry]:g} s in {table.source}")
                merged.periods[entry] = table.periods[entry]
    return merged


# --- stats ---------------------------------------------------------------------------------


def summary(table: TraceTable) -> dict:
    """What ``stats`` prints: counts, span, and per-entry distributions."""
    entries = list(table.entries)
    span = max([table.periods.get(e, 0.0) for e in entries] +
               [float(times[-1]) for fields in table.entries.values() for times, _ in fields.values()])
    out: dict = {"source": table.source, "format": table.format, "entries": len(entries),
                 "fields": sorted(table.fields()), "span_s": span, "repeating": len(table.periods)}
    for name in RATE_FIELDS:
        means = [_mean(table.series(e, name), span) for e in entries if name in table.entries[e]]
        if means:
            out[name] = np.asarray(means)
    if len(entries) == 1 and any(name in out for name in RATE_FIELDS):  # one link (Mahimahi): its rate over time
        name = next(n for n in RATE_FIELDS if n in out)
        rate = table.series(entries[0], name)
        step = max((span or 1.0) / 400, 0.1)  # Mahimahi's steps are 1 ms: average over 100 ms at least
        grid = np.arange(0.0, span or 1.0, step)
        out["rate_over_time"] = (grid, np.asarray([rate.served(t, t + step) / step for t in grid]), step)
    for name in ("flops", "example_s"):
        values = [float(table.entries[e][name][1][0]) for e in entries if name in table.entries[e]]
        if values:
            out[name] = np.asarray(values)
    online = [table.series(e, "online") for e in entries if "online" in table.entries[e]]
    if online:
        horizon = span or 1.0
        out["online_share"] = np.asarray([_mean(s, horizon) for s in online])  # each entry's time online
        grid = np.linspace(0.0, horizon, 400, endpoint=False)
        out["online_over_time"] = (grid, np.asarray([np.mean([s.value_at(t) for s in online]) for t in grid]))
    return out


def _mean(series, span: float) -> float:
    """A series' time-weighted mean over one period (or over [0, span])."""
    horizon = series.period or span
    if not horizon:
        return float(series.values[0])
    ends = np.append(series.times[1:], horizon)
    ends = np.minimum(ends, horizon)
    widths = np.clip(ends - series.times, 0.0, None)
    return float(np.sum(series.values * widths) / horizon)


def _quantiles(values: np.ndarray, scale: float = 1.0) -> str:
    q = np.quantile(values * scale, [0.0, 0.1, 0.5, 0.9, 1.0])
    return "min {:.4g}  p10 {:.4g}  median {:.4g}  p90 {:.4g}  max {:.4g}".format(*q)


@traces.command("stats")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=FORMAT_CHOICE, default="auto", show_default=True)
@click.option("--figure", type=click.Path(dir_okay=False),
              help="Where to draw it (PNG); default: FILE.stats.png, beside FILE.")
def stats(file: str, fmt: str, figure: str | None) -> None:
    """Summarise a trace file: entries, time span, the distribution of rates, compute
    and availability; and a figure of them."""
    try:
        table = trace_files.read(file, fmt)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    s = summary(table)
    click.echo(f"{file}: {s['format']} trace, {s['entries']} {'entry' if s['entries'] == 1 else 'entries'} "
               f"({s['repeating']} repeating), span {s['span_s']:g} s")
    click.echo(f"  fields: {', '.join(s['fields'])}")
    for name in RATE_FIELDS:
        if name in s:
            click.echo(f"  {name[:-len('_bytes_per_s')]}link, Mbit/s (each entry's mean): "
                       f"{_quantiles(s[name], 8e-6)}")
    if "flops" in s:
        click.echo(f"  compute, GFLOP/s: {_quantiles(s['flops'], 1e-9)}")
    if "example_s" in s:
        click.echo(f"  compute, ms per training example: {_quantiles(s['example_s'], 1e3)}")
    if "online_share" in s:
        grid, share = s["online_over_time"]
        click.echo(f"  share of time online (each entry): {_quantiles(s['online_share'])}")
        click.echo(f"  entries online at once: mean {share.mean():.3f}, min {share.min():.3f}, max {share.max():.3f}")
    # Beside the trace, as a report goes under its run: not wherever the command ran.
    out = Path(figure) if figure else Path(file + ".stats.png")
    draw(s, out)
    click.echo(f"  figure: {out}")


def draw(s: dict, out: Path) -> None:
    """The figure of ``stats_figure`` as a PNG at ``out``."""
    fig = stats_figure(s)
    fig.savefig(out, dpi=110)
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    import matplotlib.pyplot as plt

    plt.close(fig)


def stats_figure(s: dict):
    """The rates, compute and availability of a ``summary``, a panel each; returns the Figure."""
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    import matplotlib.pyplot as plt

    panels = [p for p in ("rates", "compute", "online") if
              (p == "rates" and any(n in s for n in RATE_FIELDS)) or (p == "compute" and ("flops" in s or "example_s" in s))
              or (p == "online" and "online_share" in s)]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "rates" and "rate_over_time" in s:
            grid, rate, step = s["rate_over_time"]
            ax.step(grid, rate * 8e-6, where="post")
            ax.set_xlabel("time (s)")
            ax.set_ylabel(f"rate (Mbit/s, mean over {step * 1000:g} ms)")
            ax.set_ylim(bottom=0)
        elif panel == "rates":
            drawn = [s[name] * 8e-6 for name in RATE_FIELDS if name in s]
            for name, style in zip(RATE_FIELDS, ("-", "--")):  # dashed: the downlink, often the uplink's equal
                if name in s:
                    _cdf(ax, s[name] * 8e-6, name[:-len("_bytes_per_s")] + "link", style)
            ax.set_xlabel("mean rate per entry (Mbit/s)")
            _spread_axis(ax, np.concatenate(drawn))
        elif panel == "compute":
            if "example_s" in s:
                drawn = s["example_s"] * 1e3
                _cdf(ax, drawn, "ms per example")
                ax.set_xlabel("training time per example (ms)")
            else:
                drawn = s["flops"] * 1e-9
                _cdf(ax, drawn, "GFLOP/s")
                ax.set_xlabel("training speed (GFLOP/s)")
            _spread_axis(ax, drawn)
        else:
            grid, share = s["online_over_time"]
            hours = s["span_s"] > 4 * 3600
            ax.plot(grid / (3600 if hours else 1), share)
            ax.set_xlabel("time (h)" if hours else "time (s)")
            ax.set_ylabel("share of entries online")
            ax.set_ylim(0, 1)
        if panel != "online" and not (panel == "rates" and "rate_over_time" in s):
            ax.set_ylabel("share of entries")
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(s['source']).name}: {s['entries']} {'entry' if s['entries'] == 1 else 'entries'}",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _spread_axis(ax, values: np.ndarray) -> None:
    """A log x axis where the values span a decade or more, labelled at 1, 2 and 5 of
    each decade as plain numbers; a linear one otherwise (a log axis under a decade
    shows one labelled tick, or none)."""
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    import matplotlib.ticker

    values = values[np.isfinite(values) & (values > 0)]
    if not len(values) or values.max() < 10 * values.min():
        return
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no crowded labels between the 1-2-5 ones


def _cdf(ax, values: np.ndarray, label: str, style: str = "-") -> None:
    values = np.sort(values)
    ax.step(values, np.arange(1, len(values) + 1) / len(values), style, where="post", label=label)
    if len(values) and math.isfinite(values[-1]):
        ax.set_ylim(0, 1.02)
