"""Execute a notebook (nbclient), render it to HTML (nbconvert) and look at it in headless
Chromium: a screenshot, or the DOM the browser built. Used by the browser test and to make
the README's screenshot (``python tests/system/notebook_render.py OUT.png``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def execute_and_render(nb_path: Path, workdir: Path, timeout: int = 300) -> tuple[Path, object]:
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(nb_path), as_version=4)
    NotebookClient(
        nb, kernel_name="python3", timeout=timeout, resources={"metadata": {"path": str(workdir)}}
    ).execute()
    body, _ = HTMLExporter().from_notebook_node(nb)
    out = workdir / (nb_path.stem + ".html")
    out.write_text(body)
    return out, nb


def browse(html: Path, *args: str, timeout: float = 120.0) -> str:
    """Run headless Chromium on ``html`` with ``args``; its stdout."""
    exe = chromium()
    assert exe, "chromium is not installed (apt-get install -y chromium)"
    with tempfile.TemporaryDirectory(prefix="gangrun-chromium-") as profile:
        proc = subprocess.run(
            [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, html.as_uri()],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, HOME=profile),
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def panel_only(html: Path) -> Path:
    """A page holding just the panels of ``html`` (for a compact screenshot)."""
    import re

    text = html.read_text()
    panels = re.findall(r'<div class="gangrun-panel".*?<!--/gangrun-panel-->', text, re.S)
    out = html.with_name(html.stem + "-panel.html")
    out.write_text(
        "<html><body style='margin:8px;background:white'>" + "".join(panels) + "</body></html>"
    )
    return out


if __name__ == "__main__":  # pragma: no cover - makes docs/notebook_panel.png
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "notebook_panel.png")
    with tempfile.TemporaryDirectory() as d:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{d}/mlflow.db")
        html, _ = execute_and_render(ROOT / "examples" / "quickstart.ipynb", Path(d))
        page = panel_only(html)
        browse(page, f"--screenshot={target.resolve()}", "--window-size=900,290")
    print(target)
