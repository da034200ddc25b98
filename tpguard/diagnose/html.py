"""One self-contained HTML page (no network, no script): quantities x steps around the first
divergence, each cell coloured by agreement, per-rank values and culprits on hover.

Every page carries MARKER: `tpguard diagnose --html FILE` overwrites FILE only when it holds one
(an earlier report), never a trace or any other file."""

from __future__ import annotations

import html

from tpguard.diagnose.matcher import StepView
from tpguard.diagnose.report import Diagnosis
from tpguard.divergence import causal_order, quantity_divergence, record_holders

MARKER = '<meta name="generator" content="tpguard diagnose">'
# Reports written before the marker began with exactly this.
LEGACY_START = "<!doctype html><html><head><meta charset='utf-8'><title>tpguard diagnose</title>"

_CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px;margin:0 0 8px} .verdict{font-weight:700}
.diverged{color:#b00020} .clean{color:#1b7f3a}
.box{background:#f6f6f6;border-left:4px solid #999;padding:8px 12px;margin:8px 0;max-width:1100px}
.box.cause{border-color:#b00020} .box.fix{border-color:#1b7f3a}
table{border-collapse:collapse;margin-top:12px} th,td{border:1px solid #ddd;padding:0}
th{background:#fafafa;font-weight:600;padding:4px 6px;font-size:12px;white-space:nowrap}
td.c{width:34px;height:24px;position:relative;text-align:center;font-size:11px}
td.ok{background:#cdebd3} td.bad{background:#f4a3a8} td.null{background:#eee}
td.first{outline:3px solid #b00020;outline-offset:-3px}
td.c .tip{display:none;position:absolute;z-index:9;left:30px;top:20px;background:#222;color:#fff;
text-align:left;padding:6px 8px;white-space:pre;font:12px ui-monospace,monospace;border-radius:4px}
td.c:hover .tip{display:block}
.legend{margin-top:8px} .legend span{display:inline-block;width:14px;height:14px;margin:0 4px -2px 12px;border:1px solid #ccc}
"""


def _cell(view: StepView | None, q: str, is_first: bool) -> str:
    if view is None or q not in view.by_quantity:
        return '<td class="c null"><span class="tip">not recorded</span></td>'
    by_rank = view.by_quantity[q]
    present = {r: v for r, v in by_rank.items() if v is not None}
    holders = record_holders(view.by_quantity)
    lacking = holders - set(present)  # they hold this record without this quantity: it differs
    if not present or (len(present) < 2 and not lacking):
        tip = "not captured" if not present else f"only rank {list(present)} captured"
        return f'<td class="c null"><span class="tip">{html.escape(tip)}</span></td>'
    d = quantity_divergence(q, by_rank, holders)
    lines = [f"step {view.step}  {view.site}  {q}"]
    lines += [f"rank {r}: {by_rank.get(r) or 'not captured'}" for r in sorted(set(by_rank) | lacking)]
    if d is None:
        cls, mark = "ok", ""
    else:
        cls, mark = "bad", "&#x2716;"
        lines.append(f"culprit rank(s): {d.culprit_ranks}  majority: {d.majority_ranks}")
    first = " first" if is_first else ""
    return f'<td class="c {cls}{first}">{mark}<span class="tip">{html.escape(chr(10).join(lines))}</span></td>'


def render_html(diag: Diagnosis) -> str:
    j = diag.to_json()
    a = diag.analysis
    f = j["first_divergence"]
    verdict = {"diverged": "<span class='verdict diverged'>DIVERGED</span>",
               "clean": "<span class='verdict clean'>CLEAN</span>",
               "nothing_compared": "<span class='verdict diverged'>NOTHING COMPARED</span>"}[j["verdict"]]
    head = [f"<h1>tpguard diagnose: run {html.escape(j['run_id'])}</h1>",
            f"<div>{verdict} &middot; {len(j['ranks'])} of {j['world_size']} ranks &middot; algo "
            f"{html.escape(j['algo'])} &middot; {j['steps']} steps &middot; {j['compared_steps']} compared &middot; {j['divergent_steps']} divergent</div>"]
    if f:
        head.append(f"<div class='box'>First divergence: step <b>{f['step']}</b>, site <b>"
                    f"{html.escape(f['site'])}</b>, quantity <b>{html.escape(f['quantity'])}</b>, culprit "
                    f"rank(s) <b>{f['culprit_ranks']}</b> (majority {f['majority_ranks']})</div>")
    if diag.cause:
        head.append(f"<div class='box cause'><b>Cause.</b> {html.escape(diag.cause)}</div>")
        head.append(f"<div class='box fix'><b>Fix.</b> {html.escape(diag.fix)}</div>")
    for x in j["findings"]:
        head.append(f"<div class='box cause'>finding: {html.escape(x)}</div>")
    for sw in j["switches"]:
        head.append(f"<div class='box fix'><b>Switched</b> at step {sw['step']}, site "
                    f"{html.escape(str(sw['site']))}: {html.escape(sw['message'])}</div>")
    for w in j["warnings"]:
        head.append(f"<div class='box'>warning: {html.escape(w)}</div>")

    views = a.window
    steps = sorted({v.step for v in views})
    sites = sorted({v.site for v in views})
    qs = causal_order(diag.ts.quantities, {q for v in views for q in v.by_quantity})
    by_key = {(v.step, v.site): v for v in views}
    grid = ["<table><tr><th>quantity</th>"]
    switched = {(sw["step"], sw["site"]) for sw in j["switches"]}
    for s in steps:
        for site in sites:
            label = f"{s}" if len(sites) == 1 else f"{s}<br>{html.escape(site)}"
            if (s, site) in switched:  # policy fix switched the cause off after this step
                label += "<br>switch"
            grid.append(f"<th>{label}</th>")
    grid.append("</tr>")
    for q in qs:
        grid.append(f"<tr><th style='text-align:left'>{html.escape(q)}</th>")
        for s in steps:
            for site in sites:
                is_first = bool(f) and s == f["step"] and site == f["site"] and q == f["quantity"]
                grid.append(_cell(by_key.get((s, site)), q, is_first))
        grid.append("</tr>")
    grid.append("</table>")
    if not views:
        grid = ["<p>No steps to show.</p>"]
    legend = ("<div class='legend'><span style='background:#cdebd3'></span>agree"
              "<span style='background:#f4a3a8'></span>differ"
              "<span style='background:#eee'></span>not captured"
              " &nbsp;(hover a cell for per-rank values; the outlined cell is the first divergence)</div>")
    return ("<!doctype html><html><head><meta charset='utf-8'>" + MARKER + "<title>tpguard diagnose</title>"
            f"<style>{_CSS}</style></head><body>{''.join(head)}{legend}{''.join(grid)}</body></html>")


def is_report(head: bytes) -> bool:
    """Whether a file starting with `head` (its first few KB) is a page this module wrote."""
    return MARKER.encode() in head or head.startswith(LEGACY_START.encode())
