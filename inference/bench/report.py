"""Rendering a benchmark report (the dict `bench.run_bench` returns): terminal table, Markdown, plots.

Only presentation lives here; every number is computed in run.py.
"""

from __future__ import annotations

import json
from pathlib import Path

# In every file `bench` writes (the JSON's first key, the Markdown's first line, the PNG's
# Software field), so that --overwrite knows the files it may replace (ground/outdir.py)
BENCH_MARK = "drafthead bench"
_MARK_WITHIN = 4096  # bytes: where each form holds the mark


def report_json(report: dict) -> str:
    """The report as the JSON file `bench --out` writes, marked as bench's."""
    return json.dumps({"written_by": BENCH_MARK, **report}, indent=2) + "\n"


def report_markdown(report: dict) -> str:
    """render_markdown's summary as the file `bench --markdown` writes, marked as bench's (an
    HTML comment, which Markdown does not show)."""
    return f"<!-- written by {BENCH_MARK} -->\n" + render_markdown(report)


def written_by_bench(path: Path) -> bool:
    """Whether the file at `path` is one `bench` wrote (BENCH_MARK near its start)."""
    with open(path, "rb") as f:
        return BENCH_MARK.encode() in f.read(_MARK_WITHIN)


def plain_label(settings: dict) -> str:
    """What the plain side of a report decoded with: transformers' generate(), or our engine with
    no drafting (on the llama.cpp backend, or through the row-invariant kernels)."""
    if settings.get("backend") == "llama.cpp":
        return "plain (llama.cpp backend)"
    if settings.get("row_invariant"):
        return "plain (ours, row-invariant)"
    return "plain generate()"


def method_rows(report: dict) -> list[dict]:
    """One row per decoding method: plain generate, HF prompt lookup (when compared), ours."""
    settings = report.get("settings", {})
    llama = settings.get("backend") == "llama.cpp"
    rows = [
        {
            "method": plain_label(settings),
            "tokens_per_s": report["baseline_tokens_per_s"],
            "speedup": 1.0,
            "tau": None,
            "identical": None,
        }
    ]
    if "hf_prompt_lookup_tokens_per_s" in report:
        rows.append(
            {
                "method": f"HF prompt lookup ({settings.get('hf_prompt_lookup_num_tokens', '?')})",
                "tokens_per_s": report["hf_prompt_lookup_tokens_per_s"],
                "speedup": report["hf_prompt_lookup_speedup"],
                "tau": None,
                "identical": report["hf_prompt_lookup_identical_fraction"],
            }
        )
    proposer = settings.get("proposer", "speculative")
    rows.append(
        {
            "method": f"drafthead: {proposer}" + (" (llama.cpp backend)" if llama else ""),
            "tokens_per_s": report["tokens_per_s"],
            "speedup": report["speedup"],
            "tau": report["tau"],
            "identical": report["identical_fraction"],
        }
    )
    return rows


def _cells(row: dict) -> list[str]:
    return [
        row["method"],
        f"{row['tokens_per_s']:.1f}",
        f"{row['speedup']:.2f}x",
        "-" if row["tau"] is None else f"{row['tau']:.2f}",
        "-" if row["identical"] is None else f"{100 * row['identical']:.0f}%",
    ]


HEADER = ["method", "tokens/s", "speedup", "tau", "identical"]


def _summary_lines(report: dict) -> list[str]:
    s = report.get("settings", {})
    rep = report["repetition"]
    rss = report.get("peak_rss_mb", {})
    lines = [
        f"target {s.get('target', '?')} ({s.get('model_dtype', '?')}, {s.get('device', '?')}, "
        f"{s.get('torch_threads', '?')} threads), {report['num_prompts']} prompts, "
        f"max_new_tokens {s.get('max_new_tokens', '?')}, temperature {s.get('sampling', {}).get('temperature', '?')}",
        f"repeated {rep['ngram']}-grams in outputs: plain {100 * rep['plain']:.1f}%, speculative {100 * rep['speculative']:.1f}%",
    ]
    if rss:
        ratio = "-" if rss.get("ratio") is None else f"{rss['ratio']:.3f}"
        lines.append(f"peak RSS: plain {rss['plain']:.0f} MB, speculative {rss['speculative']:.0f} MB (ratio {ratio})")
    div = report.get("divergences")
    if div and div["count"]:
        lines.append(
            f"outputs differing from plain: {div['count']}, of which near-ties "
            f"(logits within {div['near_tie_gap']} of each other): {div['near_ties']}"
        )
        ex = div["example"]
        if ex and "gap" in ex:
            lines.append(
                f"  e.g. at token {ex['position']} after {ex['context'][-40:]!r}: plain {ex['plain_token']!r} "
                f"({ex['plain_logit']:.3f}) vs speculative {ex['speculative_token']!r} ({ex['speculative_logit']:.3f})"
            )
    if s.get("backend") == "llama.cpp":
        lines.append(
            "llama.cpp's forward rounds a token differently alone and among a tree's nodes (measured: "
            'docs/llamacpp-backend.md "Exactness"): outputs may part from plain at near-ties, in bf16 '
            "far more often than in f32"
        )
    ceiling = report.get("ceiling")
    if ceiling:
        lines.append(
            f"against the ceiling: a verify forward costs {ceiling['verify_in_plain_steps']:.2f} plain steps, "
            f"a whole round {ceiling['round_in_plain_steps']:.2f}: tau / verify = "
            f"{ceiling['verify_only_ceiling']:.2f}x, tau / round = {ceiling['round_cost_speedup']:.2f}x"
        )
    ppa = report["per_position_acceptance"]
    if ppa:
        lines.append("accepted >= d drafts: " + ", ".join(f"d{d + 1} {100 * a:.0f}%" for d, a in enumerate(ppa[:8])))
    return lines


def difference_warning(report: dict) -> str | None:
    """First of a summary when outputs differ: `speedup` then compares two different texts, so
    the speedup over the text both sides share (run.py shared_speedup) comes with it."""
    identical = report.get("identical_fraction", 1.0)
    if identical >= 1.0 or "shared_speedup" not in report:
        return None
    return (
        f"outputs differ from {plain_label(report.get('settings', {}))} on {100 * (1 - identical):.0f}% of prompts: "
        f"the speedup below compares different texts; over the text both sides share it is "
        f"{report['shared_speedup']:.2f}x"
    )


def format_table(report: dict, profile: bool = False) -> str:
    """The terminal summary: a method table, then repetition, memory, acceptance (and profile);
    first, where outputs differ, the warning that says so."""
    rows = [HEADER] + [_cells(r) for r in method_rows(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    warning = difference_warning(report)
    out = ([warning, ""] if warning else []) + [line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]]
    out += [""] + _summary_lines(report)
    cats = report.get("per_category_tau", {})
    if len(cats) > 1:
        out.append("tau by category: " + ", ".join(f"{c} {t:.2f}" for c, t in cats.items()))
    by_context = report.get("tau_by_context", {})
    if len(by_context) > 1:
        out.append("tau by context length: " + ", ".join(f">={e} {b['tau']:.2f} ({b['rounds']} rounds)" for e, b in by_context.items()))
    if profile:
        out.append("engine time: " + _profile_text(report))
    return "\n".join(out)


def _profile_text(report: dict) -> str:
    seconds = report["profile"]["seconds"]
    fractions = report["profile"]["fractions"]
    order = sorted(seconds, key=lambda k: -seconds[k])
    return ", ".join(f"{k} {seconds[k]:.2f}s ({100 * fractions.get(k, 0):.0f}%)" for k in order)


def render_markdown(report: dict) -> str:
    """The same summary as a Markdown table plus notes (for READMEs and PR descriptions)."""
    warning = difference_warning(report)
    out = [f"**{warning}**", ""] if warning else []
    out += ["| " + " | ".join(HEADER) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(HEADER) - 1)) + " |"]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in method_rows(report)]
    out += [""] + [f"- {line}" for line in _summary_lines(report)]
    cats = report.get("per_category_tau", {})
    if cats:
        out += ["", "| category | tau |", "| --- | ---: |"] + [f"| {c} | {t:.2f} |" for c, t in cats.items()]
    by_context = report.get("tau_by_context", {})
    if by_context:
        out += ["", "| context tokens from | tau | rounds |", "| ---: | ---: | ---: |"]
        out += [f"| {e} | {b['tau']:.2f} | {b['rounds']} |" for e, b in by_context.items()]
    if report["profile"]["seconds"]:
        out += ["", f"- engine time: {_profile_text(report)}"]
    return "\n".join(out) + "\n"


def plot_report(report: dict, path: str | Path) -> Path:
    """Three panels: acceptance-length histogram, tau per category, tokens/s per method."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    hist = report["acceptance_length_histogram"]
    lengths = [int(k) for k in hist]
    axes[0].bar(lengths, [hist[str(k)] for k in lengths], color="tab:blue")
    axes[0].set(title=f"tokens per round (tau {report['tau']:.2f})", xlabel="tokens emitted in a round", ylabel="rounds")
    cats = report.get("per_category_tau", {})
    axes[1].barh(list(cats), list(cats.values()), color="tab:green")
    axes[1].axvline(1.0, color="grey", lw=0.8)
    axes[1].set(title="tau per category", xlabel="tau")
    rows = method_rows(report)
    names = [r["method"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    colors = ["grey"] + ["tab:orange"] * (len(rows) - 2) + ["tab:red"]  # plain, HF lookup, ours
    bars = axes[2].bar(range(len(rows)), values, color=colors)
    axes[2].set_xticks(range(len(rows)), names, rotation=10, fontsize=8)
    axes[2].set(title="decoding speed", ylabel="tokens/s", ylim=(0, 1.15 * max(values)))  # room for labels
    for bar, row in zip(bars, rows):
        axes[2].annotate(f"{row['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    s = report.get("settings", {})
    fig.suptitle(f"{s.get('target', '')} {s.get('model_dtype', '')} {s.get('device', '')}: {report['num_prompts']} prompts")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": BENCH_MARK} if path.suffix.lower() == ".png" else None)
    plt.close(fig)
    return path
