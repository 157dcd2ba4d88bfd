"""The documentation holds: the API reference covers the public API, links resolve, the README is a front door.

* Every name of ``lit_slowcal.__all__`` has a section in docs/api.md whose signature block is the real
  signature, and every public member of it (a method, property or class attribute defined in one of
  our classes of its MRO, or an instance attribute one of them assigns) has a bullet there; a
  method's bullet gives its parameters as the code has them. The members are found by
  introspection and by reading the classes' source, never from a list kept here.
* Every relative link of README.md and docs/ (pages and images; ``#anchors`` with GitHub's heading
  slugs) resolves.
* README.md has at most 200 lines, and its library quick start runs as it stands: two gloo processes,
  one averaged model on both, with the synchronisations its numbers imply.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from helpers import subprocess_env

import lit_slowcal

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
README_MAX_LINES = 200


# -- the public API and the reference -----------------------------------------------------------


def _own_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO defined in this package (not torch's or Lightning's)."""
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "lit_slowcal"]


def _assigned_attributes(cls: type) -> set[str]:
    """Names a class's own code assigns as ``self.<name> = ...`` (its instance attributes)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def public_members(cls: type) -> dict[str, Any]:
    """Every public member our classes give ``cls``: name -> the object in the class (``None`` for an
    instance attribute)."""
    members: dict[str, Any] = {}
    for c in _own_classes(cls):
        for name, value in vars(c).items():
            if not name.startswith("_"):
                members.setdefault(name, value)
        for name in _assigned_attributes(c):
            if not name.startswith("_"):
                members.setdefault(name, None)
    return members


def _function(member: Any) -> Optional[Callable]:
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    return member if inspect.isfunction(member) else None


def _parameters(signature: inspect.Signature) -> str:
    """The parameters as written (``a, *, b, **kwargs``; ``self``/``cls`` left out), defaults aside."""
    out, star = [], False
    for p in signature.parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name)
    return "(" + ", ".join(out) + ")"


def _documented_signature(text: str) -> inspect.Signature:
    """The signature written as ``name(args)`` in the docs, parsed as Python."""
    args = text[text.index("(") + 1 : text.rindex(")")]
    node = ast.parse(f"def f({args}): pass").body[0]
    # Build a real function from it, so inspect reads the parameters as for the code's own.
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "<docs>", "exec"), namespace)  # noqa: S102 (our own docs)
    return inspect.signature(namespace["f"])


def api_sections(text: str) -> dict[str, str]:
    """docs/api.md's ``## `` sections: heading -> text."""
    sections: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            sections[name] = ""
        elif name is not None:
            sections[name] += line + "\n"
    return sections


_LEAD = re.compile(r"^- ((?:`[^`]+`(?: \([^)]*\))?(?:, | and )?)+)")


def defining_bullets(section: str) -> dict[str, list[str]]:
    """The bullets that define members: name -> the backticked items naming it at the bullet's start
    (``- `name` ...``, ``- `name(args) -> T` ...``, ``- `a`, `b`: ...``)."""
    found: dict[str, list[str]] = {}
    for line in section.splitlines():
        lead = _LEAD.match(line)
        if lead:
            for item in re.findall(r"`([^`]+)`", lead.group(1)):
                name = re.match(r"[A-Za-z_]\w*", item)
                if name:
                    found.setdefault(name.group(0), []).append(item)
    return found


def undocumented(api_text: str) -> list[str]:
    """What docs/api.md leaves out or gets wrong about ``lit_slowcal.__all__``, one line each."""
    problems = []
    sections = api_sections(api_text)
    for public in lit_slowcal.__all__:
        obj = getattr(lit_slowcal, public)
        if public not in sections:
            problems.append(f"{public}: no '## {public}' section")
            continue
        section = sections[public]
        block = re.search(r"```python\n(.*?)```", section, re.S)
        if block is None or not block.group(1).strip().startswith(f"{public}("):
            problems.append(f"{public}: the section does not open with its signature block")
        else:
            documented = _parameters(_documented_signature(" ".join(block.group(1).split())))
            actual = _parameters(inspect.signature(obj))
            if documented != actual:
                problems.append(f"{public}: signature {documented} in the docs, {actual} in the code")
            for p in inspect.signature(obj).parameters.values():
                if p.kind is p.VAR_KEYWORD:
                    p_name = f"**{p.name}"
                elif p.kind is p.VAR_POSITIONAL:
                    p_name = f"*{p.name}"
                else:
                    p_name = p.name
                if not re.search(rf"^- `{re.escape(p_name)}`", section, re.M):
                    problems.append(f"{public}: argument {p_name} has no bullet")
        if not inspect.isclass(obj):
            continue
        bullets = defining_bullets(section)
        for name, member in sorted(public_members(obj).items()):
            items = bullets.get(name)
            if not items:
                problems.append(f"{public}.{name}: not documented")
                continue
            function = _function(member)
            if function is None:
                continue
            calls = [item for item in items if item.startswith(f"{name}(")]
            if not calls:
                problems.append(f"{public}.{name}: documented without its signature ({name}(...))")
                continue
            documented = _parameters(_documented_signature(calls[0].split(" -> ")[0]))
            actual = _parameters(inspect.signature(function))
            if documented != actual:
                problems.append(f"{public}.{name}: parameters {documented} in the docs, {actual} in the code")
        for name, items in bullets.items():
            if any(item.startswith(f"{name}(") for item in items) and not hasattr(obj, name):
                problems.append(f"{public}.{name}: documented, but {public} has no such member")
    return problems


def test_every_public_name_and_member_is_in_the_api_reference() -> None:
    assert lit_slowcal.__all__, "lit_slowcal.__all__ is empty"
    problems = undocumented(API.read_text(encoding="utf-8"))
    assert not problems, "docs/api.md:\n" + "\n".join(problems)


def test_the_api_check_finds_an_undocumented_method_property_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails when a public method, property or attribute is added without its docs, or a
    documented method disappears or changes its parameters."""
    text = API.read_text(encoding="utf-8")
    assert undocumented(text) == []

    def reset_now(self: Any, hard: bool = False) -> None:
        pass

    monkeypatch.setattr(lit_slowcal.PeriodicAverager, "reset_now", reset_now, raising=False)
    monkeypatch.setattr(lit_slowcal.SimulatedMachines, "size_in_bytes", property(lambda self: 0), raising=False)
    monkeypatch.setattr(lit_slowcal.Scaffold, "option_three", True, raising=False)
    assert undocumented(text) == [
        "PeriodicAverager.reset_now: not documented",
        "Scaffold.option_three: not documented",
        "SimulatedMachines.size_in_bytes: not documented",
    ]
    # Documented without its parameter, then with it: the signature is compared too.
    with_it = text.replace("- `detach()`:", "- `reset_now()`: reset.\n- `detach()`:")
    assert "PeriodicAverager.reset_now: parameters () in the docs, (hard) in the code" in undocumented(with_it)
    # A documented method the class no longer has.
    monkeypatch.delattr(lit_slowcal.PeriodicAverager, "reset_now")
    stale = text.replace("- `detach()`:", "- `gone(x)`: removed.\n- `detach()`:")
    assert "PeriodicAverager.gone: documented, but PeriodicAverager has no such member" in undocumented(stale)
    # An argument without its bullet (the added members gone again).
    monkeypatch.undo()
    no_arg = text.replace("- `server_lr`: the server step size", "- the server step size")
    assert undocumented(no_arg) == ["Scaffold: argument server_lr has no bullet"]


def test_instance_attributes_are_read_from_the_classes_own_code() -> None:
    members = public_members(lit_slowcal.PeriodicAverager)
    for name in ("steps", "num_syncs", "last_sync_step", "optimizer", "global_params"):
        assert name in members and members[name] is None
    assert isinstance(members["in_round"], property)
    # Inherited from our mixin, not from Lightning: AveragerSet's members count, DDPStrategy's do not.
    strategy = public_members(lit_slowcal.PeriodicAveragingStrategy)
    assert {"close_rounds", "num_syncs", "averagers", "options"} <= set(strategy)
    assert "barrier" not in strategy and "root_device" not in strategy
    assert "zero_grad" not in public_members(lit_slowcal.SlowcalSGD)


# -- links ----------------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, only letters, marks, digits, ``_``, ``-`` and spaces
    kept, spaces turned into hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading).strip().lower()
    kept = "".join(
        ch for ch in text if ch in " -" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc"
    )
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match and not fenced:
            slug = github_slug(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(files: list[Path]) -> list[str]:
    """Every relative link of ``files`` whose file, folder or ``#anchor`` does not exist, one line each."""
    problems = []
    for path in files:
        for number, line in enumerate(_prose_lines(path.read_text(encoding="utf-8")), 1):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                file_part, _, anchor = target.partition("#")
                resolved = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(ROOT)}: link {target}"
                if not resolved.exists():
                    problems.append(f"{where}: no such file")
                elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
                    problems.append(f"{where}: no heading with anchor #{anchor} in {resolved.name}")
    return problems


def _doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_resolves() -> None:
    files = _doc_files()
    assert len(files) > 10
    assert broken_links(files) == []


def test_the_link_check_finds_a_broken_file_anchor_and_image(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Page A\n\n## Stacked trials (`--stack`)\n\n## What the theory talks about: G_*, x*\n")
    page = docs / "b.md"
    page.write_text(
        "[ok](a.md#stacked-trials---stack) [ok](a.md#what-the-theory-talks-about-g_-x) [self](#here)\n\n"
        "## Here\n\n"
        "[file](missing.md) [anchor](a.md#no-such-heading) ![image](gone.png) [web](https://example.org/x)\n"
        "```\n[in code](not/checked.md)\n```\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = broken_links([page])
    finally:
        ROOT = saved
    assert problems == [
        "docs/b.md: link missing.md: no such file",
        "docs/b.md: link a.md#no-such-heading: no heading with anchor #no-such-heading in a.md",
        "docs/b.md: link gone.png: no such file",
    ]


def test_github_slugs() -> None:
    assert github_slug("What the theory talks about: excess loss, G_*, slow query points") == (
        "what-the-theory-talks-about-excess-loss-g_-slow-query-points"
    )
    assert github_slug("Table 1, tuned: every method at its own rate in every cell") == (
        "table-1-tuned-every-method-at-its-own-rate-in-every-cell"
    )
    assert github_slug("The paper code's initialisation") == "the-paper-codes-initialisation"
    assert github_slug("Stacked trials (`--stack`)") == "stacked-trials---stack"
    assert github_slug("The optimum x*") == "the-optimum-x"


# -- the README --------------------------------------------------------------------------------


def test_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    text = "\n".join(lines)
    # .ci/run reads the test command between these markers.
    assert text.count("<!-- test-command -->") == 1 and text.count("<!-- /test-command -->") == 1
    for page in ("docs/index.md", "docs/library.md", "docs/api.md", "docs/performance.md"):
        assert f"]({page}" in text, f"README.md does not link {page}"


def readme_quickstart() -> str:
    text = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- quickstart -->\n```python\n(.*?)```\n<!-- /quickstart -->", text, re.S)
    assert block, "README.md: no ```python block between <!-- quickstart --> and <!-- /quickstart -->"
    return block.group(1)


_REPORT = """
# Added by tests/test_docs.py: what each process ends with.
import os as _os
torch.save(
    {"state": trainer.lightning_module.state_dict(), "num_syncs": trainer.strategy.num_syncs,
     "floats": trainer.strategy.floats_communicated, "world_size": trainer.world_size},
    _os.path.join(_os.environ["QUICKSTART_OUT"], f"rank{trainer.global_rank}.pt"),
)
"""


@pytest.mark.slow
def test_readme_quickstart_runs_as_it_stands(tmp_path: Path) -> None:
    """The README's code, unchanged, on two gloo processes (Lightning relaunches the script for rank 1):
    both end with the same averaged model, after the synchronisations its numbers imply."""
    code = readme_quickstart()
    assert "PeriodicAveragingStrategy(sync_every=16)" in code and "SlowcalSGD(" in code
    script = tmp_path / "quickstart.py"
    script.write_text(code + _REPORT)
    # A clean launch: rendezvous variables an earlier in-process run left behind (LOCAL_RANK, MASTER_PORT)
    # would make Lightning wait for a second process it never starts.
    env = subprocess_env(QUICKSTART_OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    # 512 samples over 2 processes, batches of 8: 32 steps each, synchronised after steps 16 and 32;
    # each sync sends x and SlowcalSGD's w of Linear(20, 2): 2 x (20 x 2 + 2) floats.
    for rank in ranks:
        assert rank["world_size"] == 2
        assert rank["num_syncs"] == 2
        assert rank["floats"] == 2 * 2 * (20 * 2 + 2)
    assert ranks[0]["state"].keys() == ranks[1]["state"].keys() == {"net.weight", "net.bias"}
    for key in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), key
