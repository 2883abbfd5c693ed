"""The daemon's status page for people (``GET /``): its routes and its HTML (what it shows and
where that is read from: ``ckptd.server.page_data``).

``GET /`` and its two static files are a shell with no data, served without a token so that a
browser can ask for one; every data route (``/v1/overview`` JSON, ``/v1/page`` the same as an
HTML fragment, ``/v1/page/verify``) needs the daemon's bearer token. The page keeps the token in
``sessionStorage`` and sends it as ``Authorization: Bearer``, never in a URL.

Everything shown is escaped here, on the server (``html.escape``): job roots, keys and errors
come from clients and storage. The shell's Content-Security-Policy allows no inline script, so a
string that escaped escaping still could not run. ``POST /v1/page/verify`` needs the
``X-Ckptd-Page`` header, which a cross-site form cannot send (and ``Guard`` refuses a foreign
``Origin``), so even without a token another web page cannot make a browser start verifies.
"""

from __future__ import annotations

import html
import logging
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from ckptd.server import page_data
from ckptd.server.page_data import one_line as _line
from ckptd.server.parts import MAX_NUMBER, MAX_STEP
from ckptd.units import human_bytes as _bytes

__all__ = ["CSP", "PAGE_HEADER", "PUBLIC_PATHS", "render", "router"]

log = logging.getLogger("ckptd.server")

router = APIRouter()

# The header the page's script sends with every request; required for verify (a form cannot send it).
PAGE_HEADER = "X-Ckptd-Page"

# Served without a token: they carry no data (the Guard lets these paths through).
PUBLIC_PATHS = frozenset({"/", "/static/status.js", "/static/status.css"})
_STATIC = {"status.js": "text/javascript; charset=utf-8", "status.css": "text/css; charset=utf-8"}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}

REFRESH_S = 2.0
DEFAULT_ROWS = 25
FAILURE_CHARS = 1200  # a failure's reason shown (its middle cut past this; the fix at its end kept)


def _static(name: str) -> str:
    return resources.files("ckptd.server").joinpath("static", name).read_text(encoding="utf-8")


# ------------------------------------------------------------------------------ rendering


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _time(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def _count(active: list[dict], state: str) -> int:
    return sum(1 for j in active if j["state"] == state)


def _bar(frac: float) -> str:
    w = max(0.0, min(1.0, frac)) * 160
    return (
        f'<svg class="progress" width="160" height="10" role="img" aria-label="{frac:.0%}">'
        f'<rect width="160" height="10" fill="#e4e7ef"/><rect width="{w:.1f}" height="10" fill="#3d6fd1"/></svg>'
    )


def render(data: dict) -> str:
    """The page body as an HTML fragment; every string from outside goes through ``_e``."""
    out = []
    st = data["staging"]
    used = st["staged_bytes"] / st["budget"] if st["budget"] else 0.0
    out.append('<section id="staging"><h2>Staging</h2><p>')
    out.append(
        f'{_bar(used)} <span id="staging-used">{_e(_bytes(st["staged_bytes"]))} of {_e(_bytes(st["budget"]))}</span>'
        f" ({used:.0%}), {st['leases']} leases, {_count(data['active'], 'queued')} queued, "
        f"{_count(data['active'], 'uploading')} uploading, "
        f"{_count(data['active'], 'uploaded')} waiting for other ranks</p></section>"
    )

    out.append('<section id="inflight"><h2>In flight</h2>')
    for s in data.get("stalled", []):
        missing = s.get("missing_ranks")
        who = (
            f"no done record from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            if missing
            else ("every rank reported; the commit is late" if missing is not None else _line(s.get("error")))
        )
        out.append(
            f'<p class="bad stalled" data-step="{_e(s["step"])}">stalled: {_e(s["root"])} step {_e(s["step"])}: '
            f"waiting {_e(_secs(s['waiting_s']))} for the other ranks; {_e(who)} "
            "(a dead node or rank: see docs/operations.md, node loss)</p>"
        )
    if not data["active"]:
        out.append('<p class="muted">no save in flight</p>')
    else:
        out.append(
            "<table><tr><th>job root</th><th>step</th><th>rank</th><th>state</th><th>progress</th>"
            "<th>uploaded</th><th>rate</th><th>ETA</th><th>retries</th></tr>"
        )
        for j in data["active"]:
            total = j["bytes_total"]
            frac = j["bytes_done"] / total if total else 1.0
            uploaded = j["state"] == "uploaded"
            state = f"waiting for other ranks for {_secs(j.get('waiting_s'))}" if uploaded else j["state"]
            rate = "-" if j["rate"] is None else _bytes(j["rate"]) + "/s"
            out.append(
                f'<tr class="job" data-step="{_e(j["step"])}"><td class="err">{_e(j["root"])}</td>'
                f'<td class="num">{_e(j["step"])}</td><td class="num">{_e(j["rank"])}/{_e(j["world_size"])}</td>'
                f'<td class="jobstate">{_e(state)}</td><td>{_bar(frac)} {frac:.0%}</td>'
                f'<td class="uploaded">{_e(_bytes(j["bytes_done"]))} of {_e(_bytes(total))}</td>'
                f'<td>{_e(rate)}</td><td>{_e(_secs(j["eta_s"]))}</td><td class="num">{_e(j["retries"])}</td></tr>'
            )
        out.append("</table>")
    out.append("</section>")

    out.append('<section id="chart"><h2>Last saves</h2>')
    out.append(_chart(data["saves"]) if data["saves"] else '<p class="muted">no save committed by this daemon yet</p>')
    out.append("</section>")

    out.append('<section id="failures"><h2>Recent failures</h2>')
    t = data.get("tiers") or {}  # peers that did not answer this daemon (their replicas are lost), failed pushes
    bad = [(f"peer {p} does not answer; its replicas are lost", d) for p, d in sorted(t.get("unreachable", {}).items())]
    if last := t.get("last_push_failure"):
        bad.append((f"{t['push_failures']} replica pushes failed; the last", last))
    for what, d in bad:
        out.append(f'<p class="bad peer-failure">{_e(what)}, at {_e(_time(d["time"]))}: {_e(_line(d["error"]))}</p>')
    if data["failures"]:
        out.append(_ended(data["failures"], "failed at", "reason", "failure", "bad"))
    elif not bad:
        out.append('<p class="muted">none</p>')
    out.append("</section>")
    if data.get("superseded"):
        out.append(
            '<section id="superseded"><h2>Superseded attempts</h2><p class="muted">another attempt of the '
            "step took over (a restarted job, a step saved again): nothing to do</p>"
        )
        out.append(_ended(data["superseded"], "superseded at", "why", "superseded", "muted") + "</section>")

    if t:
        out.append(_tiers_html(t))
    if "memory_only" in data:
        out.append(_memsteps_html(data["memory_only"]))
    out.append('<section id="roots"><h2>Checkpoints</h2>')
    if data.get("more_roots"):
        out.append(
            f'<p class="muted" id="more-roots">{_e(data["more_roots"])} more job roots not shown '
            "(GET /v1/job-roots lists them, paged)</p>"
        )
    for r in data["roots"]:
        try:
            out.append(_root_html(r))
        except Exception as e:  # noqa: BLE001 - one root's data never blanks the page for all
            log.warning("status page: job root %s: %r", r.get("root"), e)
            out.append(_root_html({"root": r.get("root"), "error": f"cannot show this root: {type(e).__name__}"}))
    out.append("</section>")
    return "".join(out)


def _ended(jobs: list[dict], when: str, why: str, row: str, tone: str) -> str:
    """The table of jobs that ended without a commit (failed, or superseded by another attempt)."""
    rows = "".join(
        f'<tr class="{row}"><td>{_e(_time(j.get("finished_at") or j["accepted_at"]))}</td>'
        f'<td class="err">{_e(j["root"])}</td><td class="num">{_e(j["step"])}</td><td class="num">{_e(j["rank"])}</td>'
        f'<td class="err {tone}">{_e(_line(j["error"], FAILURE_CHARS))}</td></tr>'
        for j in jobs
    )
    return f"<table><tr><th>{when}</th><th>job root</th><th>step</th><th>rank</th><th>{why}</th></tr>{rows}</table>"


def _pushed(copy: dict) -> str:
    return ", ".join(f"{p}: {s}" for p, s in sorted(copy.get("replicated_to", {}).items()))


def _tiers_html(t: dict) -> str:
    """This daemon's hot copies (with the peers they went to) and the replicas it holds for peers."""
    out = ['<section id="tiers"><h2>Memory tiers</h2>']
    copies = [("hot", c) for c in t.get("hot", [])] + [("replica", c) for c in t.get("replicas", [])]
    if not copies:
        out.append('<p class="muted">no step held in memory</p></section>')
        return "".join(out)
    out.append(
        "<table><tr><th>kind</th><th>job root</th><th>step</th><th>ranks</th><th>size</th>"
        "<th>from / replicated to</th></tr>"
    )
    for kind, c in copies:
        where = (_pushed(c) or "-") if kind == "hot" else f"from {c.get('source')}"
        out.append(
            f'<tr class="tier tier-{kind}" data-step="{_e(c["step"])}"><td>{kind}</td>'
            f'<td class="err">{_e(c["root"])}</td><td class="num">{_e(c["step"])}</td>'
            f'<td>{_e(", ".join(map(str, c.get("ranks", []))))}</td><td class="num">{_e(_bytes(c["bytes"]))}</td>'
            f"<td>{_e(_line(where))}</td></tr>"
        )
    out.append("</table></section>")
    return "".join(out)


def _memsteps_html(steps: list[dict]) -> str:
    """The memory-only steps this daemon holds (``page_data.memory_only``), a row per part."""
    out = ['<section id="memsteps"><h2>Memory-only steps</h2>']
    if not steps:
        out.append('<p class="muted">no memory-only step held</p></section>')
        return "".join(out)
    out.append(
        "<table><tr><th>job root</th><th>step</th><th>held here</th><th>rank</th><th>part</th>"
        "<th>size</th><th>replicated to</th></tr>"
    )
    for s in steps:
        if s.get("whole_here"):
            whole = f"whole: all {s['world_size']} ranks"
        else:
            whole = f"partial: ranks {', '.join(map(str, s.get('ranks', [])))} held ({s.get('not_whole')})"
        state = "whole" if s.get("whole_here") else "partial"
        parts = s.get("parts", [])
        for i, p in enumerate(parts):
            own = p["source"] == "self"
            part = "own" if own else f"replica from {p['source']}"
            pushed = _pushed(p) if own else ""
            head = (
                f'<td class="err" rowspan="{len(parts)}">{_e(s["root"])}</td>'
                f'<td class="num" rowspan="{len(parts)}">{_e(s["step"])}</td>'
                f'<td rowspan="{len(parts)}">{_e(whole)}<br><span class="muted">{_e(_bytes(s.get("bytes")))}'
                "</span></td>"
                if i == 0
                else ""
            )
            out.append(
                f'<tr class="memstep memstep-{state} part-{"own" if own else "replica"}" data-step="{_e(s["step"])}"'
                f' data-rank="{_e(p["rank"])}">{head}<td class="num">{_e(p["rank"])}</td><td>{_e(_line(part))}</td>'
                f'<td class="num">{_e(_bytes(p["bytes"]))}</td><td>{_e(_line(pushed or "-"))}</td></tr>'
            )
    out.append("</table></section>")
    return "".join(out)


def _root_html(r: dict) -> str:
    """One job root's block: its checkpoints, or the error that hides them."""
    out = [f'<div class="root" data-root="{_e(r["root"])}"><h3>{_e(r["root"])}</h3>']
    if "error" in r:
        out.append(f'<p class="bad err">{_e(_line(r["error"]))}</p></div>')
        return "".join(out)
    good, rs = r["newest_good_step"], r.get("restore") or {}
    out.append(
        f'<p>newest good committed step: <span class="newest">{_e("none" if good is None else good)}</span>'
        f' <span class="muted">({r["count"]} checkpoints)</span></p><p>a restore now takes step <span class='
        f'"restore-step">{_e(rs.get("step") if rs.get("step") is not None else "none")}</span>: <span '
        f'class="restore-why">{_e(_line(rs.get("why", "-")))}</span></p>'
    )
    if r["checkpoints"]:
        out.append(
            "<table><tr><th>step</th><th>state</th><th>world size</th><th>size</th><th>time (UTC)</th><th></th></tr>"
        )
        for c in r["checkpoints"]:
            verify = ""
            if c["committed"]:
                verify = (
                    f'<button type="button" class="linkish" data-action="verify" data-root="{_e(r["root"])}"'
                    f' data-step="{_e(c["step"])}">verify</button>'
                )
            title = ""
            if c.get("error"):
                title = f' title="{_e(_line(c["error"]))}"'
            if c.get("verify") and not c["verify"]["ok"]:
                title = f' title="{_e(_line("; ".join(c["verify"]["errors"])))}"'
            out.append(
                f'<tr class="ckpt" data-step="{_e(c["step"])}"><td class="num">{_e(c["step"])}</td>'
                f'<td class="state state-{_e(c["state"])}"{title}>{_e(c["state"])}</td>'
                f'<td class="num">{_e(c["world_size"] if c["world_size"] is not None else "-")}</td>'
                f'<td class="num">{_e(_bytes(c["bytes"]))}</td><td>{_e(_time(c["time"]))}</td>'
                f"<td>{verify}</td></tr>"
            )
        out.append("</table>")
    nav = []
    if r["offset"] > 0:
        nav.append(_page_button(r["root"], max(0, r["offset"] - r["limit"]), "newer"))
    if r["offset"] + r["limit"] < r["count"]:
        nav.append(_page_button(r["root"], r["offset"] + r["limit"], "older"))
    if nav:
        first = r["offset"] + 1
        last = min(r["count"], r["offset"] + r["limit"])
        out.append(f"<p>{' '.join(nav)} <span class='muted'>rows {first}-{last} of {r['count']}</span></p>")
    out.append("</div>")
    return "".join(out)


def _page_button(root: str, offset: int, label: str) -> str:
    return (
        f'<button type="button" class="linkish" data-action="page" data-root="{_e(root)}"'
        f' data-offset="{offset}">{_e(label)}</button>'
    )


def _chart(saves: list[dict]) -> str:
    """Inline SVG: per save, bars of the seconds ``save`` spent staging (blocked) and from
    hand-off to commit (left axis), and a dot for its bytes (right axis)."""
    w, h, left, right, top, bottom = 720, 220, 56, 64, 12, 36
    pw, ph = w - left - right, h - top - bottom
    tmax = max(max(s["commit_s"], s["blocked_s"]) for s in saves) or 1.0
    bmax = max(s.get("bytes", 0) for s in saves) or 1
    slot = pw / len(saves)
    bw = max(2.0, min(14.0, slot / 3))
    parts = [
        f'<svg id="saves-chart" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
        'aria-label="last saves: seconds blocked, seconds to commit, bytes">',
        f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#889"/>',
        f'<text x="4" y="{top + 8}">{_e(_secs(tmax))}</text><text x="4" y="{top + ph}">0 s</text>',
        f'<text x="{left + pw + 6}" y="{top + 8}">{_e(_bytes(bmax))}</text>',
    ]
    last_label, last_x = None, -1e9
    for i, s in enumerate(saves):
        x = left + i * slot + slot / 2
        # a step's label once (saves of one step, attempts or roots, sit side by side), and none
        # closer than 28 px to the previous one; the tooltip names every bar
        label = ""
        if s["step"] != last_label and x - last_x >= 28:
            label = f'<text x="{x:.1f}" y="{top + ph + 14}" text-anchor="middle">{_e(s["step"])}</text>'
            last_label, last_x = s["step"], x
        hb = ph * s["blocked_s"] / tmax
        hc = ph * s["commit_s"] / tmax
        yb = top + ph * (1 - s.get("bytes", 0) / bmax)
        tip = (
            f"step {s['step']} ({s['root']}): blocked {_secs(s['blocked_s'])}, "
            f"commit {_secs(s['commit_s'])}, {_bytes(s.get('bytes', 0))}"
        )
        parts.append(
            f'<g class="save"><title>{_e(tip)}</title>'
            f'<rect x="{x - bw:.1f}" y="{top + ph - hb:.1f}" width="{bw:.1f}" height="{hb:.1f}" fill="#e09b3d"/>'
            f'<rect x="{x:.1f}" y="{top + ph - hc:.1f}" width="{bw:.1f}" height="{hc:.1f}" fill="#3d6fd1"/>'
            f'<circle cx="{x:.1f}" cy="{yb:.1f}" r="3" fill="#0a7d2c"/>{label}</g>'
        )
    ly = h - 6
    parts.append(
        f'<rect x="{left}" y="{ly - 9}" width="10" height="10" fill="#e09b3d"/>'
        f'<text x="{left + 14}" y="{ly}">save blocked (staging)</text>'
        f'<rect x="{left + 170}" y="{ly - 9}" width="10" height="10" fill="#3d6fd1"/>'
        f'<text x="{left + 184}" y="{ly}">hand-off to commit</text>'
        f'<circle cx="{left + 335}" cy="{ly - 4}" r="4" fill="#0a7d2c"/>'
        f'<text x="{left + 344}" y="{ly}">bytes (right axis)</text></svg>'
    )
    return "".join(parts)


# --------------------------------------------------------------------------------- routes


@router.get("/", summary="the status page (a shell without data: served without a token)")
def index() -> HTMLResponse:
    return HTMLResponse(_static("status.html"), headers=_HEADERS)


@router.get("/static/{name}", summary="the status page's script and style")
def static(name: str) -> Response:
    if name not in _STATIC:
        return JSONResponse({"detail": f"no static file {name!r}"}, status_code=404)
    return Response(_static(name), media_type=_STATIC[name], headers=_HEADERS)


@router.get("/v1/overview", summary="what the status page shows, as JSON")
def overview(
    request: Request,
    root: str | None = Query(None, max_length=4096, description="the job root that offset pages"),
    offset: int = Query(0, ge=0, le=MAX_NUMBER),
    limit: int = Query(DEFAULT_ROWS, ge=1, le=500, description="checkpoint rows per job root"),
):
    who = request.app.state.daemon.tenancy.caller(request.scope)
    return page_data.collect(request.app.state, root, offset, limit, who)  # RootError: 400 (``app.ERRORS``)


@router.get("/v1/page", summary="the status page's body, rendered (escaped) HTML")
def page(
    request: Request,
    root: str | None = Query(None, max_length=4096),
    offset: int = Query(0, ge=0, le=MAX_NUMBER),
    limit: int = Query(DEFAULT_ROWS, ge=1, le=500),
):
    data = page_data.collect(
        request.app.state, root, offset, limit, request.app.state.daemon.tenancy.caller(request.scope)
    )
    return JSONResponse({"html": render(data), "refresh_s": REFRESH_S}, headers={"Cache-Control": "no-store"})


@router.post("/v1/page/verify", summary="re-read every chunk of a committed step; the page shows the verdict")
def verify(request: Request, root: str = Query(max_length=4096), step: int = Query(ge=0, le=MAX_STEP)):
    if request.headers.get(PAGE_HEADER) != "1":
        return JSONResponse({"detail": f"verify needs the {PAGE_HEADER}: 1 header (the status page sends it)"}, 403)
    # The app's one error table (``app.ERRORS``) answers what this raises: a root not served
    # 400, another user's root 403, no such step 404, unreadable data or storage 502.
    d = request.app.state.daemon
    return page_data.overview(request.app.state).verify(d.readable(d.tenancy.caller(request.scope), root), step)
