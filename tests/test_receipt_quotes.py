"""Every receipt line the README and docs/ quote is one the code prints.

- `[dsv41] <adapter> installed: …` lines: compared with the lines the adapters really print when
  the shipped production line installs (in a child Python started as production: the repo's
  sitecustomize, the engine modules imported). In a quote, `…`, `...` and `<name>` stand for any
  text; everything else must match exactly.
- every other quoted `[dsv41] …` line (plan, copy, fallback, refusal, metrics, periodic counts):
  its literal pieces (between placeholders and numbers) must appear, in order, in one string the
  adapter package's source formats (a str constant or f-string; %-holes and {}-holes split it).
"""
import ast
import json
import re

import pytest
from conftest import REPO_ROOT, run_python

from adapter.tools import profile

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"…|\.\.\.|<[^<>\s]+>")
QUOTE = re.compile(r"`(\[dsv41\][^`]*)`|^ {4,}(\[dsv41\].*)$", re.M)


def quoted_lines():
    out = []
    for path in DOCS:
        for m in QUOTE.finditer(path.read_text()):
            text = " ".join((m.group(1) or m.group(2)).split())     # a quote may wrap in Markdown
            out.append((path.name, text))
    return out


def _source_templates():
    """Each formatted string of adapter/ (not adapter/cpu, not the tools): literal pieces."""
    templates = []
    for path in (REPO_ROOT / "adapter").rglob("*.py"):
        if {"cpu", "tools"} & set(path.relative_to(REPO_ROOT / "adapter").parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "\0".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            templates.append(re.sub(r"%[-+ #0]*\d*(?:\.\d+)?[sdfgr]", "\0", text))
    return templates


TEMPLATES = _source_templates()


def _pieces(quote: str) -> list[str]:
    """Literal pieces of a quote: placeholders, numbers and engine names (values) split it."""
    return [p for p in re.split(r"sglang\.[\w.:]+|\b\d+\b|…|\.\.\.|<[^<>\s]+>", quote)
            if len(p.strip()) >= 3]


def _piece_regex(piece: str):
    """A quote piece as a regex over a template: each word matches itself or a hole (a value
    the code fills in, e.g. a core's name); everything else matches itself."""
    parts = re.split(r"(\w+)", piece.strip())
    return re.compile("".join(f"(?:{re.escape(p)}|\0)" if i % 2 else re.escape(p)
                              for i, p in enumerate(parts) if p))


def _in_order(pieces, template) -> bool:
    at = 0
    for piece in pieces:
        m = _piece_regex(piece).search(template, at)
        if m is None:
            return False
        at = m.end()
    return True


INSTALLED_CHILD = r"""
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("sglang.dsv41").addHandler(Keep())
from adapter.cpu import cpu_engine
from adapter.table import HOOKS
cpu_engine.install_torchvision_shim()
for module in dict.fromkeys(h.module for h in HOOKS):
    __import__(module)
print("LINES", json.dumps([r for r in records if " installed: " in r]))
"""


@pytest.fixture(scope="module")
def installed_lines():
    line = profile.load_line(REPO_ROOT / ".env.tp4.example", "production")
    proc = run_python(INSTALLED_CHILD, env=dict(line.env), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = json.loads(proc.stdout.split("LINES ", 1)[1])
    return {ln.split()[1]: ln for ln in lines}


def test_the_docs_quote_receipt_lines():
    quotes = quoted_lines()
    assert len(quotes) >= 20 and any(" installed: " in q for _, q in quotes)


def test_quoted_installed_lines_are_what_the_production_line_prints(installed_lines):
    bad = []
    for doc, quote in quoted_lines():
        if " installed: " not in quote or "FATAL" in quote:
            continue
        adapter = quote.split()[1]
        assert adapter in installed_lines, (doc, quote)
        pattern = "".join(".*" if PLACEHOLDER.fullmatch(p) else re.escape(p)
                          for p in re.split(f"({PLACEHOLDER.pattern})", quote) if p)
        if not re.fullmatch(pattern, installed_lines[adapter]):
            bad.append(f"{doc} quotes\n  {quote}\nthe code prints\n  {installed_lines[adapter]}")
    assert not bad, "\n".join(bad)


def test_other_quoted_lines_are_formatted_by_the_code():
    bad = []
    for doc, quote in quoted_lines():
        if " installed: " in quote and "FATAL" not in quote:
            continue
        pieces = _pieces(quote[len("[dsv41] "):])
        if " refused to install: " in quote:
            # "[FATAL: ]<adapter> refused to install: <reason>. Unset <keys> to boot without <adapter>."
            head, _, reason = quote.partition(" refused to install: ")
            reason, _, _ = reason.rpartition(". Unset ")
            pieces = _pieces(reason) or pieces
        elif " fallback: " in quote:
            pieces = _pieces(quote.split(" fallback: ", 1)[1].removesuffix(" (logged once)"))
        else:
            pieces = _pieces(quote.split(" ", 2)[2] if quote.count(" ") >= 2 else quote)
        if not any(_in_order(pieces, t) for t in TEMPLATES):
            bad.append(f"{doc}: {quote}")
    assert not bad, "no code formats these quoted lines:\n" + "\n".join(bad)


def test_the_matchers_reject_lines_the_code_does_not_print(installed_lines):
    """Negative controls: the two stale quotes the review found would fail these checks."""
    stale = installed_lines["autotune_keep"].replace("minus 13 volatile", "minus 12 volatile")
    assert stale != installed_lines["autotune_keep"] or "13" not in installed_lines["autotune_keep"]
    assert not re.fullmatch(re.escape(installed_lines["decode_yield"].split("; cost model")[0]),
                            installed_lines["decode_yield"])
    assert not any(_in_order(_pieces("swa_thin moved the moon to the evict-first end"), t) for t in TEMPLATES)
