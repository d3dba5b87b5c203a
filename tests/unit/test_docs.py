"""The documentation stays true to the tree: the generated configuration reference, every relative
link (and anchor), the README's size, and the paths its Layout section names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from resilient import config_reference, context_reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_BYTES = 14_000

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and HTML comments (links and headings there are not)."""
    return COMMENT.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces → -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(CODE_SPAN.sub("", prose(path.read_text())))]


@pytest.mark.parametrize(
    ("generator", "doc"), [(config_reference, "configuration.md"), (context_reference, "context.md")]
)
def test_generated_references_match_the_code(generator: Any, doc: str):
    current = (DOCS / doc).read_text()
    assert current == generator.markdown(), (
        f"docs/{doc} differs from the code it documents; regenerate it with `{generator.COMMAND}`"
    )


def test_every_public_member_of_the_context_says_what_it_is():
    assert context_reference.undocumented() == []
    text = context_reference.markdown()
    for name, _ in context_reference.members():
        assert f"`ctx.{name}`" in text
    assert "ctx.steps(total: int | Iterable[Any]) -> Iterator[Any]" in text


def test_generator_lists_every_field():
    text = config_reference.markdown()
    for key in ("`hang_timeout`", "`restart.max_recoveries`", "`checkpoint.preempt_signals`", "`events.dir`"):
        assert f"| {key} |" in text
    # fields without a description still get their row (with an empty description)
    for key in config_reference.undocumented():
        assert f"| `{key}` |" in text


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md: Path):
    broken = []
    for target in links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (md.parent / path_part).resolve() if path_part else md
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if ROOT not in (dest, *dest.parents):
            broken.append(f"{target}: outside the repository")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{md.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_doc_is_reachable_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README) if not t.startswith("#")}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"README.md links to none of: {missing}"


def test_readme_is_a_front_door():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes (at most {README_MAX_BYTES}): move depth to docs/"
    )


def layout_paths() -> list[str]:
    """The paths the README's Layout block names.

    Each line of the block is `<indent><names>  <description>`: names (comma-separated) end at the
    first run of two spaces; a single name ending in `/` is the parent of the lines indented below it.
    """
    text = README.read_text()
    section = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Layout' section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "the Layout section has no code block"
    paths: list[str] = []
    parents: list[tuple[int, str]] = []  # (indent, directory path)
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        names = [n.strip() for n in re.split(r" {2,}", line.strip(), maxsplit=1)[0].split(",")]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        for name in names:
            paths.append(base + name)
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, base + names[0]))
    return paths


def test_layout_names_only_existing_paths():
    paths = layout_paths()
    assert len(paths) > 20, f"the Layout block parsed into too few paths: {paths}"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README.md's Layout names paths that do not exist: {missing}"
    for p in paths:
        if p.endswith("/"):
            assert (ROOT / p).is_dir(), f"{p} is not a directory"
