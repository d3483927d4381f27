"""Opening an untrusted trace in `recursa view` is safe: model text and crafted event fields can
neither run script nor blank the page, in the standalone HTML (`--html`) and the live server
(`--port`) alike. Checked in a real headless Chromium."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from recursa.trace.viewer import ViewerServer, build_view, render_html
from tests.cli_launcher import CliLauncher

# Every payload bumps window.__pwned when it runs; the attribute form breaks out of a quoted
# attribute, the comment form opens a "<!--<script>" that swallows a later script element.
HIT = "window.__pwned=(window.__pwned||0)+1"
ATTR = f'x"><img src=x onerror="{HIT}">'
TAG = f"<img src=x onerror={HIT}><script>{HIT}</script>"
COMMENT = "<!--<script>"
NASTY = f"{COMMENT} {ATTR} {TAG} javascript:{HIT}"


def hostile_trace(path: Path) -> Path:
    """A trace whose every text field, and several number fields, carry the payloads."""
    seq = 0
    lines: list[str] = []

    def emit(kind: str, ts: float, **fields) -> None:
        nonlocal seq
        seq += 1
        lines.append(json.dumps({"seq": seq, "ts": ts, "type": kind, **fields}))

    usage = {"input_tokens": TAG, "output_tokens": ATTR, "cached_tokens": TAG, "cost_usd": ATTR}
    emit(
        "run_start",
        1.0,
        format=1,
        run_id=ATTR,
        depth=ATTR,
        question=NASTY,
        model=NASTY,
        sub_model=NASTY,
        context={"type": NASTY, "prefix": NASTY},
        config={"sandbox": NASTY},
    )
    emit("sandbox", 1.0, run_id=ATTR, isolation={"mode": NASTY})
    emit("turn", 1.1, run_id=ATTR, turn=ATTR)
    emit(
        "lm_call",
        1.5,
        run_id=ATTR,
        call_id=ATTR,
        purpose="root",
        model=NASTY,
        latency_s=ATTR,
        new_messages=[{"role": ATTR, "content": NASTY}, NASTY],
        response=NASTY,
        usage=usage,
        attempts="9" + ATTR,
        finish_reason=NASTY,
    )
    emit(
        "lm_call",
        1.6,
        run_id=ATTR,
        call_id=ATTR + ".c2",
        purpose="sub",
        model=NASTY,
        prompt=NASTY,
        prompt_chars=TAG,
        response=NASTY,
        usage=usage,
        error=NASTY,
    )
    emit("tool_call", 1.65, run_id=ATTR, tool=NASTY, caller=ATTR, arguments=NASTY, result=NASTY)
    emit(
        "exec",
        1.7,
        run_id=ATTR,
        turn=1,
        block=1,
        code=NASTY,
        stdout=NASTY,
        stderr=NASTY,
        omitted_chars=TAG,
        notes=NASTY,
        final={"protocol": ATTR, "text": NASTY},
        error=NASTY,
        duration_s=ATTR,
    )
    emit("compact", 1.75, run_id=ATTR, turn=1, compacted_messages=TAG, summary=NASTY)
    emit("warning", 1.8, run_id=ATTR, message=NASTY)
    emit(
        "run_end",
        2.0,
        run_id=ATTR,
        stop_reason=ATTR,
        answer=NASTY,
        answer_protocol=ATTR,
        iterations=TAG,
        usage=usage,
        error=NASTY,
        duration_s=ATTR,
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_embedded_json_has_no_angle_bracket_and_round_trips(tmp_path: Path) -> None:
    view = build_view(hostile_trace(tmp_path / "evil.jsonl"))
    html = render_html(view)
    start = html.index('<script id="trace-data" type="application/json">') + len(
        '<script id="trace-data" type="application/json">'
    )
    data = html[start : html.index("</script>", start)]
    assert "<" not in data and ">" not in data and "&" not in data
    assert json.loads(data) == json.loads(json.dumps(view))


def test_the_view_keeps_statuses_and_numbers_to_their_types(tmp_path: Path) -> None:
    view = build_view(hostile_trace(tmp_path / "evil.jsonl"))
    statuses = {n["s"] for n in view["nodes"]}
    assert statuses <= {"ok", "error", "refused", "cancelled", "running", "unknown"} | {
        "final",
        "max_iterations",
        "budget",
        "timeout",
    }
    for node in view["nodes"]:
        for key in ("i", "p", "a", "b", "r", "u", "ti", "to", "ca", "c"):
            assert isinstance(node[key], (int, float)), (key, node[key])
    assert json.loads(view["details"][0])["stop_reason"] == ATTR  # the text itself is still shown


def test_the_live_server_sends_protective_headers_and_refuses_other_hosts(tmp_path: Path) -> None:
    with ViewerServer(hostile_trace(tmp_path / "evil.jsonl")) as viewer:
        page = httpx.get(viewer.url)
        csp = page.headers["content-security-policy"]
        assert (
            "script-src 'sha256-" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
        )
        assert "frame-ancestors 'none'" in csp and page.headers["x-content-type-options"] == "nosniff"
        data = httpx.get(viewer.url + "trace.json")
        assert data.headers["x-content-type-options"] == "nosniff"
        # A page elsewhere that rebinds its own name to 127.0.0.1 sends its own Host: refused.
        rebound = httpx.get(viewer.url + "trace.json", headers={"Host": "attacker.example:80"})
        assert rebound.status_code == 403 and NASTY not in rebound.text


def test_fields_of_the_wrong_type_neither_crash_the_viewer_nor_break_its_json(
    tmp_path: Path, cli_launcher: CliLauncher
) -> None:
    """NaN, Infinity, 1e999, lists and objects where strings and numbers go, a line nested
    thousands deep: `recursa view` still renders, and the data it embeds or serves is strict JSON
    (a NaN anywhere made the browser's JSON.parse refuse the whole page)."""
    lines = [
        '{"seq":1,"ts":1.0,"type":"run_start","format":{"a":1},"run_id":"r","depth":NaN,'
        '"question":Infinity,"model":["m"]}',
        '{"seq":2,"ts":1e999,"type":"turn","run_id":"r","turn":-Infinity}',
        '{"seq":3,"ts":1.2,"type":"compact","run_id":"r","turn":1,"compacted_messages":NaN}',
        '{"seq":4,"ts":1.3,"type":"tool_call","run_id":"r","tool":"t","duration_s":' + "9" * 400 + "}",
        "[" * 50_000 + "]" * 50_000,
        '{"seq":5,"ts":2.0,"type":"run_end","run_id":"r","stop_reason":["final"],"answer":NaN}',
    ]
    trace = tmp_path / "typed.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    view = build_view(trace)
    json.dumps(view, allow_nan=False)
    for detail in view["details"]:
        json.loads(detail, parse_constant=lambda c: pytest.fail(f"{c} in a node's details"))
    assert view["nodes"][0]["s"] == "unknown"
    out = tmp_path / "typed.html"
    done = cli_launcher.run(["view", str(trace), "--html", str(out)], cwd=Path.cwd(), env=dict(os.environ))
    assert done.returncode == 0 and "error" not in done.stderr, done.stderr
    with ViewerServer(trace) as viewer:
        served = httpx.get(viewer.url + "trace.json")
    assert served.status_code == 200
    json.loads(served.text, parse_constant=lambda c: pytest.fail(f"{c} in the served view"))


# -- in a real browser ------------------------------------------------------------------------


def _visit_everything(browser, url: str, bypass_csp: bool) -> None:
    """Open the page, select every node, unfold everything, search: no payload may run, and the
    page must show the trace (not be blanked). With `bypass_csp` the escaping alone must hold."""
    page = browser.new_page(viewport={"width": 1200, "height": 900}, bypass_csp=bypass_csp)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("dialog", lambda d: d.dismiss())
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", state="attached", timeout=15_000)
    page.click("#expand-all")
    rows = page.locator("#tree-rows .row")
    count = rows.count()
    assert count >= 6  # run, turn, call, sub-call, tool, exec, compact
    for k in range(count):
        rows.nth(k).click()
        for button in page.locator("#detail [data-full], #detail [data-unfold]").all():
            button.click()
    page.hover("#timeline")
    page.fill("#search", "script")
    page.wait_for_selector("#search-count:has-text('found')")
    page.fill("#search", "")
    assert page.evaluate("window.__pwned || 0") == 0
    assert page.locator("#detail img, #tree img, #summary img, #warnings img").count() == 0
    header = page.text_content("#summary")
    assert COMMENT in header and ATTR in header  # shown as text, not swallowed or interpreted
    assert not errors  # not even an attempt the policy had to block
    page.close()


@pytest.mark.parametrize("bypass_csp", [False, True], ids=["with-csp", "escaping-alone"])
def test_standalone_html_from_the_cli_runs_no_trace_script(
    browser, tmp_path: Path, bypass_csp: bool, cli_launcher: CliLauncher
) -> None:
    trace = hostile_trace(tmp_path / "evil.jsonl")
    out = tmp_path / "evil.html"
    done = cli_launcher.run(["view", str(trace), "--html", str(out)], cwd=Path.cwd(), env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    _visit_everything(browser, out.as_uri(), bypass_csp)


@pytest.mark.parametrize("bypass_csp", [False, True], ids=["with-csp", "escaping-alone"])
def test_live_server_page_runs_no_trace_script(browser, tmp_path: Path, bypass_csp: bool) -> None:
    with ViewerServer(hostile_trace(tmp_path / "evil.jsonl")) as viewer:
        _visit_everything(browser, viewer.url, bypass_csp)


def test_the_viewer_on_every_address_still_refuses_rebound_names_and_idle_connections(tmp_path: Path) -> None:
    """Bound to 0.0.0.0 (`--host 0.0.0.0`) the viewer checked no Host at all, so a page whose name
    was rebound to 127.0.0.1 read the trace through loopback; and a connection that sent half a
    request held one of its threads for good. Loopback requests must name the viewer by a loopback
    name whatever it is bound to, and a silent connection is closed."""
    import socket

    with ViewerServer(hostile_trace(tmp_path / "evil.jsonl"), host="0.0.0.0", idle_timeout_s=0.5) as viewer:
        port = viewer.url.rsplit(":", 1)[1].rstrip("/")
        local = f"http://127.0.0.1:{port}/trace.json"
        rebound = httpx.get(local, headers={"Host": f"attacker.example:{port}"})
        assert rebound.status_code == 403 and NASTY not in rebound.text
        assert httpx.get(local).status_code == 200
        with socket.create_connection(("127.0.0.1", int(port))) as half:
            half.sendall(b"GET /trace.json HTTP/1.1\r\n")
            half.settimeout(30)
            assert half.recv(100) == b""  # closed by the viewer, with nothing sent


def test_held_connections_never_keep_the_users_browser_out(tmp_path: Path) -> None:
    """Each connection held a thread of the viewer, and a head sent a byte now and then (within the
    idle timeout) kept it for good: nothing bounded how many, so a local process could take every
    thread and descriptor it had. The viewer holds at most max_connections now, and a new one
    takes the place of the oldest connection still waiting for its head."""
    import select
    import socket

    with ViewerServer(hostile_trace(tmp_path / "evil.jsonl"), idle_timeout_s=60, max_connections=4) as viewer:
        port = int(viewer.url.rsplit(":", 1)[1].rstrip("/"))
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
        try:
            for sock in held:
                sock.sendall(b"GET /trace.json HTTP/1.1\r\nHost: 127.0.0.1")  # a head never finished
            closed: set[socket.socket] = set()
            for _ in range(100):  # until the server has dropped the 8 oldest; at most 10 s
                ready, _, _ = select.select([s for s in held if s not in closed], [], [], 0.1)
                closed |= {s for s in ready if s.recv(100) == b""}
                if len(closed) >= 8:
                    break
            assert closed == set(held[:8])
            assert select.select(held[8:], [], [], 0)[0] == []  # the 4 newest are still open
            page = httpx.get(viewer.url, timeout=30)  # the user's browser: it takes one's place
            assert page.status_code == 200
        finally:
            for sock in held:
                sock.close()


def test_one_remote_address_holds_a_quarter_of_the_viewers_connections() -> None:
    """Bound beyond loopback (--host), one address may hold a quarter of the connections: its new
    one takes the place of its own oldest waiting one, and is refused when all of its are busy."""
    import socket

    from recursa.trace.viewer.connections import ConnectionGate

    gate = ConnectionGate(total=8, head_timeout_s=60)
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        mine = [p[0] for p in pairs]
        assert gate.admit(mine[0], "203.0.113.9") and gate.admit(mine[1], "203.0.113.9")
        assert gate.admit(mine[2], "203.0.113.9")  # past 8 // 4: the oldest waiting one goes
        assert pairs[0][1].recv(10) == b""
        gate.head_done(mine[1])
        gate.head_done(mine[2])
        assert not gate.admit(mine[3], "203.0.113.9")  # both busy answering: refused
        assert gate.admit(mine[3], "198.51.100.7")  # another address has its own share
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_a_trace_of_any_size_is_read_within_the_viewers_bounds(tmp_path: Path) -> None:
    """A trace is anyone's file: it was read whole into memory, with every event, every field in
    full and then the view on top (a 40 MB line took some 200 MB to show). The viewer now reads a
    line at a time within ViewLimits, skips a line past its bytes or its values unparsed, cuts long
    fields, stops at the first event past its bounds, and says each of these on the page."""
    import tracemalloc

    start = {"seq": 1, "ts": 1.0, "type": "run_start", "run_id": "R", "depth": 0, "question": "q"}
    turn = {"seq": 2, "ts": 1.1, "type": "turn", "run_id": "R", "turn": 1}
    path = tmp_path / "huge.jsonl"
    with path.open("w") as fh:
        fh.write(json.dumps(start) + "\n")
        fh.write(json.dumps({**turn, "junk": "x" * (40 << 20)}) + "\n")  # past max_line_bytes
        fh.write(json.dumps({**turn, "junk": [{}] * 1_000_000}) + "\n")  # 3 MB, a million values
        fh.write(json.dumps({**turn, "seq": 3, "stdout": "y" * 200_000, "type": "exec"}) + "\n")
        fh.write(json.dumps({**turn, "seq": 4}) + "\n")
    tracemalloc.start()
    try:
        view = build_view(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, peak  # about the longest line read (16 MiB), not the file's 43 MB
    from recursa.trace.viewer.reading import LIMITS, ViewLimits

    warned = " ".join(view["warnings"])
    assert "1 lines are longer than the viewer reads (16 MiB)" in warned
    assert "1 lines hold more JSON values than the viewer reads" in warned
    assert "1 events hold more text than the viewer shows" in warned
    execs = [json.loads(d) for n, d in zip(view["nodes"], view["details"], strict=True) if n["k"] == "exec"]
    shown = execs[0]["stdout"]
    assert shown.startswith("y" * LIMITS.max_field_chars) and "150,000 more characters in the trace file" in shown
    assert len([n for n in view["nodes"] if n["k"] == "turn"]) == 1  # the last turn event, read

    # Past max_events (or the weight of what they hold) the rest of the file is not read, and the
    # page says how far the view goes.
    many = tmp_path / "many.jsonl"
    turns = (json.dumps({**turn, "seq": i + 2, "turn": i}) for i in range(200))
    many.write_text(json.dumps(start) + "\n" + "\n".join(turns) + "\n")
    small = ViewLimits(max_events=50)
    view = build_view(many, small)
    assert len(view["nodes"]) == 50 and view["summary"]["stop_reason"] == "running"
    assert any("larger than the viewer shows: it shows the first 50 events" in w for w in view["warnings"])
    heavy = ViewLimits(max_weight=20_000)
    assert 1 < len(build_view(many, heavy)["nodes"]) < 200
