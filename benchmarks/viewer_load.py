"""The trace viewer on a large real trace: a scripted RLM fans out ~10,000 sub-calls (one per
1,000-character piece, 64 at a time), then we time building the view, writing the standalone
HTML, and loading it in headless Chromium (the system browser, through Playwright): page ready,
expand-all, scroll to the end, and a search over every node's text.

    python benchmarks/viewer_load.py [--nodes 10000] [--trace existing.jsonl]
    python benchmarks/viewer_load.py --oversize 200000   # a trace past the viewer's bounds

With --oversize N it writes a trace of N sub-calls (some 1 KB each) instead, far past what one view
holds (recursa/trace/viewer/reading.py), and prints what building its view took: time, the
process's peak memory, and how much of the trace the view shows.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from recursa import RLM
from recursa.trace.viewer import build_view, export_html

CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def make_trace(nodes: int, folder: Path) -> Path:
    # ~1,000 characters per sub-call with the `chunk=1000` knob: this many lines gives `nodes` calls.
    lines = nodes * 9  # measured: about 9 lines of this shape per sub-call with chunk=1000
    context = "\n".join(
        f"Line {i}: the weather in city {i % 97} was mild, the river at {i % 13} m." for i in range(lines)
    )
    rlm = RLM("scripted/gpt5-like:chunk=1000", sub_model="scripted/oracle:latency=0.002", trace_dir=folder)
    result = rlm.run("Which city had the highest river?", context)
    assert result.trace_path is not None
    return result.trace_path


def oversize(calls: int, folder: Path) -> None:
    path = folder / "oversize.jsonl"
    with path.open("w") as fh:
        fh.write(json.dumps({"seq": 0, "ts": 1.0, "type": "run_start", "run_id": "R", "depth": 0, "question": "q"}) + "\n")
        fh.write(json.dumps({"seq": 1, "ts": 1.0, "type": "turn", "run_id": "R", "turn": 1}) + "\n")
        for i in range(calls):
            call = {"seq": i + 2, "ts": 1.0 + i * 1e-4, "type": "lm_call", "run_id": "R", "purpose": "sub",
                    "call_id": f"c.{i}", "prompt": "p" * 400, "response": "r" * 400, "latency_s": 0.01,
                    "usage": {"input_tokens": 5, "output_tokens": 5}}  # fmt: skip
            fh.write(json.dumps(call) + "\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    view = build_view(path)
    body = json.dumps(view, ensure_ascii=False, separators=(",", ":")).encode()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"trace: {path.stat().st_size / 1e6:.0f} MB, {calls + 2:,} events; view: {len(view['nodes']):,} nodes, "
        f"{len(body) / 1e6:.0f} MB of JSON, built in {time.perf_counter() - t:.1f} s; process peak "
        f"{peak / 1e3:.0f} MB ({before / 1e3:.0f} MB before)"
    )
    print("warning:", view["warnings"][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--oversize", type=int, metavar="N", help="time a trace of N sub-calls instead")
    args = parser.parse_args()
    if args.oversize:
        with tempfile.TemporaryDirectory() as tmp:
            oversize(args.oversize, Path(tmp))
        return
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace or make_trace(args.nodes, Path(tmp))
        t = time.perf_counter()
        view = build_view(trace)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        html = export_html(trace, Path(tmp) / "view.html")
        export_s = time.perf_counter() - t
        print(
            f"trace: {trace.stat().st_size / 1e6:.1f} MB, {len(view['nodes']):,} nodes, {view['rows']} timeline rows"
        )
        print(
            f"build_view: {build_s * 1000:.0f} ms; export_html: {export_s * 1000:.0f} ms ({html.stat().st_size / 1e6:.1f} MB)"
        )
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            t = time.perf_counter()
            page.goto(html.as_uri())
            page.wait_for_selector("body[data-ready='1']", state="attached", timeout=120_000)
            wall = time.perf_counter() - t
            state = page.evaluate("window.__recursaViewer")
            print(
                f"page ready: {wall * 1000:.0f} ms wall (navigation start -> first render "
                f"{state['sinceNavigationMs']:.0f} ms, of which the viewer's own setup {state['loadMs']:.0f} ms)"
            )
            timed = {
                "expand all": "document.getElementById('expand-all').click()",
                "scroll to the end": "(() => { const t = document.getElementById('tree'); t.scrollTop = 1e9; t.dispatchEvent(new Event('scroll')); })()",
                "first search (builds the index)": "(() => { const s = document.getElementById('search'); s.value = 'line 4242:'; s.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter'})); })()",
                "second search": "(() => { const s = document.getElementById('search'); s.value = 'river at 12'; s.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter'})); })()",
            }
            for name, script in timed.items():
                ms = page.evaluate(
                    "async (code) => { const t = performance.now(); eval(code);"
                    " await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));"
                    " return performance.now() - t; }",
                    script,
                )
                print(
                    f"{name}: {ms:.0f} ms (to the next frame); rows in the DOM: {page.locator('.row').count()}"
                )
            print("search result:", page.text_content("#search-count"))
            browser.close()


if __name__ == "__main__":
    main()
