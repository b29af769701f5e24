"""The `tune` report: one self-contained HTML page and a Markdown twin, from the tune JSON dict.

``write_report(data, out_dir)`` writes ``out_dir/index.html`` (inline CSS, every chart embedded
as a base64 ``data:`` URI, so the single file can be mailed) and ``out_dir/report.md`` (charts
as PNG files next to it). ``data`` is the dict ``mixprec tune --json`` writes (``kind: "tune"``);
any key may be missing or null in older or partial files: what is there is rendered, the rest
is left out, and nothing raises. Everything that comes from the data is escaped.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import math
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SECTIONS = ("Recommendation", "Candidates", "Charts", "Lint findings", "Exports", "Environment")
EXPORT_TARGETS = {
    "mixprec": "mixprec",
    "pytorch": "PyTorch (autocast)",
    "lightning": "Lightning",
    "accelerate": "Accelerate",
    "deepspeed": "DeepSpeed",
    "fsdp2": "FSDP2",
    "hf": "Hugging Face Trainer",
}
CHART_TITLES = {
    "bench": "Throughput and peak memory",
    "check": "Loss curves against fp32 and per-layer fp16 headroom",
}
# status / verdict -> colour class: green, red, amber, grey
_TONE = {
    "recommended": "good",
    "passed": "good",
    "pass": "good",
    "ok": "good",
    "rejected": "bad",
    "fail": "bad",
    "error": "bad",
    "oom": "bad",
    "pruned": "warn",
    "slower": "warn",
    "unsupported": "muted",
}

# ---------------------------------------------------------------------------------------------
# Tolerant access and number formatting


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else []


def _num(x: Any) -> float | None:
    """A number, or None; jsonio writes inf/NaN as strings, so those come back as floats."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def _text(x: Any) -> str:
    if x is None:
        return ""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (list, tuple)):
        return ", ".join(_text(v) for v in x)
    return str(x)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def fmt_speedup(x: Any) -> str:
    v = _num(x)
    return f"{v:.2f}x" if _finite(v) else ""


def fmt_throughput(x: Any) -> str:
    v = _num(x)
    return f"{v:,.1f}" if _finite(v) else ""


def fmt_bytes(x: Any) -> str:
    """Bytes as KiB (below 1 MiB), MiB or GiB; negative values keep their sign."""
    v = _num(x)
    if not _finite(v):
        return ""
    assert v is not None
    sign, a = ("-" if v < 0 else ""), abs(v)
    if a >= 2**30:
        return f"{sign}{a / 2**30:.2f} GiB"
    if a >= 2**20:
        return f"{sign}{a / 2**20:.1f} MiB"
    if a >= 2**10:
        return f"{sign}{a / 2**10:.1f} KiB"
    return f"{sign}{a:.0f} B"


def fmt_ms(step: Any) -> str:
    st = _dict(step)
    med, iqr = _num(st.get("median")), _num(st.get("iqr"))
    if not _finite(med):
        return ""
    return f"{med:.1f} ± {iqr:.1f}" if _finite(iqr) else f"{med:.1f}"


def fmt_pct(x: Any, digits: int = 1) -> str:
    v = _num(x)
    if v is None:
        return ""
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}%}"


def fmt_small_pct(x: Any) -> str:
    """Relative differences: 2 significant digits, so 2e-5 shows as 0.0020%, not 0.00%."""
    v = _num(x)
    if v is None:
        return ""
    if not math.isfinite(v):
        return str(v)
    if v == 0:
        return "0%"
    return f"{v * 100:.2g}%" if abs(v) < 0.01 else f"{v:.2%}"


def fmt_db(x: Any) -> str:
    v = _num(x)
    if v is None:
        return ""
    return f"{v:.1f} dB" if math.isfinite(v) else f"{v} dB"


def fmt_date(x: Any) -> str:
    if not isinstance(x, str) or not x:
        return ""
    try:
        t = dt.datetime.fromisoformat(x.replace("Z", "+00:00"))
    except ValueError:
        return x
    if t.tzinfo is not None and t.utcoffset() == dt.timedelta(0):
        return t.strftime("%Y-%m-%d %H:%M UTC")
    return t.strftime("%Y-%m-%d %H:%M %z").strip()


def fmt_gain(gain: Any) -> str:
    g = _dict(gain)
    if not g:
        return ""
    parts = []
    pct = _num(g.get("gain_pct"))
    if _finite(pct):
        parts.append(f"{pct:+.1f}% step")
    for what in ("step", "layer"):
        before, after = _num(g.get(f"{what}_ms_before")), _num(g.get(f"{what}_ms_after"))
        if _finite(before) and _finite(after):
            parts.append(f"{what} {before:.2f} → {after:.2f} ms")
    return "; ".join(parts)


def _e(x: Any) -> str:
    return html.escape(_text(x), quote=True)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-").lower() or "x"


# ---------------------------------------------------------------------------------------------
# Derived views of the data


def _device_text(data: Mapping[str, Any]) -> str:
    dev = _dict(_dict(data.get("env")).get("device"))
    kind = _text(data.get("device") or dev.get("type") or _dict(data.get("bench")).get("device"))
    name = _text(dev.get("name"))
    cap = dev.get("capability")
    if isinstance(cap, (list, tuple)) and cap:
        name += f", sm {'.'.join(_text(c) for c in cap)}"
    elif cap:
        name += f", capability {_text(cap)}"
    if kind and name:
        return f"{kind} ({name})"
    return kind or name


def _workload(data: Mapping[str, Any]) -> str:
    return _text(
        data.get("workload")
        or _dict(data.get("bench")).get("workload")
        or _dict(data.get("check")).get("workload")
        or "unknown workload"
    )


def _check_for(data: Mapping[str, Any], policy: Any) -> dict[str, Any]:
    for c in _list(_dict(data.get("check")).get("candidates")):
        if _dict(c).get("policy") == policy:
            return _dict(c)
    return {}


def candidates(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tune candidates; for a file without them, rebuilt from the bench rows and check verdicts."""
    cands = [_dict(c) for c in _list(data.get("candidates")) if isinstance(c, dict)]
    if cands:
        return cands
    out = []
    for row in _list(_dict(data.get("bench")).get("rows")):
        row = _dict(row)
        if row.get("baseline_repeat"):
            continue
        chk = _check_for(data, row.get("policy"))
        label = _text(row.get("policy")) + ("+cl" if row.get("channels_last") else "")
        out.append(
            {
                "label": label,
                "policy": row.get("policy"),
                "channels_last": row.get("channels_last"),
                "status": row.get("status"),
                "throughput": row.get("throughput"),
                "speedup_vs_fp32": row.get("speedup_vs_fp32"),
                "step_time_ms": row.get("step_time_ms"),
                "peak_memory_bytes": row.get("peak_memory_bytes"),
                "mfu": row.get("mfu"),
                "verdict": chk.get("verdict"),
                "reason": row.get("reason") or chk.get("reason") or "",
            }
        )
    return out


def _findings(data: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    lint = data.get("lint")
    if not isinstance(lint, dict):
        return None
    return [_dict(f) for f in _list(lint.get("findings")) if isinstance(f, dict)]


def _rec_thresholds(data: Mapping[str, Any], rec: Mapping[str, Any]) -> dict[str, Any]:
    return _dict(_check_for(data, rec.get("policy")).get("thresholds"))


def verdict_line(data: Mapping[str, Any]) -> tuple[str, str]:
    """(tone, one sentence) for the top of the report."""
    rec = _dict(data.get("recommendation"))
    label = rec.get("label") or rec.get("policy")
    if label:
        pieces = []
        sp = fmt_speedup(rec.get("speedup_vs_fp32"))
        if sp:
            pieces.append(f"{sp} the throughput of strict fp32")
        sq = fmt_db(_dict(rec.get("margin")).get("output_sqnr_db"))
        pieces.append("numerics pass" + (f" (output SQNR {sq})" if sq else ""))
        return "good", f"Use {_text(label)}: " + ", ".join(pieces) + "."
    if data.get("candidates") or data.get("bench"):
        return "warn", "No candidate beat strict fp32 while passing the numerics check: keep fp32."
    return "muted", "This file holds no recommendation."


# ---------------------------------------------------------------------------------------------
# Charts


def render_charts(data: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Draw the bench and check charts from the data into ``out_dir``; a chart that cannot be drawn
    (no data, or a malformed block) is left out."""
    out_dir = Path(out_dir)
    charts: dict[str, Path] = {}
    bench = _dict(data.get("bench"))
    if _list(bench.get("rows")):
        try:
            from mixprec.measure.results import BenchResult
            from mixprec.report import bench as bench_report

            result = BenchResult.from_dict({**bench, "env": _dict(data.get("env"))})
            charts["bench"] = bench_report.plot(out_dir / "bench.png", result)
        except Exception:  # a partial file must still give a report
            pass
    check = _dict(data.get("check"))
    if _list(check.get("candidates")):
        try:
            from mixprec.numerics.results import CheckResult
            from mixprec.report import check as check_report

            charts["check"] = check_report.plot(out_dir / "check.png", CheckResult.from_dict(check))
        except Exception:
            pass
    return charts


# ---------------------------------------------------------------------------------------------
# HTML

_CSS = """
:root { --fg:#1f2328; --muted:#656d76; --line:#d0d7de; --zebra:#f6f8fa; --accent:#0969da;
  --good:#1a7f37; --good-bg:#dafbe1; --bad:#cf222e; --bad-bg:#ffebe9; --warn:#9a6700;
  --warn-bg:#fff8c5; --mute-bg:#eaeef2; }
* { box-sizing: border-box; }
html { -webkit-text-size-adjust: 100%; }
body { margin: 0; background: #fff; color: var(--fg); font: 15px/1.55 -apple-system, BlinkMacSystemFont,
  "Segoe UI", "Noto Sans", Helvetica, Arial, sans-serif; }
main { max-width: 1000px; margin: 0 auto; padding: 32px 24px 48px; }
h1 { font-size: 26px; line-height: 1.25; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 36px 0 12px; padding-bottom: 6px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 20px 0 8px; }
p { margin: 8px 0; }
code, pre, .mono { font-family: ui-monospace, SFMono-Regular, "SF Mono", Menlo, Consolas,
  "Liberation Mono", monospace; font-size: 13px; }
code { background: var(--zebra); padding: 1px 5px; border-radius: 4px; }
pre code { background: none; padding: 0; border-radius: 0; font-size: inherit; }
.kicker { color: var(--muted); text-transform: uppercase; letter-spacing: .06em; font-size: 12px;
  font-weight: 600; margin-bottom: 6px; }
.sub { color: var(--muted); margin: 0 0 10px; }
.meta { display: flex; flex-wrap: wrap; gap: 6px 20px; color: var(--muted); font-size: 13.5px;
  margin: 10px 0 0; }
.meta b { color: var(--fg); font-weight: 600; }
.verdict { margin: 18px 0 0; padding: 12px 16px; border-radius: 8px; font-weight: 600; font-size: 16px;
  border: 1px solid; }
.verdict.good { background: var(--good-bg); border-color: #aceebb; color: #116329; }
.verdict.warn { background: var(--warn-bg); border-color: #eed888; color: #7d4e00; }
.verdict.muted, .verdict.bad { background: var(--zebra); border-color: var(--line); color: var(--muted); }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(140px, 1fr)); gap: 10px;
  margin: 12px 0; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
.card .k { color: var(--muted); font-size: 12.5px; }
.card .v { font-size: 21px; font-weight: 600; font-variant-numeric: tabular-nums; line-height: 1.3; }
.card .n { color: var(--muted); font-size: 12.5px; }
.rec-label { font-size: 20px; font-weight: 650; }
.note { color: var(--muted); font-size: 13.5px; }
.tablewrap { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; font-size: 13.5px; margin: 8px 0; }
th, td { padding: 6px 9px; text-align: left; vertical-align: top; }
thead th { border-bottom: 2px solid var(--line); font-weight: 600; font-size: 12.5px; color: var(--muted);
  vertical-align: bottom; line-height: 1.3; }
tbody tr:nth-child(even) { background: var(--zebra); }
tbody td { border-bottom: 1px solid #eaeef2; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.why { color: var(--muted); font-size: 12.5px; min-width: 180px; }
td.cand { white-space: nowrap; }
td.gain { white-space: nowrap; text-align: right; font-variant-numeric: tabular-nums; font-size: 12.5px; }
td.gain b { font-size: 13.5px; }
tr.recommended, tbody tr.recommended:nth-child(even) { background: var(--good-bg); }
tr.recommended td:first-child { box-shadow: inset 4px 0 0 var(--good); font-weight: 650; }
.star { color: var(--good); }
table.kv th, table.kv td { border-bottom: 1px solid #eaeef2; padding: 5px 9px; }
table.kv th { font-weight: 600; color: var(--muted); white-space: nowrap; font-size: 13px; width: 1%; }
table.kv tr:nth-child(even) { background: var(--zebra); }
.envgrid { display: grid; grid-template-columns: 3fr 2fr; gap: 24px; align-items: start; }
.envgrid h3 { margin-top: 0; }
@media (max-width: 760px) { .envgrid { grid-template-columns: 1fr; } }
.badge { display: inline-block; padding: 1px 8px; border-radius: 999px; font-size: 12px; font-weight: 600;
  white-space: nowrap; border: 1px solid transparent; }
.badge.good { background: var(--good-bg); color: var(--good); border-color: #aceebb; }
.badge.bad { background: var(--bad-bg); color: var(--bad); border-color: #ffcecb; }
.badge.warn { background: var(--warn-bg); color: var(--warn); border-color: #eed888; }
.badge.muted { background: var(--mute-bg); color: var(--muted); }
.sev-error { color: var(--bad); } .sev-warning { color: var(--warn); } .sev-info { color: var(--muted); }
figure { margin: 12px 0 20px; }
figure img { display: block; max-width: 100%; height: auto; border: 1px solid var(--line);
  border-radius: 6px; }
figcaption { color: var(--muted); font-size: 13px; margin-top: 6px; }
.export { margin: 14px 0; }
.export-head { display: flex; align-items: center; justify-content: space-between; margin-bottom: 4px; }
.export-head h3 { margin: 0; }
pre { margin: 0; background: var(--zebra); border: 1px solid var(--line); border-radius: 6px;
  padding: 12px 14px; overflow-x: auto; line-height: 1.45; white-space: pre; }
button.copy { font: 12px/1 inherit; padding: 4px 10px; border: 1px solid var(--line); border-radius: 6px;
  background: #fff; color: var(--fg); cursor: pointer; }
button.copy:hover { background: var(--zebra); }
ul.findings { margin: 6px 0; padding-left: 20px; }
footer { margin-top: 40px; padding-top: 12px; border-top: 1px solid var(--line); color: var(--muted);
  font-size: 13px; }
footer code { font-size: 12.5px; }
@media print { button.copy { display: none; } main { max-width: none; } }
"""

_COPY_JS = """
document.querySelectorAll('button.copy').forEach(function (b) {
  b.addEventListener('click', function () {
    var pre = document.getElementById(b.getAttribute('data-target'));
    if (!pre || !navigator.clipboard) return;
    navigator.clipboard.writeText(pre.textContent).then(function () {
      b.textContent = 'copied'; setTimeout(function () { b.textContent = 'copy'; }, 1200);
    });
  });
});
"""


def _badge(value: Any) -> str:
    text = _text(value)
    if not text:
        return '<span class="badge muted">—</span>'
    return f'<span class="badge {_TONE.get(text, "muted")}">{_e(text)}</span>'


def _table(headers: Iterable[tuple[str, bool]], rows: Iterable[tuple[str, list[tuple[str, str]]]]) -> str:
    """headers: (escaped label, numeric); rows: (tr class, [(td class, escaped html)])."""
    head = "".join(f'<th class="num">{h}</th>' if num else f"<th>{h}</th>" for h, num in headers)
    body = []
    for cls, cells in rows:
        tds = "".join(f'<td class="{c}">{v}</td>' if c else f"<td>{v}</td>" for c, v in cells)
        body.append(f'<tr class="{cls}">{tds}</tr>' if cls else f"<tr>{tds}</tr>")
    return (
        f'<div class="tablewrap"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _kv_table(pairs: Iterable[tuple[str, Any]]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in pairs if _text(v) != "")
    return f'<table class="kv"><tbody>{rows}</tbody></table>' if rows else ""


def _html_header(data: Mapping[str, Any]) -> str:
    env = _dict(data.get("env"))
    meta = [
        ("device", _device_text(data)),
        ("date", fmt_date(data.get("created"))),
        ("mixprec", env.get("mixprec_version")),
        ("torch", env.get("torch_version")),
    ]
    budget, elapsed = _num(data.get("budget_s")), _num(data.get("elapsed_s"))
    if _finite(elapsed):
        meta.append(
            ("time", f"{elapsed:.0f} s" + (f" of a {budget:.0f} s budget" if _finite(budget) else ""))
        )
    meta_html = "".join(f"<span>{_e(k)} <b>{_e(v)}</b></span>" for k, v in meta if _text(v))
    tone, line = verdict_line(data)
    desc = data.get("description") or _dict(data.get("bench")).get("description")
    return (
        '<header><div class="kicker">mixprec tune report</div>'
        f"<h1>{_e(_workload(data))}</h1>"
        + (f'<p class="sub">{_e(desc)}</p>' if desc else "")
        + f'<div class="meta">{meta_html}</div>'
        f'<div class="verdict {tone}">{_e(line)}</div></header>'
    )


def _margin_pairs(data: Mapping[str, Any], rec: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(name, value, limit note) for the numerics margin of the recommendation."""
    margin = _dict(rec.get("margin"))
    limits = _rec_thresholds(data, rec)
    out = []
    for key, name, fmt, lim_key, rel in (
        ("output_sqnr_db", "output SQNR", fmt_db, "min_output_sqnr_db", "≥"),
        ("grad_sqnr_db", "gradient SQNR", fmt_db, "min_grad_sqnr_db", "≥"),
        ("max_rel_loss_diff", "max loss diff", fmt_small_pct, "max_rel_loss_diff", "≤"),
    ):
        value = fmt(margin.get(key))
        if value:
            # the limit actually applied (written by tune), else the policy's absolute threshold
            applied = margin.get(f"{key}_limit")
            lim = fmt(applied if applied is not None else limits.get(lim_key))
            out.append((name, value, f"limit {rel} {lim}" if lim else ""))
    return out


def _findings_list_html(findings: list[dict[str, Any]]) -> str:
    items = []
    for f in findings:
        gain = fmt_gain(f.get("gain"))
        items.append(
            f"<li><code>{_e(f.get('rule'))}</code> <b>{_e(f.get('module'))}</b>: {_e(f.get('message'))}"
            + (f" <i>Fix:</i> {_e(f.get('fix'))}" if f.get("fix") else "")
            + (f' <span class="note">(measured: {_e(gain)})</span>' if gain else "")
            + "</li>"
        )
    return f'<ul class="findings">{"".join(items)}</ul>'


def _html_recommendation(data: Mapping[str, Any]) -> str:
    rec = _dict(data.get("recommendation"))
    out = ['<section id="recommendation"><h2>Recommendation</h2>']
    if not rec:
        out.append('<p class="note">No recommendation in this file.</p></section>')
        return "".join(out)
    label = rec.get("label") or rec.get("policy")
    detail = []
    if rec.get("policy") and rec.get("policy") != label:
        detail.append(f"policy {_text(rec.get('policy'))}")
    if rec.get("channels_last") is not None:
        detail.append("channels_last" if rec.get("channels_last") else "default memory layout")
    out.append(
        f'<p><span class="rec-label">{_e(label)}</span>'
        + (f' <span class="note">({_e(", ".join(detail))})</span>' if detail else "")
        + "</p>"
    )
    cards = []
    sp = fmt_speedup(rec.get("speedup_vs_fp32"))
    if sp:
        cards.append(("speedup vs fp32", sp, "throughput, strict fp32 = 1x"))
    sp32 = fmt_speedup(rec.get("speedup_vs_tf32"))
    if sp32:
        cards.append(("speedup vs tf32", sp32, "throughput ratio"))
    saved = _num(rec.get("memory_saved_bytes"))
    if saved is not None:
        cards.append(("memory saved", fmt_bytes(saved), "peak, vs strict fp32"))
    for name, value, note in _margin_pairs(data, rec):
        cards.append((name, value, note))
    if cards:
        out.append(
            '<div class="cards">'
            + "".join(
                f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div>'
                + (f'<div class="n">{_e(n)}</div>' if n else "")
                + "</div>"
                for k, v, n in cards
            )
            + "</div>"
        )
    keep = [_text(k) for k in _list(rec.get("keep_fp32"))]
    out.append(
        "<p><b>keep_fp32:</b> "
        + (", ".join(f"<code>{_e(k)}</code>" for k in keep) if keep else '<span class="note">none</span>')
        + "</p>"
    )
    if rec.get("reason"):
        out.append(f"<p>{_e(rec.get('reason'))}</p>")
    if rec.get("tie_break"):
        out.append(f'<p class="note"><b>Tie-break:</b> {_e(rec.get("tie_break"))}</p>')
    worth = [_dict(f) for f in _list(rec.get("lint_worth_fixing")) if isinstance(f, dict)]
    if worth:
        out.append("<h3>Lint findings worth fixing</h3>" + _findings_list_html(worth))
    out.append("</section>")
    return "".join(out)


def _cand_row(c: Mapping[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    status = _text(c.get("status"))
    label = _e(c.get("label") or c.get("policy") or "?")
    keep = [_text(k) for k in _list(c.get("keep_fp32"))]
    if keep:
        label += f'<br><span class="note">keep_fp32: {_e(", ".join(keep))}</span>'
    if status == "recommended":
        label = '<span class="star" title="recommended">★</span> ' + label
    mfu = _num(c.get("mfu"))
    cells = [
        ("cand", label),
        ("", _badge(status)),
        ("num", _e(fmt_throughput(c.get("throughput")))),
        ("num", _e(fmt_speedup(c.get("speedup_vs_fp32")))),
        ("num", _e(fmt_ms(c.get("step_time_ms")))),
        ("num", _e(fmt_bytes(c.get("peak_memory_bytes")))),
        ("num", _e(fmt_pct(mfu) if _finite(mfu) and mfu else "")),
        ("", _badge(c.get("verdict"))),
        ("why", _e(c.get("reason"))),
    ]
    return ("recommended" if status == "recommended" else "", cells)


_CAND_HEADERS = (
    ("candidate", False),
    ("status", False),
    ("samples/s", True),
    ("speedup\nvs fp32", True),
    ("step ms\nmedian ± IQR", True),
    ("peak\nmemory", True),
    ("MFU", True),
    ("numerics", False),
    ("why", False),
)


def _bench_notes(data: Mapping[str, Any]) -> list[str]:
    bench = _dict(data.get("bench"))
    notes = [_text(n) for n in _list(bench.get("notes"))]
    drift = _num(bench.get("baseline_drift"))
    if _finite(drift):
        notes.append(f"strict fp32 re-measured at the end of the sweep: {drift:+.1%} drift")
    settings = _dict(bench.get("settings"))
    bits = []
    if bench.get("batch_size"):
        bits.append(f"batch {_text(bench.get('batch_size'))}")
    for key in ("steps", "warmup", "threads"):
        if settings.get(key) is not None:
            bits.append(f"{key} {_text(settings.get(key))}")
    if bits:
        notes.insert(0, "measured with " + ", ".join(bits))
    return notes


def _html_candidates(data: Mapping[str, Any]) -> str:
    cands = candidates(data)
    out = ['<section id="candidates"><h2>Candidates</h2>']
    if not cands:
        out.append('<p class="note">No candidates in this file.</p></section>')
        return "".join(out)
    headers = [(_e(h).replace("\n", "<br>"), num) for h, num in _CAND_HEADERS]
    out.append(_table(headers, [_cand_row(c) for c in cands]))
    notes = _bench_notes(data)
    if notes:
        out.append("".join(f'<p class="note">{_e(n)}.</p>' for n in notes))
    out.append("</section>")
    return "".join(out)


def _data_uri(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    return "data:image/png;base64," + base64.b64encode(raw).decode("ascii")


def _html_charts(charts: Mapping[str, Path]) -> str:
    out = ['<section id="charts"><h2>Charts</h2>']
    shown = 0
    for name, path in charts.items():
        uri = _data_uri(Path(path))
        if uri is None:
            continue
        title = CHART_TITLES.get(name, name)
        out.append(
            f'<figure><img src="{uri}" alt="{_e(title)}"><figcaption>{_e(title)}</figcaption></figure>'
        )
        shown += 1
    if not shown:
        out.append('<p class="note">No charts: the file holds no bench or check data to draw.</p>')
    out.append("</section>")
    return "".join(out)


def _gain_html(gain: Any) -> str:
    """The measured gain, one figure a line: the step-time change first, in bold."""
    parts = fmt_gain(gain).split("; ") if fmt_gain(gain) else []
    if parts and parts[0].endswith("% step"):
        parts[0] = f"<b>{_e(parts[0])}</b>"
        return "<br>".join([parts[0], *(_e(p) for p in parts[1:])])
    return "<br>".join(_e(p) for p in parts)


def _html_lint(data: Mapping[str, Any]) -> str:
    findings = _findings(data)
    out = ['<section id="lint-findings"><h2>Lint findings</h2>']
    if findings is None:
        out.append('<p class="note">Lint was not run.</p>')
    elif not findings:
        out.append('<p class="note">No findings.</p>')
    else:
        headers = [(h, False) for h in ("rule", "severity", "module", "message", "fix")] + [
            ("measured gain", True)
        ]
        rows = []
        for f in findings:
            sev = _text(f.get("severity"))
            rows.append(
                (
                    "",
                    [
                        ("mono", _e(f.get("rule"))),
                        (f"sev-{_slug(sev)}", _e(sev)),
                        ("mono", _e(f.get("module"))),
                        ("", _e(f.get("message"))),
                        ("", _e(f.get("fix"))),
                        ("gain", _gain_html(f.get("gain"))),
                    ],
                )
            )
        out.append(_table(headers, rows))
    out.append("</section>")
    return "".join(out)


def _export_items(data: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    exports = _dict(data.get("exports"))
    keys = [k for k in EXPORT_TARGETS if k in exports] + [k for k in exports if k not in EXPORT_TARGETS]
    return [(k, EXPORT_TARGETS.get(k, k), _text(exports[k])) for k in keys if _text(exports[k]).strip()]


def _html_exports(data: Mapping[str, Any]) -> str:
    items = _export_items(data)
    out = ['<section id="exports"><h2>Exports</h2>']
    if not items:
        out.append('<p class="note">No exports in this file.</p>')
    else:
        out.append('<p class="note">The recommended policy, written for each training stack.</p>')
    for key, title, text in items:
        pid = f"export-{_slug(key)}"
        out.append(
            f'<div class="export"><div class="export-head"><h3>{_e(title)}</h3>'
            f'<button class="copy" type="button" data-target="{pid}">copy</button></div>'
            f'<pre id="{pid}"><code>{_e(text.rstrip())}</code></pre></div>'
        )
    out.append("</section>")
    return "".join(out)


def _env_pairs(data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    env = _dict(data.get("env"))
    dev = _dict(env.get("device"))
    system = _dict(env.get("system"))
    pairs: list[tuple[str, Any]] = [
        ("mixprec", env.get("mixprec_version")),
        ("torch", env.get("torch_version")),
        ("CUDA (torch build)", env.get("torch_cuda_version")),
        ("cuDNN", env.get("cudnn_version")),
        ("python", env.get("python_version")),
        ("platform", env.get("platform") or system.get("os")),
        ("device", _device_text(data)),
        ("native bf16", dev.get("native_bf16")),
        ("native fp16", dev.get("native_fp16")),
        ("TF32", dev.get("tf32")),
        ("fp8", dev.get("fp8")),
        ("CPU flags", dev.get("cpu_flags")),
        ("GPU memory", fmt_bytes(dev.get("total_memory_bytes") or dev.get("total_memory"))),
        ("threads", env.get("threads")),
        ("GPU driver", system.get("nvidia_driver_version")),
    ]
    return pairs


def _html_environment(data: Mapping[str, Any]) -> str:
    out = ['<section id="environment"><h2>Environment</h2>']
    kv = _kv_table(_env_pairs(data))
    state = _dict(_dict(data.get("env")).get("precision_state"))
    if not kv and not state:
        out.append('<p class="note">No environment block in this file.</p></section>')
        return "".join(out)
    out.append('<div class="envgrid">')
    out.append(f"<div><h3>Key facts</h3>{kv}</div>" if kv else "<div></div>")
    if state:
        out.append(
            "<div><h3>Precision state</h3>"
            + _kv_table((k, "unset" if v is None else v) for k, v in state.items())
            + '<p class="note">Effective fp32 precision per library when the run started.</p></div>'
        )
    out.append("</div></section>")
    return "".join(out)


def _html_footer(data: Mapping[str, Any]) -> str:
    parts = []
    if data.get("command"):
        parts.append(f"command: <code>{_e(data.get('command'))}</code>")
    meta = []
    if data.get("schema_version") is not None:
        meta.append(f"schema version {_e(data.get('schema_version'))}")
    if data.get("kind"):
        meta.append(f"kind {_e(data.get('kind'))}")
    env = _dict(data.get("env"))
    meta.append(
        "generated by mixprec" + (f" {_e(env.get('mixprec_version'))}" if env.get("mixprec_version") else "")
    )
    parts.append(" · ".join(meta))
    return "<footer>" + "<br>".join(parts) + "</footer>"


def render_html(data: Mapping[str, Any], *, charts: Mapping[str, str | Path] | None = None) -> str:
    """The whole report as one self-contained HTML page; ``charts`` (name -> PNG) are embedded."""
    data = _dict(dict(data) if isinstance(data, Mapping) else data)
    chart_paths = {str(k): Path(v) for k, v in (charts or {}).items()}
    title = f"mixprec tune: {_workload(data)}"
    body = "".join(
        (
            _html_header(data),
            _html_recommendation(data),
            _html_candidates(data),
            _html_charts(chart_paths),
            _html_lint(data),
            _html_exports(data),
            _html_environment(data),
            _html_footer(data),
        )
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
        f"<body><main>{body}</main><script>{_COPY_JS}</script></body></html>\n"
    )


# ---------------------------------------------------------------------------------------------
# Markdown


def _md(x: Any) -> str:
    """Text for a Markdown line or table cell: no raw HTML, no cell breaks, no line breaks."""
    text = html.escape(_text(x), quote=False).replace("|", "\\|")
    return " ".join(text.split())


def _md_table(headers: list[tuple[str, bool]], rows: list[list[str]]) -> list[str]:
    lines = [
        "| " + " | ".join(h for h, _ in headers) + " |",
        "|" + "|".join("---:" if num else "---" for _, num in headers) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _fence(text: str, lang: str = "") -> list[str]:
    ticks = "```"
    while ticks in text:
        ticks += "`"
    return [ticks + lang, text.rstrip("\n"), ticks]


def render_markdown(data: Mapping[str, Any], *, charts: Mapping[str, str] | None = None) -> str:
    """The report as Markdown; ``charts`` maps a chart name to the image path to reference
    (relative to the Markdown file)."""
    data = _dict(dict(data) if isinstance(data, Mapping) else data)
    env = _dict(data.get("env"))
    lines = [f"# mixprec tune report: {_md(_workload(data))}", ""]
    desc = data.get("description") or _dict(data.get("bench")).get("description")
    if desc:
        lines += [_md(desc), ""]
    meta = [
        ("device", _device_text(data)),
        ("date", fmt_date(data.get("created"))),
        ("mixprec", env.get("mixprec_version")),
        ("torch", env.get("torch_version")),
    ]
    meta_text = " · ".join(f"{k} **{_md(v)}**" for k, v in meta if _text(v))
    if meta_text:
        lines += [meta_text, ""]
    _, line = verdict_line(data)
    lines += [f"> **{_md(line)}**", ""]

    # Recommendation
    lines += ["## Recommendation", ""]
    rec = _dict(data.get("recommendation"))
    if not rec:
        lines += ["No recommendation in this file.", ""]
    else:
        lines += [f"**{_md(rec.get('label') or rec.get('policy'))}**", ""]
        items = []
        if rec.get("policy"):
            items.append(
                f"policy `{_text(rec.get('policy'))}`, channels_last {_md(rec.get('channels_last'))}"
            )
        if fmt_speedup(rec.get("speedup_vs_fp32")):
            items.append(f"speedup vs strict fp32: **{fmt_speedup(rec.get('speedup_vs_fp32'))}**")
        if fmt_speedup(rec.get("speedup_vs_tf32")):
            items.append(f"speedup vs tf32: **{fmt_speedup(rec.get('speedup_vs_tf32'))}**")
        if _num(rec.get("memory_saved_bytes")) is not None:
            items.append(f"memory saved (peak, vs strict fp32): {fmt_bytes(rec.get('memory_saved_bytes'))}")
        margin = _margin_pairs(data, rec)
        if margin:
            items.append(
                "numerics margin: "
                + ", ".join(f"{n} {v}" + (f" ({lim})" if lim else "") for n, v, lim in margin)
            )
        keep = [_text(k) for k in _list(rec.get("keep_fp32"))]
        items.append("keep_fp32: " + (", ".join(f"`{k}`" for k in keep) if keep else "none"))
        lines += [f"- {i}" for i in items] + [""]
        if rec.get("reason"):
            lines += [_md(rec.get("reason")), ""]
        if rec.get("tie_break"):
            lines += [f"Tie-break: {_md(rec.get('tie_break'))}", ""]
        worth = [_dict(f) for f in _list(rec.get("lint_worth_fixing")) if isinstance(f, dict)]
        if worth:
            lines += ["Lint findings worth fixing:", ""]
            for f in worth:
                gain = fmt_gain(f.get("gain"))
                lines.append(
                    f"- `{_md(f.get('rule'))}` **{_md(f.get('module'))}**: {_md(f.get('message'))}"
                    + (f" Fix: {_md(f.get('fix'))}" if f.get("fix") else "")
                    + (f" (measured: {_md(gain)})" if gain else "")
                )
            lines.append("")

    # Candidates
    lines += ["## Candidates", ""]
    cands = candidates(data)
    if not cands:
        lines += ["No candidates in this file.", ""]
    else:
        rows = []
        for c in cands:
            status = _text(c.get("status"))
            label = _md(c.get("label") or c.get("policy") or "?")
            if status == "recommended":
                label = f"**{label}** ★"
            keep = [_text(k) for k in _list(c.get("keep_fp32"))]
            if keep:
                label += f" (keep_fp32: {_md(', '.join(keep))})"
            mfu = _num(c.get("mfu"))
            rows.append(
                [
                    label,
                    _md(status),
                    fmt_throughput(c.get("throughput")),
                    fmt_speedup(c.get("speedup_vs_fp32")),
                    fmt_ms(c.get("step_time_ms")),
                    fmt_bytes(c.get("peak_memory_bytes")),
                    fmt_pct(mfu) if _finite(mfu) and mfu else "",
                    _md(c.get("verdict")),
                    _md(c.get("reason")),
                ]
            )
        lines += [*_md_table([(h.replace("\n", " "), num) for h, num in _CAND_HEADERS], rows), ""]
        lines += [f"- {_md(n)}." for n in _bench_notes(data)]
        lines.append("")

    # Charts
    lines += ["## Charts", ""]
    if charts:
        for name, ref in charts.items():
            title = CHART_TITLES.get(name, name)
            lines += [f"![{_md(title)}]({ref})", ""]
    else:
        lines += ["No charts.", ""]

    # Lint
    lines += ["## Lint findings", ""]
    findings = _findings(data)
    if findings is None:
        lines += ["Lint was not run.", ""]
    elif not findings:
        lines += ["No findings.", ""]
    else:
        headers = [(h, False) for h in ("rule", "severity", "module", "message", "fix")] + [
            ("measured gain", True)
        ]
        rows = [
            [
                _md(f.get("rule")),
                _md(f.get("severity")),
                _md(f.get("module")),
                _md(f.get("message")),
                _md(f.get("fix")),
                _md(fmt_gain(f.get("gain"))),
            ]
            for f in findings
        ]
        lines += [*_md_table(headers, rows), ""]

    # Exports
    lines += ["## Exports", ""]
    items = _export_items(data)
    if not items:
        lines += ["No exports in this file.", ""]
    for key, title, text in items:
        lang = {"deepspeed": "json", "accelerate": "", "mixprec": "python"}.get(key, "python")
        lines += [f"### {_md(title)}", "", *_fence(text, lang), ""]

    # Environment
    lines += ["## Environment", ""]
    pairs = [(k, v) for k, v in _env_pairs(data) if _text(v) != ""]
    if pairs:
        lines += [*_md_table([("fact", False), ("value", False)], [[_md(k), _md(v)] for k, v in pairs]), ""]
    else:
        lines += ["No environment block in this file.", ""]
    state = _dict(env.get("precision_state"))
    if state:
        lines += ["Precision state (effective fp32 precision per library):", ""]
        lines += [
            *_md_table(
                [("setting", False), ("value", False)],
                [[_md(k), _md("unset" if v is None else v)] for k, v in state.items()],
            ),
            "",
        ]

    # Footer
    lines += ["---", ""]
    if data.get("command"):
        lines += [f"command: `{_text(data.get('command')).replace('`', '')}`", ""]
    foot = []
    if data.get("schema_version") is not None:
        foot.append(f"schema version {_md(data.get('schema_version'))}")
    if data.get("kind"):
        foot.append(f"kind {_md(data.get('kind'))}")
    foot.append(
        "generated by mixprec" + (f" {_md(env.get('mixprec_version'))}" if env.get("mixprec_version") else "")
    )
    lines += [" · ".join(foot), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Files


def write_report(
    data: Mapping[str, Any], out_dir: str | Path, *, charts: Mapping[str, str | Path] | None = None
) -> dict[str, Path]:
    """Write ``out_dir/index.html`` and ``out_dir/report.md`` and return their paths.

    ``charts`` maps a chart name (``"bench"``, ``"check"``) to an existing PNG; it is copied into
    ``out_dir`` as ``<name>.png`` (referenced by the Markdown) and embedded in the HTML. Without
    it the charts are drawn from the data. The result maps ``"html"`` and ``"markdown"`` to the
    two reports and each chart name to its PNG in ``out_dir``.
    """
    data = _dict(dict(data) if isinstance(data, Mapping) else data)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if charts is None:
        placed = render_charts(data, out)
    else:
        placed = {}
        for name, src in charts.items():
            src = Path(src)
            if not src.is_file():
                continue
            dest = out / f"{_slug(str(name))}.png"
            if not (dest.exists() and dest.resolve() == src.resolve()):
                shutil.copyfile(src, dest)
            placed[str(name)] = dest
    html_path = out / "index.html"
    md_path = out / "report.md"
    html_path.write_text(render_html(data, charts=placed), encoding="utf-8")
    md_path.write_text(
        render_markdown(data, charts={name: p.name for name, p in placed.items()}), encoding="utf-8"
    )
    return {"html": html_path, "markdown": md_path, **placed}
