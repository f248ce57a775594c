"""The documentation holds together: README.md stays a short page for a newcomer, every relative link in it and in
docs/*.md reaches a file of the repository (and, with an anchor, a heading of that file), every guide in docs/ is
linked from the README, and every section the code, configs and deploy files cite by name (`docs/scale.md "Across
hosts"`, `README, "Layout"`) exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
README_LIMIT = 12_000  # bytes: the README is an entry point; the guides in docs/ hold the detail
CITING = ("pipeline", "tests", "conf", "deploy", "bench", ".github", ".ci", "pyproject.toml", "Makefile", "dvc.yaml")

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # link text may wrap onto the next line
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
# A file citing a section: README, "Layout" / README "Layout" / README: 'Layout' / docs/scale.md "Across hosts"
CITATION = re.compile(r"""(README|docs/[\w.-]+\.md)[,:]?\s+["']([^"'\n]+)["']""")


def markdown(doc: str) -> str:
    """The file a citation names: ``README`` is README.md."""
    return doc if doc.endswith(".md") else f"{doc}.md"


def doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """Markdown without code blocks and code spans: a `[x](y)` inside code is an example, not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def heading_text(raw: str) -> str:
    """A heading as GitHub shows it: code, emphasis and link syntax removed."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"[`*_]", "", text).strip()


def anchors(path: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for raw in HEADING.findall(FENCE.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading_text(raw).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def headings(path: Path) -> set[str]:
    return {heading_text(raw).lower() for raw in HEADING.findall(FENCE.sub("", path.read_text()))}


def broken_links(path: Path, repo: Path = REPO) -> list[str]:
    """Every relative link of ``path`` that reaches no file of ``repo``, or no heading of it."""
    problems = []
    for target in LINK.findall(prose(path.read_text())):
        if SCHEME.match(target):
            continue  # a web address: not ours to check offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(repo)}: ({target})"
        if not dest.is_relative_to(repo.resolve()) or not dest.is_file():
            problems.append(f"{where} is not a file of the repository")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where} has an anchor into a file that is not markdown")
        elif anchor and anchor not in anchors(dest):
            problems.append(f"{where}: {dest.name} has no heading #{anchor} (it has {sorted(anchors(dest))})")
    return problems


def citations(root: Path = REPO) -> list[tuple[str, str, str]]:
    """``(citing file, cited document, section)`` for every section cited by name outside the docs themselves."""
    found = []
    for name in CITING:
        base = root / name
        for path in ([base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())):
            if path.suffix in (".pyc", ".pt", ".json", ".safetensors") or path == Path(__file__).resolve():
                continue
            # One line of prose, whatever the comment syntax: a citation may wrap onto a continued comment line.
            text = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text(errors="replace"))
            found += [(str(path.relative_to(root)), doc, section) for doc, section in CITATION.findall(text)]
    return found


def test_the_readme_stays_short():
    size = README.stat().st_size
    assert size < README_LIMIT, (f"README.md is {size} bytes, over {README_LIMIT}: move the detail into a guide under "
                                 "docs/ and link it")


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading(path):
    assert not broken_links(path), "\n".join(broken_links(path))


def test_every_guide_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(prose(README.read_text()))
              if not SCHEME.match(t)}
    unlinked = [p.name for p in doc_files()[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs/ guides the README does not link: {unlinked}"


def test_every_cited_section_exists():
    found = citations()
    assert found, "no citations found: the pattern no longer matches how files cite the docs"
    missing = [f"{src} cites {doc} {section!r}, which has no such heading" for src, doc, section in found
               if not (REPO / markdown(doc)).is_file() or section.lower() not in headings(REPO / markdown(doc))]
    assert not missing, "\n".join(missing)


def test_the_checker_finds_a_broken_link_a_bad_anchor_and_a_missing_cited_section(tmp_path):
    """The readers this file relies on: links inside code are ignored, wrapped link text is read, web addresses are
    skipped, and a missing file, a missing heading, or a link leaving the repository is reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Across hosts\n\n```\n## Not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text("[guide](docs/guide.md#across-hosts) [wrapped\ntext](docs/guide.md) [web](https://example.com)\n"
                    "`[code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n")
    assert broken_links(page, tmp_path) == []
    page.write_text("[a](docs/gone.md) [b](docs/guide.md#not-a-heading) [c](../outside.md) [d](#guide)\n")
    problems = broken_links(page, tmp_path)
    assert len(problems) == 4, problems
    assert "docs/gone.md) is not a file" in problems[0] and "no heading #not-a-heading" in problems[1]
    assert "../outside.md) is not a file of the repository" in problems[2] and "no heading #guide" in problems[3]

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "a.yaml").write_text('# see docs/guide.md "Across\n# hosts" and README, "Layout"\n')
    assert citations(tmp_path) == [("conf/a.yaml", "docs/guide.md", "Across hosts"),
                                   ("conf/a.yaml", "README", "Layout")]
    assert "across hosts" in headings(tmp_path / "docs" / "guide.md")
    assert "not a heading" not in headings(tmp_path / "docs" / "guide.md")


# Targets that are other targets' tests together (test-full: test and test-slow) or a part of one (test-rehearsal,
# in test-slow): CI runs what they run through those.
PART_OR_UNION = {"test-full", "test-rehearsal"}


def test_ci_runs_every_test_target_and_the_testing_guide_lists_each():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^(test(?:-[\w-]+)?):", makefile, re.M)) - PART_OR_UNION
    steps = re.findall(r"^step (\S+)$", (REPO / ".ci" / "run").read_text(), re.M)
    assert sorted(steps) == sorted(targets), "each test target is a step of .ci/run (or a part of another)"
    assert len(steps) == len(set(steps))
    table = (REPO / "docs" / "testing.md").read_text()
    missing = [t for t in targets | PART_OR_UNION if f"| `make {t}` |" not in table]
    assert not missing, f"docs/testing.md's table lacks {missing}"


def section(path: Path, title: str) -> str:
    """The text under the heading ``title`` in ``path``, up to the next heading of any level."""
    text = path.read_text()
    start = re.search(rf"^#+\s+{re.escape(title)}\s*$", text, re.M)
    assert start, f"{path.name} has no heading {title!r}"
    following = HEADING.search(text, start.end())
    return text[start.end():following.start() if following else len(text)]


def test_the_steps_to_add_a_backend_name_what_exists():
    """docs/design.md's "How to add a backend": every file and folder it names exists (``<name>`` standing for an
    existing backend), every name it gives is defined in the module it names, and the methods of ``Backend`` it lists
    are the protocol's."""
    import inspect

    from pipeline.backends import base, ranks, registry
    from pipeline.config import Backend
    from pipeline.core import build_records
    from pipeline.host import preflight

    steps = section(REPO / "docs" / "design.md", "How to add a backend")
    for cited in re.findall(r"`((?:pipeline|conf)/[^`]+)`", steps):
        for name in ("cpu", "neuron"):
            assert (REPO / cited.replace("<name>", name)).exists(), cited
    defined = {"Backend": (base, Backend), "COMMON_BUILD_CODE": (registry,), "BACKENDS": (registry,),
               "BackendEntry": (registry,), "NeuronEntry": (registry,), "XlaEntry": (registry,),
               "Factors": (preflight,), "TraceResult": (build_records,), "ProcessRunner": (ranks,)}
    for name in re.findall(r"`([A-Z][A-Za-z_]+)`", steps):
        assert name in defined, f"design.md names {name}: say where it is defined in this test"
    for name, where in defined.items():
        assert name in steps and all(hasattr(m, name) for m in where if inspect.ismodule(m)), name
    listed = set(re.search(r"\(`members`[^)]*\)", steps).group(0).replace("`", "").strip("()").split(", "))
    protocol = {n for n, v in vars(base.Backend).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert listed == protocol


PIP_INSTALL = re.compile(r"pip install[^`\n]*")


def test_every_install_of_the_neuron_packages_in_the_docs_is_the_hash_pinned_one():
    """An install line that resolves the [neuron] extra (or a Neuron package) lets a public index's higher upload
    win (docs/inf2-host.md): the docs give deploy/install-inf2.sh, and name the resolving install only to warn
    against it."""
    found = []
    for path in doc_files():
        for paragraph in path.read_text().split("\n\n"):
            for match in PIP_INSTALL.finditer(paragraph):
                line = match.group()
                warned = "Do not install with" in paragraph[:match.start()].rsplit(".", 1)[-1]
                if "neuron" in line.lower() and "--require-hashes" not in line and not warned:
                    found.append(f"{path.relative_to(REPO)}: {line}")
    assert not found, "\n".join(found)
