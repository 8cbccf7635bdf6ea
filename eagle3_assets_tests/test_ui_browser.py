"""Operate the graph from the Dagster UI, in a real browser (headless Chromium driven by Playwright).

`eagle3 ui` (`dagster dev`: webserver + daemon) runs on a temporary project root holding copies of the repo's
dagster.yaml and workspace.yaml, on the embedded target (the real SmolLM2-135M-Instruct) with a
tiny prompt set: 4 prompts in 2 shards of 2. `prompts` is materialized in-process on the same
instance so that the dynamic shard partitions exist; everything after that goes through the
rendered pages:

1. the global asset lineage page shows the six assets and exactly the six edges of the graph
   (read from the SVG: each edge's end points are matched to the nodes they touch), and the
   Lineage tab and Overview of `hidden_states` show `generations` upstream and `drafter`
   downstream;
2. `generations` + `hidden_states` are selected in the lineage page's asset filter,
   "Materialize all…" is clicked, one shard partition is picked in the dialog and
   "Launch 1 run" is clicked;
3. the run is awaited (polling the instance), and its page is opened;
4. the Partitions tab of `hidden_states` shows, for that shard, the metadata of the instance's
   materialization event (samples, tokens, tokens_per_s, model_load_s, bytes_on_disk, ...);
5. the second shard is launched the same way, then the Overview's Metadata "Plots" view of
   `hidden_states` draws a chart per numeric metadata key (tokens_per_s, bytes_on_disk,
   samples, model_load_s, ...) across the dynamic shard partitions, and across events.

The browser context bypasses the UI's Content-Security-Policy only so that Playwright's
`wait_for_function` (which evaluates its predicate) may run; the pages themselves are unchanged.
Every step is screenshotted into `test-artifacts/ui/` at the repo root (git-ignored) and into
the test's tmp dir (`<tmp>/ui/`). No step needed the GraphQL API; it is only used to wait until
the webserver answers.

Needs Debian's chromium at /usr/bin/chromium (`apt-get install chromium`; `.ci/run` installs it)
and the Python `playwright` package (the `test` extra); `playwright install` is never needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, DagsterRunStatus, RunsFilter

from eagle3_assets.cli import ensure_instance
from eagle3_assets.definitions import build_definitions
from eagle3_assets.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ASSETS = ["prompts", "generations", "hidden_states", "vocab_map", "drafter", "drafter_eval"]
GROUPS = ["data", "features", "drafter"]  # the graph opens with its groups collapsed
EDGES = {
    ("prompts", "generations"), ("generations", "hidden_states"), ("generations", "vocab_map"),
    ("hidden_states", "drafter"), ("vocab_map", "drafter"), ("drafter", "drafter_eval"),
}
SHARDS = ["rows_00000-00002", "rows_00002-00004"]
PLOTTED = ["tokens_per_s", "bytes_on_disk", "samples", "model_load_s"]
SETTINGS = {
    "target_model": "embedded:SmolLM2-135M-Instruct",
    "prompts_source": "embedded:sharegpt",
    "max_prompts": 4,
    "shard_size": 2,
    "max_prompt_tokens": 128,
    "generation": {"max_new_tokens": 8, "batch_size": 2},
}
RUN_TIMEOUT_S = 240

# The asset graph as drawn: each node is an SVG <foreignObject>, each edge a <path> with an arrow
# marker. An edge's first and last points lie on the border of the nodes it joins.
GRAPH_JS = """(names) => {
  const re = (n) => new RegExp('(^|[^a-z_])' + n + '([^a-z_]|$)');
  const byName = {};  // the smallest box that names each node: an expanded group's box holds its assets
  for (const f of document.querySelectorAll('svg foreignObject')) {
    const hits = names.filter((n) => re(n).test(f.textContent || ''));
    if (hits.length !== 1) continue;
    const n = {name: hits[0], x: +f.getAttribute('x'), y: +f.getAttribute('y'),
               w: +f.getAttribute('width'), h: +f.getAttribute('height')};
    if (!byName[n.name] || n.w * n.h < byName[n.name].w * byName[n.name].h) byName[n.name] = n;
  }
  const nodes = Object.values(byName);
  const dist = (n, px, py) => Math.hypot(Math.max(n.x - px, 0, px - n.x - n.w), Math.max(n.y - py, 0, py - n.y - n.h));
  const nearest = (px, py) => {
    let best = null, bd = Infinity;
    for (const n of nodes) { const d = dist(n, px, py); if (d < bd) { bd = d; best = n; } }
    return bd <= 15 ? best.name : null;
  };
  const edges = [];
  for (const p of document.querySelectorAll('svg path[marker-end]')) {
    const nums = (p.getAttribute('d') || '').match(/-?[0-9.]+/g);
    if (!nums || nums.length < 4) continue;
    const v = nums.map(Number);
    edges.push([nearest(v[0], v[1]), nearest(v[v.length - 2], v[v.length - 1])]);
  }
  return {nodes: nodes.map((n) => n.name), edges};
}"""

# A metadata plot: the key's title and, in the same card, a chart canvas with something drawn.
PLOTS_JS = """(labels) => {
  const out = {};
  for (const label of labels) {
    out[label] = null;
    for (const s of document.querySelectorAll('span')) {
      if (s.textContent.trim() !== label) continue;
      let el = s;
      for (let i = 0; i < 5 && el && !el.querySelector('canvas'); i++) el = el.parentElement;
      const c = el && el.querySelector('canvas');
      if (!c || !c.width || !c.height) continue;
      const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let inked = 0;
      for (let i = 3; i < px.length; i += 4) if (px[i] > 0) inked++;
      out[label] = {width: c.width, height: c.height, inked};
      break;
    }
  }
  return out;
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def webserver_answers(port: int) -> bool:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": "{ version }"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return "errors" not in json.load(r)
    except Exception:
        return False


def stop(proc: subprocess.Popen) -> None:
    """`dagster dev` and its children (webserver, daemon, code server, run workers) share a group."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def ui_project(tmp_path, monkeypatch):
    """`dagster dev` on a temporary project root, and `prompts` materialized on its instance."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"Debian's chromium is not at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    project = tmp_path / "project"
    project.mkdir()
    for f in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(ROOT / f, project / f)
    settings_path = project / "eagle3.yaml"
    settings_path.write_text(yaml.safe_dump({**SETTINGS, "storage_root": str(tmp_path / "data")}))

    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(project), "EAGLE3_SETTINGS": str(settings_path)}
    log_path = tmp_path / "dagster-dev.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(  # `eagle3 ui`: `dagster dev` on the project, its storage made first
        [sys.executable, "-m", "eagle3_assets.cli", "ui", "--port", str(port)],
        cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    monkeypatch.chdir(project)  # dagster.yaml's storage paths are relative to the project root
    monkeypatch.setenv("DAGSTER_HOME", str(project))
    monkeypatch.setenv("EAGLE3_SETTINGS", str(settings_path))
    try:
        ensure_instance(project)  # as every eagle3 command does: one creator of the storage, under a lock
        instance = DagsterInstance.get()
        # While the webserver starts: `prompts`, in-process on the same instance (creates the shards).
        defs = build_definitions(load_settings(settings_path))
        assert defs.resolve_job_def("prompts_job").execute_in_process(instance=instance).success
        assert instance.get_dynamic_partitions("shards") == SHARDS
        deadline = time.time() + 180
        while not webserver_answers(port):
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("dagster dev did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(1)
        yield f"http://127.0.0.1:{port}", instance, tmp_path
    finally:
        stop(proc)
        log.close()


class Shots:
    """Screenshots into test-artifacts/ui/ (repo root, git-ignored) and the test's tmp dir."""

    def __init__(self, page, tmp_path: Path):
        self.page, self.dirs = page, [ARTIFACTS, tmp_path / "ui"]
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        for old in ARTIFACTS.glob("*.png"):
            old.unlink()

    def __call__(self, name: str, full_page: bool = True) -> None:
        first = self.dirs[0] / f"{name}.png"
        self.page.screenshot(path=str(first), full_page=full_page)
        for d in self.dirs[1:]:
            shutil.copy(first, d / first.name)


def wait_partition_run(instance: DagsterInstance, partition: str, timeout: float = RUN_TIMEOUT_S):
    deadline = time.time() + timeout
    while time.time() < deadline:
        runs = instance.get_runs(RunsFilter(tags={"dagster/partition": partition}))
        if runs and all(r.is_finished for r in runs):
            assert len(runs) == 1, [(r.run_id, r.status) for r in runs]
            return runs[0]
        time.sleep(2)
    raise TimeoutError(f"the run of shard {partition} did not finish in {timeout} s")


def latest_materialization(instance: DagsterInstance, asset: str, partition: str) -> dict:
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    assert records, f"no materialization of {asset}[{partition}]"
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def check_graph(page, names: list[str], edges: set[tuple[str, str]]) -> None:
    page.wait_for_function(
        "([n, e]) => document.querySelectorAll('svg foreignObject').length >= n"
        " && document.querySelectorAll('svg path[marker-end]').length >= e",
        arg=[len(names), len(edges)], timeout=60_000,
    )
    page.wait_for_timeout(1000)  # let the layout settle (nodes move while the graph loads)
    drawn = page.evaluate(GRAPH_JS, names)
    assert sorted(drawn["nodes"]) == sorted(names), drawn
    assert {tuple(e) for e in drawn["edges"]} == edges, drawn


def launch_shard_from_ui(page, base: str, partition: str, shot, step: str) -> None:
    """Lineage page: filter to generations + hidden_states, "Materialize all…", pick `partition`."""
    page.goto(f"{base}/asset-groups")
    page.wait_for_function("document.querySelectorAll('svg foreignObject').length >= 3", timeout=60_000)
    page.locator(".CodeMirror").first.click()  # the "Search and filter assets" box
    page.keyboard.type("key:generations or key:hidden_states")
    page.keyboard.press("Enter")
    page.wait_for_function(  # the two assets (inside their group boxes), and nothing else
        "() => { const t = Array.from(document.querySelectorAll('svg foreignObject')).map((f) => f.textContent);"
        " return t.some((x) => x.includes('generations')) && t.some((x) => x.includes('hidden_states'))"
        " && !t.some((x) => /prompts|vocab_map|drafter/.test(x)); }", timeout=30_000)
    shot(f"{step}a_selection")
    page.get_by_role("button", name="Materialize all").first.click()
    dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize 2 assets")
    dialog.wait_for()
    dialog.get_by_text("Select a partition or create one").click()
    page.get_by_text(partition, exact=True).first.click()  # its checkbox in the partition list
    page.keyboard.press("Escape")  # closes the partition list, not the dialog
    page.get_by_placeholder("Filter partitions").wait_for(state="hidden")
    launch = dialog.get_by_role("button", name="Launch 1 run")
    launch.wait_for()
    assert dialog.get_by_text("1 partition", exact=True).is_visible()
    shot(f"{step}b_materialize_dialog", full_page=False)
    launch.click()
    page.get_by_text(re.compile(r"Launched run [0-9a-f]{8}")).wait_for(timeout=30_000)
    shot(f"{step}c_launched", full_page=False)


def metadata_table(page) -> dict[str, str]:
    rows = page.evaluate(
        "Array.from(document.querySelectorAll('tr')).map(r => Array.from(r.querySelectorAll('td')).map(c => c.innerText.trim()))"
    )
    return {r[0]: r[1] for r in rows if len(r) >= 2}


def same(shown: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return shown == str(value)
    return float(shown) == value if isinstance(value, float) else int(shown) == value


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_operate_from_the_dagster_ui(ui_project):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    base, instance, tmp_path = ui_project
    t0 = time.time()

    def step(name: str) -> None:
        print(f"[{time.time() - t0:5.0f} s] {name}", flush=True)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        # bypass_csp: the UI's Content-Security-Policy forbids eval, which wait_for_function needs.
        page = browser.new_context(viewport={"width": 1600, "height": 1100}, bypass_csp=True).new_page()
        page.set_default_timeout(60_000)
        # On a fresh instance the UI (served from 127.0.0.1) offers "Join the Dagster community"
        # a second after the first page loads; "Skip" records it as seen on the instance. Dismiss
        # it up front, so that it cannot swallow keystrokes later, and whenever it shows again.
        nux = page.get_by_text("Join the Dagster community")
        page.add_locator_handler(nux, lambda: page.get_by_role("button", name="Skip").click())
        shot = Shots(page, tmp_path)
        try:
            step("1. asset graph")
            # 1. The asset graph: every asset, every edge.
            page.goto(f"{base}/asset-groups")
            try:
                nux.wait_for(timeout=8_000)
                page.get_by_role("button", name="Skip").click()
                nux.wait_for(state="hidden")
            except PlaywrightTimeout:
                pass  # not offered (already seen)
            check_graph(page, GROUPS, {("data", "features"), ("features", "drafter")})
            shot("01_asset_groups")
            page.keyboard.press("Alt+e")  # the graph's shortcut: expand every group
            check_graph(page, ASSETS, EDGES)
            for name in ASSETS:
                assert page.get_by_text(name, exact=True).first.is_visible()
            shot("01_asset_graph")

            page.goto(f"{base}/assets/hidden_states?view=lineage")
            check_graph(page, ["generations", "hidden_states", "drafter"],
                        {("generations", "hidden_states"), ("hidden_states", "drafter")})
            shot("02_hidden_states_lineage")
            page.goto(f"{base}/assets/hidden_states")
            page.wait_for_function(  # the Lineage section, once loaded
                "(res) => res.every((r) => new RegExp(r).test(document.body.innerText))",
                arg=[r"Upstream assets\s+generations\s", r"Downstream assets\s+drafter\s"],
            )
            shot("03_hidden_states_overview_before")

            step("2. launch shard 0")
            # 2. Launch one shard partition (generations + hidden_states) from the UI.
            launch_shard_from_ui(page, base, SHARDS[0], shot, "04")

            step("3. wait for shard 0")
            # 3. Wait for the run; show it.
            run = wait_partition_run(instance, SHARDS[0])
            assert run.status == DagsterRunStatus.SUCCESS, f"run {run.run_id}: {run.status}"
            assert run.asset_selection == {AssetKey("generations"), AssetKey("hidden_states")}
            page.goto(f"{base}/runs/{run.run_id}")
            page.get_by_text("Success", exact=True).first.wait_for()
            page.get_by_text(f"partition: {SHARDS[0]}", exact=True).wait_for()
            page.get_by_text("Loading run logs").wait_for(state="hidden")
            shot("05_run_succeeded", full_page=False)

            step("launch shard 1")
            # The second shard, the same way (a plot across partitions needs more than one);
            # it runs while the first shard's metadata is checked.
            launch_shard_from_ui(page, base, SHARDS[1], shot, "06")

            step("4. shard 0 metadata")
            # 4. The shard's metadata on the asset page = the instance's materialization event.
            event = latest_materialization(instance, "hidden_states", SHARDS[0])
            page.goto(f"{base}/assets/hidden_states?view=partitions")
            page.get_by_text(SHARDS[0], exact=True).first.click()
            page.get_by_role("cell", name="tokens_per_s", exact=True).wait_for()
            shown = metadata_table(page)
            shot("07_hidden_states_partition_metadata")
            for key in ("samples", "tokens", "tokens_per_s", "model_load_s", "bytes_on_disk", "bytes_expected",
                        "extract_s", "processes", "dtype", "path"):
                assert key in shown, (key, shown)
                assert same(shown[key], event[key]), (key, shown[key], event[key])
            assert event["samples"] == 2 and event["tokens_per_s"] > 0 and event["bytes_on_disk"] > 0

            step("5. wait for shard 1, plots")
            # 5. Numeric metadata as plots across the dynamic shard partitions, and across events.
            run2 = wait_partition_run(instance, SHARDS[1])
            assert run2.status == DagsterRunStatus.SUCCESS, f"run {run2.run_id}: {run2.status}"
            assert instance.get_materialized_partitions(AssetKey("hidden_states")) == set(SHARDS)
            page.goto(f"{base}/assets/hidden_states")
            page.get_by_placeholder("Filter metadata keys").wait_for()
            page.get_by_role("button", name=re.compile(r"\bPlots$")).click()  # name: icon label + text
            for mode, name in (("Partitions", "08_metadata_plots_by_partition"), ("Events", "09_metadata_plots_by_event")):
                page.get_by_role("button", name=re.compile(rf"\b{mode}$")).click()
                page.wait_for_function(
                    "(labels) => labels.every((l) => Array.from(document.querySelectorAll('span')).some((s) => s.textContent.trim() === l))",
                    arg=PLOTTED,
                )
                deadline = time.time() + 30
                while True:  # the charts animate in
                    plots = page.evaluate(PLOTS_JS, PLOTTED)
                    if all(v and v["inked"] > 500 for v in plots.values()) or time.time() > deadline:
                        break
                    page.wait_for_timeout(500)
                shot(name)
                for label, plot in plots.items():
                    assert plot and plot["inked"] > 500, (mode, label, plots)
        except Exception:
            shot("failure")
            raise
        finally:
            browser.close()
    print(f"\nUI test: {time.time() - t0:.0f} s in the browser; screenshots in {ARTIFACTS} and {tmp_path / 'ui'}")
