"""The Markdown facts the docs checks need, read line by line with line numbers.

Not a Markdown parser: it knows fenced code blocks (``` and ~~~), inline code spans on one line,
inline links `[text](target)`, headings and their anchors (the slugs MkDocs' `toc` extension makes,
plus explicit `{#id}` attributes and `<a id="...">` tags), and generated blocks between
`<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED: name -->`.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ATTR_ID = re.compile(r"\{\s*#([\w.:-]+)[^}]*\}\s*$")
_HTML_ID = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=\"([^\"]+)\"")
BLOCK = re.compile(r"<!-- BEGIN GENERATED: ([\w.-]+) -->\n(.*?)<!-- END GENERATED: \1 -->", re.S)


@dataclass(frozen=True)
class CodeBlock:
    lang: str
    start: int  # line number (1-based) of the first line inside the fence
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Span:
    text: str
    line: int
    after: str  # the rest of the line after the span (for "`--x` (default 5)")


@dataclass
class Page:
    text: str
    blocks: list[CodeBlock]
    prose: list[tuple[int, str]]  # (line number, line) outside code blocks

    def spans(self) -> list[Span]:
        out = []
        for n, line in self.prose:
            for m in _SPAN.finditer(line):
                out.append(Span(m.group(2).strip(), n, line[m.end():]))
        return out

    def links(self) -> list[tuple[int, str]]:
        out = []
        for n, line in self.prose:
            stripped = _SPAN.sub("", line)  # a link written inside a code span is not a link
            out.extend((n, m.group(2)) for m in _LINK.finditer(stripped))
        return out


def parse(text: str) -> Page:
    blocks: list[CodeBlock] = []
    prose: list[tuple[int, str]] = []
    fence: str | None = None
    lang, start, body = "", 0, []
    for n, line in enumerate(text.splitlines(), start=1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence, lang, start, body = m.group(1), m.group(2).lower(), n + 1, []
            else:
                prose.append((n, line))
        elif m and line.strip().startswith(fence) and not line.strip()[len(fence):].strip():
            blocks.append(CodeBlock(lang, start, tuple(body)))
            fence = None
        else:
            body.append(line)
    return Page(text, blocks, prose)


def slugify(text: str, separator: str = "-") -> str:
    """The anchor MkDocs (Python-Markdown `toc`) gives a heading: code spans keep their text verbatim."""
    parts = re.split(r"(`+)(.+?)\1", text)
    plain = []
    for i in range(0, len(parts), 3):
        prose = re.sub(r"<[^>]+>", "", parts[i])  # inline HTML is dropped
        prose = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", prose)  # links keep their text
        prose = re.sub(r"\*{1,3}(\S.*?\S|\S)\*{1,3}", r"\1", prose)
        plain.append(prose)
        if i + 2 < len(parts):
            plain.append(parts[i + 2])
    text = unicodedata.normalize("NFKD", "".join(plain)).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(rf"[{separator}\s]+", separator, text)


def anchors(page: Page) -> set[str]:
    """Every anchor a link can point at: heading slugs (deduplicated `_1`, `_2`), `{#id}`, `<a id>`."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in page.prose:
        out.update(_HTML_ID.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        title = m.group(2)
        explicit = _ATTR_ID.search(title)
        if explicit:
            out.add(explicit.group(1))
            continue
        slug = slugify(title)
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}_{seen[slug]}"
        else:
            seen[slug] = 0
        out.add(slug)
    return out


def replace_block(text: str, name: str, content: str) -> str:
    """`text` with generated block `name` holding `content`; KeyError when the markers are missing."""
    if not content.endswith("\n"):
        content += "\n"
    pattern = re.compile(rf"(<!-- BEGIN GENERATED: {re.escape(name)} -->\n)(.*?)(<!-- END GENERATED: {re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise KeyError(name)
    return pattern.sub(lambda m: m.group(1) + content + m.group(3), text, count=1)


def blocks_in(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in BLOCK.finditer(text)}


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1
