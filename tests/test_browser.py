"""JupyterLab in a real browser: headless Chromium (Debian's `chromium`) driven by
Playwright's Python client, no browser download.

One JupyterLab server (a free port, a token, temporary config/runtime/settings/workspace
folders) serves a temporary copy of labs/ (JupyterLab autosaves: the generated labs must
not change) plus three scratch notebooks. Through the UI: lab 00 runs top to bottom (its
exercises filled in from solutions/, as a learner who solved them has it: Run > Run All
Cells, then every code cell has run and none raised); lab 04's ring all-reduce widget is
rendered and its slider moved with the keyboard (the figure changes); a `launch()` cell
whose rank 0 prints, then sleeps, shows the printed line while the cell still runs.
Screenshots go to test-artifacts/browser/ (gitignored). A dialog that a slow kernel start
can raise (Select Kernel, ...) is answered as a learner would; any other dialog fails the
test with its title and text, and a screenshot.

Skipped, with the reason printed, when chromium or playwright is missing:
    apt-get install -y chromium && python -m pip install playwright
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid

import nbformat
import pytest

from mgpu_lab.course.notebook.cells import SETUP_TAG, tags
from conftest import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts" / "browser"


def _why_skip():
    if not os.path.exists(CHROMIUM):
        return "chromium not found: apt-get install -y chromium (Debian's package; no Playwright download)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright missing: python -m pip install playwright (the Python client only)"
    return None


WHY = _why_skip()
if WHY:
    print(f"tests/test_browser.py skipped: {WHY}", file=sys.stderr)
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""), pytest.mark.timeout(240)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook(cells):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in cells])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _solved(name):
    nb = nbformat.read(ROOT / "solutions" / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def _kernel_env():
    """The kernels' environment: this checkout's mgpu_lab first, one thread per process."""
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """A JupyterLab server on a copy of labs/; yields (base_url, token, folder)."""
    tmp = tmp_path_factory.mktemp("jlab")
    root = tmp / "labs"
    shutil.copytree(ROOT / "labs", root)
    nbformat.write(_solved("00_setup.ipynb"), root / "00_setup_solved.ipynb")
    ring = nbformat.read(ROOT / "solutions" / "04_ring_allreduce_and_ddp.ipynb", as_version=4)
    wanted = ("import ipywidgets", "states = simulate_ring_allreduce", "ring_widget = widgets.interactive")
    nbformat.write(_notebook([c.source for c in ring.cells if c.cell_type == "code"
                              and (SETUP_TAG in tags(c) or any(w in c.source for w in wanted))]),
                   root / "scratch_ring_widget.ipynb")
    nbformat.write(_notebook(['''
        import time
        import torch.distributed as dist
        from mgpu_lab import launch

        def talk():
            if dist.get_rank() == 0:
                print("rank 0: hello while running", flush=True)
            time.sleep(8)
            return dist.get_rank()

        print("ranks returned", launch(talk, nprocs=2, backend="gloo", timeout=60))
    ''']), root / "scratch_live_launch.ipynb")
    settings = tmp / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')  # every cell in the DOM

    port, token = _free_port(), uuid.uuid4().hex
    env = {**_kernel_env(), "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces")}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp / "jupyterlab.log", "w")
    server = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start in 60 s:\n{(tmp / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.5)
    try:
        yield base, token, root
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    yield pg
    context.close()


def open_notebook(page, lab_server, name):
    base, token, _ = lab_server
    page.goto(f"{base}/lab/tree/{name}?reset&token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
    handle_dialogs(page, f"opening {name}")
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")  # the kernel is up
    click(page, page.locator(".jp-NotebookPanel .jp-Cell").first, f"in {name}")


# Dialogs JupyterLab may show while a kernel starts slowly on a loaded machine, and the
# button that answers each as a learner would. Any other dialog fails the test with its
# title, its text and a screenshot.
HARMLESS_DIALOGS = {"Select Kernel": "Select", "Kernel Restarting": "Ok",
                    "No Kernel": "Ok", "Kernel Busy": "Ok"}


def handle_dialogs(page, where: str) -> None:
    """Answer the harmless dialogs that are open; fail on any other one."""
    for _ in range(5):
        dialog = page.locator(".jp-Dialog")
        if dialog.count() == 0:
            return
        title = page.locator(".jp-Dialog-header").first.inner_text().strip()
        body = page.locator(".jp-Dialog-body").first.inner_text().strip()
        if title not in HARMLESS_DIALOGS:
            shot = ARTIFACTS / f"dialog_{re.sub(r'[^A-Za-z0-9]+', '_', where)}.png"
            page.screenshot(path=str(shot), full_page=True)
            pytest.fail(f"an unexpected JupyterLab dialog {where}: {title!r}: {body[:500]!r} "
                        f"(screenshot {shot})")
        buttons = page.locator(".jp-Dialog-footer button")
        wanted = buttons.filter(has_text=HARMLESS_DIALOGS[title])
        (wanted if wanted.count() else page.locator(".jp-Dialog-footer .jp-mod-accept")).first.click()
        time.sleep(0.5)
    pytest.fail(f"JupyterLab kept opening dialogs {where}")


def click(page, locator, where: str) -> None:
    """Click, answering a harmless dialog in the way (at most 3 tries of 15 s)."""
    for attempt in range(3):
        handle_dialogs(page, where)
        try:
            locator.click(timeout=15_000)
            return
        except Exception:
            if attempt == 2:
                handle_dialogs(page, where)
                raise


def run_all(page):
    """Run > Run All Cells; again if no cell started (a kernel still connecting ignores it)."""
    for _ in range(5):
        click(page, page.get_by_role("menuitem", name="Run", exact=True), "before the Run menu")
        click(page, page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")),
              "before Run All Cells")
        try:
            page.wait_for_function("""() => Array.from(document.querySelectorAll('.jp-InputPrompt'))
                .some(p => /[0-9*]/.test(p.textContent))""", timeout=10_000)
            return
        except Exception:
            handle_dialogs(page, "after Run All Cells")
            page.keyboard.press("Escape")
    raise AssertionError("Run > Run All Cells started no cell in 50 s")


def prompts(page):
    """The code cells' input prompts as the UI shows them: "[3]:", "[*]:" (running or queued), "[ ]:"."""
    return [t.strip() for t in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()]


def test_lab_00_runs_top_to_bottom_through_the_ui(page, lab_server):
    name = "00_setup_solved.ipynb"
    open_notebook(page, lab_server, name)
    run_all(page)
    path = lab_server[2] / name
    deadline, stopped = time.monotonic() + 120, 0
    while True:        # the UI's prompts until every cell has run and the kernel is idle
        time.sleep(2)
        handle_dialogs(page, "while lab 00 runs")
        shown = prompts(page)
        idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
        if shown and all(re.fullmatch(r"\[\d+\]:", p) for p in shown) and idle:
            break
        stopped = stopped + 1 if idle and "[*]:" not in shown else 0   # Run All ended early
        if stopped >= 2 or time.monotonic() > deadline:
            page.screenshot(path=str(ARTIFACTS / "lab00_not_run.png"), full_page=True)
            page.keyboard.press("Control+s")
            time.sleep(1)
            raised = [f"{o['ename']}: {o['evalue']}" for c in nbformat.read(path, as_version=4).cells
                      for o in c.get("outputs", []) if o.output_type == "error"]
            pytest.fail(f"not every cell ran ({'the kernel idle' if stopped else 'after 120 s'}): "
                        f"prompts {shown}, errors saved {raised[:1]} "
                        f"(screenshot {ARTIFACTS / 'lab00_not_run.png'})")
    for _ in range(10):  # save, then read what the UI ran from disk
        page.keyboard.press("Control+s")
        time.sleep(1)
        code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        if all(c.execution_count for c in code):
            break
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"a cell raised: {errors[0]['ename']}: {errors[0]['evalue']}"
    page.screenshot(path=str(ARTIFACTS / "lab00_run_all.png"), full_page=True)
    counts = [c.execution_count for c in code]
    assert all(counts), f"the saved notebook lacks execution counts: {counts}"
    assert counts == sorted(counts) and len(set(counts)) == len(counts), f"not top to bottom: {counts}"


def test_lab_04_ring_widget_renders_and_moves(page, lab_server):
    open_notebook(page, lab_server, "scratch_ring_widget.ipynb")
    run_all(page)
    slider = page.locator(".widget-slider").first
    slider.wait_for()
    image = page.locator(".jp-OutputArea-output img").last
    image.wait_for()
    readout = page.locator(".widget-readout").first
    assert readout.inner_text().strip() == "0"
    before = image.get_attribute("src")
    page.screenshot(path=str(ARTIFACTS / "lab04_widget_step0.png"), full_page=True)
    page.locator(".widget-slider .noUi-handle").first.focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    page.wait_for_function("""() => {
        const r = document.querySelector('.widget-readout');
        return r && (r.innerText || r.textContent).trim() === '2'; }""")
    page.wait_for_function("(old) => { const imgs = document.querySelectorAll('.jp-OutputArea-output img');"
                           " return imgs.length && imgs[imgs.length - 1].src !== old; }", arg=before)
    page.screenshot(path=str(ARTIFACTS / "lab04_widget_step2.png"), full_page=True)
    assert image.get_attribute("src") != before


def test_launch_cell_shows_rank_0_output_while_it_runs(page, lab_server):
    open_notebook(page, lab_server, "scratch_live_launch.ipynb")
    run_all(page)
    output = page.locator(".jp-OutputArea-output", has_text="rank 0: hello while running")
    prompt = page.locator(".jp-InputPrompt").first
    try:
        output.wait_for(timeout=30_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "launch_live_missing.png"), full_page=True)
        raise
    running = "*" in prompt.inner_text()
    page.screenshot(path=str(ARTIFACTS / "launch_live_output.png"), full_page=True)
    assert running, "rank 0's line appeared only after the cell finished"
    page.locator(".jp-OutputArea-output", has_text="ranks returned [0, 1]").wait_for(timeout=60_000)
