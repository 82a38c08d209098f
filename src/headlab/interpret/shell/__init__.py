"""The one HTML shell and stylesheet of every headlab page, on disk and in a notebook.

Every page headlab writes (``analyze``'s report, ``explain``, ``probe``, ``heads``, ``flow``) is
:func:`page`: a header (title, summary lines, a highlighted banner), the page's own body, its data as
inline JSON and its script, with the one stylesheet ``assets/headlab.css`` written inline. No
network: nothing is fetched from a CDN, so a page opens offline and in a notebook alike.

In Jupyter, a result object with a page shows it inline (``_repr_html_``) through :func:`inline`: the
same page in a sandboxed ``<iframe srcdoc=...>``, so its script and stylesheet run as they do in a
browser and touch nothing else in the notebook (as bertviz and circuitsvis render inline).

    >>> from headlab.interpret import shell
    >>> p = shell.page(title="t", body="<p>hi</p>", summary_lines=["one line"])
    >>> p.startswith("<!DOCTYPE html>") and "<p>hi</p>" in p and "http" not in p.split("<body>")[1]
    True
    >>> shell.inline(p).startswith('<iframe class="headlab-page"')
    True
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from importlib import resources

__all__ = ["inline", "inline_json", "page", "stylesheet"]


def stylesheet() -> str:
    """The one stylesheet every page carries inline."""
    return resources.files("headlab.interpret.shell").joinpath("assets", "headlab.css").read_text(encoding="utf-8")


def inline_json(obj) -> str:
    """JSON safe inside a ``<script>`` element: no ``</`` or ``<!--`` can close or confuse it."""
    return json.dumps(obj, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page(
    *,
    title: str,
    body: str,
    summary_lines: Sequence[str] = (),
    banner: str | None = None,
    data: object = None,
    data_id: str = "headlab-data",
    script: str = "",
    generator: str = "headlab",
) -> str:
    """One self-contained page.

    Args:
        title: the heading and the window title (plain text, escaped here).
        body: the page's own HTML (trusted: built by headlab from escaped text), inside ``<main>``.
        summary_lines: plain-text lines under the heading.
        banner: a highlighted plain-text note, or None.
        data: written as ``<script type="application/json" id="{data_id}">`` for the script to read.
        script: the page's script (trusted), run after the body.
        generator: the ``<meta name="generator">`` (which command wrote it).
    """
    t = html.escape(title)
    summary = "".join(f"<p>{html.escape(line)}</p>" for line in summary_lines)
    if banner:
        summary += f'<p class="banner">{html.escape(banner)}</p>'
    payload = "" if data is None else f'<script type="application/json" id="{data_id}">{inline_json(data)}</script>\n'
    code = f"<script>\n{script}\n</script>\n" if script else ""
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta name="generator" content="{html.escape(generator)}">\n<title>{t}</title>\n'
        f"<style>\n{stylesheet()}\n</style>\n</head>\n<body>\n<header>\n  <h1>{t}</h1>\n  {summary}\n</header>\n"
        f"<main>\n{body}\n</main>\n{payload}{code}</body>\n</html>\n"
    )


def inline(page_html: str, *, height: int = 720) -> str:
    """A page as notebook output: the page itself in a sandboxed iframe (scripts run, nothing leaves it)."""
    return (
        f'<iframe class="headlab-page" sandbox="allow-scripts" style="width: 100%; height: {int(height)}px; '
        f'border: 1px solid #c8cdd8;" srcdoc="{html.escape(page_html, quote=True)}"></iframe>'
    )
