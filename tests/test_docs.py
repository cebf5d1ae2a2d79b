"""The docs: `docs/cli.md` is what the typer app generates, the table of events in `docs/runs.md` is what
`mlx_subagents/events.py` says, and the README stays short with links that resolve.

Both generated parts are made by one command, written at the top of each:

    python tests/test_docs.py

which runs typer's own `utils docs` on the app (`mlx_subagents/cli/__init__.py`) with the terminal pinned
and puts a comment saying so on top, and writes the events table from the payload classes (each kind of
`EventKind`, its class's keys and docstring) between its two markers. The tests below make the same
text and compare.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, get_args

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_PAGE = DOCS / "cli.md"
REGENERATE = "python tests/test_docs.py"
EVENTS_PAGE = DOCS / "runs.md"
EVENTS_BEGIN = "<!-- events table -->"
EVENTS_END = "<!-- end of the events table -->"
EVENTS_HEADER = (
    "<!-- Generated from the payload classes in mlx_subagents/events.py: do not edit by hand.\n"
    f"     Regenerate with `{REGENERATE}`; `python -m pytest tests/test_docs.py` checks it. -->\n"
)
MAX_README_LINES = 300
CI_TEST_LINE = 'pip install -e ".[test]" && python -m pytest  # ci-test'

# rich, which typer renders help with, reads the terminal's width and colour settings: pinned, so that the
# page comes out the same on every machine.
PINNED_ENV = {"COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1", "PYTHONUTF8": "1"}
UNPINNED = ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
TYPER_DOCS = ("-m", "typer", "mlx_subagents.cli", "utils", "docs", "--name", "subagent")
HEADER = (
    "<!-- Generated from the typer app in mlx_subagents/cli/__init__.py: do not edit by hand.\n"
    f"     Regenerate with `{REGENERATE}`, which runs\n"
    f"     `{' '.join(f'{k}={v}' for k, v in PINNED_ENV.items())} python {' '.join(TYPER_DOCS)} --output FILE`\n"
    "     and puts this comment on top; `python -m pytest tests/test_docs.py` checks that the page is current. -->\n"
    "\n"
)


def generate_cli_page() -> str:
    """`docs/cli.md` as the app makes it now: this header, then typer's Markdown for the app."""
    env = {k: v for k, v in os.environ.items() if k not in UNPINNED}
    env.update(PINNED_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cli.md"
        done = subprocess.run(
            [sys.executable, *TYPER_DOCS, "--output", str(out)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"typer utils docs failed ({done.returncode}): {done.stderr.strip()}")
        return HEADER + out.read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.process
def test_cli_page_is_current() -> None:
    expected = generate_cli_page().encode("utf-8")
    actual = CLI_PAGE.read_bytes() if CLI_PAGE.is_file() else b""
    if actual != expected:
        have, want = actual.decode("utf-8", "replace").splitlines(), expected.decode("utf-8").splitlines()
        n = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), None)
        if n is not None:
            where = f"line {n + 1} is {have[n]!r}, expected {want[n]!r}"
        elif len(have) != len(want):
            where = f"it has {len(have)} lines, expected {len(want)}"
        else:
            where = "it differs in line endings or the final newline"
        pytest.fail(
            f"docs/cli.md is not what the typer app generates ({where}); regenerate it with `{REGENERATE}`",
            pytrace=False,
        )


def events_table() -> str:
    """The table of events as `mlx_subagents/events.py` says it: a row per kind of `EventKind`, in order,
    with its payload class's keys (`?` after a key that is not always there) and docstring."""
    from mlx_subagents.events import PAYLOADS, EventKind  # imported here: `__main__` first puts ROOT on the path

    rows = ["| kind | `data` | what happened |", "|---|---|---|"]
    for kind in get_args(EventKind):
        shape = PAYLOADS[kind]
        keys = [f"`{key}`{'?' if key in shape.__optional_keys__ else ''}" for key in shape.__annotations__]
        rows.append(f"| `{kind}` | {', '.join(keys) or 'none'} | {' '.join((shape.__doc__ or '').split())} |")
    return EVENTS_HEADER + "\n".join(rows) + "\n"


def events_page(page: str) -> str:
    """`docs/runs.md` with the text between the events table's markers made anew."""
    head, begin, rest = page.partition(EVENTS_BEGIN + "\n")
    _, end, tail = rest.partition(EVENTS_END)
    assert begin and end, f"docs/runs.md has lost the markers of its events table: {EVENTS_BEGIN}, {EVENTS_END}"
    return head + begin + events_table() + end + tail


def test_events_table_is_current() -> None:
    page = EVENTS_PAGE.read_text(encoding="utf-8")
    if events_page(page) != page:
        pytest.fail(
            f"the events table in docs/runs.md is not what mlx_subagents/events.py says; regenerate it with "
            f"`{REGENERATE}`",
            pytrace=False,
        )


def test_events_table_lists_every_kind_with_its_keys() -> None:
    from mlx_subagents.events import PAYLOADS, EventKind

    page = EVENTS_PAGE.read_text(encoding="utf-8")
    table = page.partition(EVENTS_BEGIN)[2].partition(EVENTS_END)[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    assert [row[0] for row in rows] == [f"| `{kind}`" for kind in get_args(EventKind)]
    for row, kind in zip(rows, get_args(EventKind)):
        shape = PAYLOADS[kind]
        marked = {f"`{key}`" for key in shape.__required_keys__} | {f"`{key}`?" for key in shape.__optional_keys__}
        assert set(row[1].split(", ")) == (marked or {"none"}), kind
    by_kind = {row[0]: row for row in rows}
    assert by_kind["| `task_end`"][1] == "`status`, `stop_reason`, `error`, `usage`?, `duration_s`?"
    assert by_kind["| `turn_start`"][1] == "none"


# Lists in the docs that say they are complete, made from the code: the text between
# `<!-- generated: NAME -->` and `<!-- end: NAME -->` is `GENERATED[NAME]()`, written by `python tests/test_docs.py`.
GENERATED_SPAN = re.compile(r"<!-- generated: (?P<name>[^>]+?) -->(?P<body>.*?)<!-- end: (?P=name) -->", re.S)


def _names(names: Any) -> str:
    return ", ".join(f"`{name}`" for name in names)


def _fields(cls: Any, skip: tuple[str, ...] = ()) -> str:
    from dataclasses import fields

    return _names(f.name for f in fields(cls) if f.name not in skip)


def _command_options(command: str) -> str:
    """A command's options as the typer app declares them (`--help` aside)."""
    from typer.main import get_command

    from mlx_subagents.cli import app

    params = get_command(app).commands[command].params  # type: ignore[attr-defined]
    return _names(p.opts[0] for p in params if p.param_type_name == "option" and p.opts[0] != "--help")


def generated_spans() -> dict[str, tuple[Path, Any]]:
    """Each generated list: its page and what makes its text."""
    from mlx_subagents.agents import claude
    from mlx_subagents.cli.config import KEYS
    from mlx_subagents.host.protocol import GenerateArgs
    from mlx_subagents.results import StopReason
    from mlx_subagents.runs.options import RunOptions
    from mlx_subagents.runs.tasks import TaskSpec

    return {
        "RunOptions fields": (DOCS / "python.md", lambda: _fields(RunOptions)),
        "TaskSpec fields": (DOCS / "python.md", lambda: _fields(TaskSpec, ("agent", "task"))),
        "GenerateArgs fields": (DOCS / "python.md", lambda: _fields(GenerateArgs)),
        "mcp options": (DOCS / "mcp.md", lambda: _command_options("mcp")),
        "claude honoured": (DOCS / "agents.md", lambda: _names(claude.CLAUDE_HONOURED)),
        "claude unsupported": (DOCS / "agents.md", lambda: _names(claude.CLAUDE_UNSUPPORTED)),
        "claude aliases": (DOCS / "agents.md", lambda: _names(claude.CLAUDE_MODEL_ALIASES)),
        "stop reasons": (DOCS / "runs.md", lambda: _names(get_args(StopReason))),
        "config keys": (DOCS / "runs.md", lambda: _names(KEYS)),
    }


def generated_page(page: Path) -> str:
    """`page` with the text of each of its generated lists made anew."""
    makers = {name: make for name, (where, make) in generated_spans().items() if where == page}
    text = page.read_text(encoding="utf-8")

    def fill(match: re.Match[str]) -> str:
        name = match.group("name")
        assert name in makers, f"{page.relative_to(ROOT)} has a generated list no one makes: {name}"
        return f"<!-- generated: {name} -->{makers[name]()}<!-- end: {name} -->"

    return GENERATED_SPAN.sub(fill, text)


def test_the_lists_the_docs_call_complete_are_what_the_code_says() -> None:
    """Every generated list is on its page and current: the `RunOptions` and `TaskSpec` fields, the mcp
    command's options, Claude Code's fields, the stop reasons (each list had drifted once)."""
    spans = generated_spans()
    for name, (page, _make) in spans.items():
        assert f"<!-- generated: {name} -->" in page.read_text(encoding="utf-8"), f"{page.name} lost its list: {name}"
    for page in sorted({page for page, _ in spans.values()}):
        if generated_page(page) != page.read_text(encoding="utf-8"):
            pytest.fail(
                f"a generated list in {page.relative_to(ROOT)} is not what the code says; regenerate with `{REGENERATE}`",
                pytrace=False,
            )


def test_the_python_page_imports_what_the_package_exports() -> None:
    import mlx_subagents

    page = (DOCS / "python.md").read_text(encoding="utf-8")
    block = page[page.index("from mlx_subagents import (") : page.index(")", page.index("from mlx_subagents import ("))]
    listed = re.findall(r"^\s+(\w+),$", block, re.M)
    assert listed == sorted(n for n in mlx_subagents.__all__ if n != "__version__")


def test_every_benchmark_script_is_listed() -> None:
    """The table of docs/benchmarks.md and the package tree of docs/architecture.md name every script of
    `benchmarks/` (`fork.py` was missing from both)."""
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text(encoding="utf-8"))
    table = re.findall(r"^\| `(\w+\.py)` \|", (DOCS / "benchmarks.md").read_text(encoding="utf-8"), re.M)
    assert sorted(table) == scripts
    tree = (DOCS / "architecture.md").read_text(encoding="utf-8")
    line = tree[tree.index("\nbenchmarks/ ") : tree.index("\ntests/ ")]
    assert [s for s in scripts if s not in line] == []


def test_the_docs_say_what_ci_runs() -> None:
    """docs/architecture.md names each check `.ci/run` makes and each package it installs; the README says
    the test extra brings the linters."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    checks = ["ruff format --check", "ruff check", "lint-imports"]
    assert all(check in ci for check in checks)
    packages = re.findall(r'missing="\$missing ([\w.-]+)"', ci)
    assert packages, "the packages .ci/run installs"
    for name in checks + " ".join(packages).split():
        assert f"`{name}`" in page, f"docs/architecture.md does not say that .ci/run uses {name}"
    assert "import-linter" in README.read_text(encoding="utf-8")


def test_readme_is_short() -> None:
    n_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert n_lines <= MAX_README_LINES, (
        f"README.md has {n_lines} lines; keep it to {MAX_README_LINES}, move the rest to docs/"
    )


def test_readme_keeps_the_ci_test_line() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert CI_TEST_LINE in lines, f"README.md must keep the line CI runs, exactly: {CI_TEST_LINE}"


def test_readme_links_to_docs_pages_that_exist() -> None:
    links = [link for link in _links(README) if link.startswith("docs/")]
    assert links, "README.md links to no docs/ page"
    for link in links:
        _check_link(README, link)


def test_docs_links_resolve() -> None:
    pages = sorted(DOCS.glob("*.md"))
    assert CLI_PAGE in pages
    for page in pages:
        for link in _links(page):
            _check_link(page, link)


# Markdown links `[text](target)`, outside code spans and fenced blocks.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _links(page: Path) -> list[str]:
    links, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            links += [m.group(1) for m in _LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link)]  # no URLs


def _check_link(page: Path, link: str) -> None:
    """A relative link resolves to a file; an anchor (`page.md#heading`) to one of its headings."""
    target, _, anchor = link.partition("#")
    path = (page.parent / target).resolve() if target else page
    where = f"{page.relative_to(ROOT)} links to {link}"
    assert path.exists(), f"{where}, which does not exist"
    if anchor and path.suffix == ".md":
        assert anchor in _anchors(path), f"{where}, but {path.relative_to(ROOT)} has no heading with that anchor"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lowercase, punctuation dropped, spaces as hyphens."""
    anchors, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's package, whatever is installed
    CLI_PAGE.parent.mkdir(exist_ok=True)
    CLI_PAGE.write_bytes(generate_cli_page().encode("utf-8"))
    print(f"wrote {CLI_PAGE.relative_to(ROOT)}")
    EVENTS_PAGE.write_text(events_page(EVENTS_PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the events table in {EVENTS_PAGE.relative_to(ROOT)}")
    for page in sorted({page for page, _ in generated_spans().values()}):
        page.write_text(generated_page(page), encoding="utf-8")
        print(f"wrote the generated lists in {page.relative_to(ROOT)}")


def test_the_architecture_page_names_every_module() -> None:
    """The package tree of docs/architecture.md names every module (and each AGENTS.md note names only
    test files that exist), so that a new module cannot go unlisted."""
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    tree = page[page.index("```\nmlx_subagents/") : page.index("## One task, one object")]
    package = ROOT / "mlx_subagents"
    modules = [p for p in package.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    missing = [str(p.relative_to(package)) for p in modules if p.name not in tree and p.stem not in tree]
    assert missing == []
    for note in package.rglob("AGENTS.md"):
        named = re.findall(r"`(tests/[\w/]+\.py)", note.read_text(encoding="utf-8"))
        assert named and all((ROOT / path).is_file() for path in named), note


def _code_blocks(page: Path, language: str) -> list[str]:
    """The fenced code blocks of `page` in `language`."""
    text = page.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


@pytest.mark.slow
def test_the_python_page_uses_the_host_as_it_is_called(
    tiny_qwen3_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The page's `MlxModelHost` example runs (on the tiny model): it once called `generate(messages,
    tools=None, max_tokens=512)`, which raises TypeError, with `GenerateArgs` not exported."""
    example = next(b for b in _code_blocks(DOCS / "python.md", "python") if "MlxModelHost(" in b and "generate" in b)
    code = example.replace('"mlx-community/Qwen3-4B-Instruct-2507-4bit"', repr(str(tiny_qwen3_path)))
    assert code != example
    exec(compile(code, "docs/python.md", "exec"), {"__name__": "docs_example"})
    usage = capsys.readouterr().out.splitlines()[-1]  # the reply's text, its calls, why it ended; then the usage
    prompt, cached, prefilled, generated = (int(n) for n in usage.split())
    assert prompt == cached + prefilled and prompt > 0 and 0 < generated <= 512


def test_the_example_agent_file_loads_as_written(tmp_path: Path) -> None:
    """docs/agents.md's example, copied into a project, is an agent with no warning (it set both `thinking:`
    and `effort:`, an error: the file was skipped)."""
    from mlx_subagents.agents.discovery import discover_agents

    [example] = _code_blocks(DOCS / "agents.md", "markdown")
    folder = tmp_path / ".mlx-subagents" / "agents"
    folder.mkdir(parents=True)
    (folder / "example.md").write_text(example.replace("name: scout", "name: example"), encoding="utf-8")
    catalog = discover_agents(tmp_path)
    assert catalog.all_warnings() == [] and catalog.agents["example"].thinking == 2048


def test_every_mcp_client_config_passes_the_home_with_absolute_paths() -> None:
    """A client starts `subagent mcp` with the SDK's reduced environment (what the page says it is), so
    every config example passes `MLX_SUBAGENTS_HOME` through its `env` and names `subagent` in full."""
    from mcp.client.stdio import DEFAULT_INHERITED_ENV_VARS

    page = DOCS / "mcp.md"
    text = page.read_text(encoding="utf-8")
    assert "MLX_SUBAGENTS_HOME" not in DEFAULT_INHERITED_ENV_VARS
    assert ", ".join(f"`{v}`" for v in sorted(DEFAULT_INHERITED_ENV_VARS)[:-1]) in text
    configs = [b for b in _code_blocks(page, "json") if '"command"' in b]
    configs += [b for b in _code_blocks(page, "toml") if "command =" in b]
    configs += [b for b in _code_blocks(page, "python") if "StdioServerParameters(" in b]
    configs += [b for b in _code_blocks(page, "bash") if "claude mcp add" in b]
    assert len(configs) == 4  # Cursor, Codex, the SDK, Claude Code
    for config in configs:
        assert "MLX_SUBAGENTS_HOME" in config, config
        commands = re.findall(r"""(?:command"?\s*[:=]\s*"|-- )([^"\s]+)""", config)
        assert commands and all(c.startswith("/") for c in commands), config


def test_every_claude_mcp_add_names_subagent_by_its_absolute_path() -> None:
    """A client starts `subagent mcp` outside the virtual environment, where a bare `subagent` is not on
    PATH: the README, the docs and the command's own help (docs/cli.md) name it in full."""
    pages = [README, *sorted(DOCS.glob("*.md"))]
    commands = [
        (page.name, m.group(1))
        for page in pages
        for m in re.finditer(r"claude mcp add[^\n]*?(?:\\\n[^\n]*?)*-- (\S+)", page.read_text(encoding="utf-8"))
    ]
    assert {name for name, _ in commands} >= {"README.md", "cli.md", "mcp.md"}
    for name, command in commands:
        assert command.startswith(('"$(command', "&quot;$(command", "/")), f"{name}: {command}"


def shell_commands(text: str) -> list[str]:
    """The `subagent ...` commands of a page's shell blocks (lines joined at `\\`, comments off, one per
    part of `&&`, `;` or `|`), but those built by the shell (`$(...)`) or with placeholders (`<...>`, `...`)."""
    found = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].split(" # ")[0].strip()
            for part in (p.strip() for p in re.split(r"&&|;|\|", line)):
                if part.startswith("subagent ") and not any(s in part for s in ("$(", "<", "...")):
                    found.append(part)
    return found


def test_every_command_in_the_docs_is_one_the_cli_takes() -> None:
    """Each `subagent` command the README and docs show parses as written: its command, options and
    arguments exist (a folder in an example, `~/src/app`, need not)."""
    import shlex

    import typer

    from mlx_subagents.cli import app

    command = typer.main.get_command(app)
    pages = [ROOT / "README.md", *(p for p in sorted(DOCS.glob("*.md")) if p != CLI_PAGE)]
    commands = [(page, line) for page in pages for line in shell_commands(page.read_text(encoding="utf-8"))]
    wrong = []
    for page, line in commands:
        try:
            context = command.make_context("subagent", shlex.split(line)[1:])
            while context._protected_args:  # a command group: its subcommand parses in turn
                name, *rest = [*context._protected_args, *context.args]
                context = context.command.get_command(context, name).make_context(name, rest, parent=context)
        except Exception as exc:  # click's errors (typer vendors its own copy of click)
            if not (type(exc).__name__ == "BadParameter" and "does not exist" in str(exc)):
                wrong.append(f"{page.relative_to(ROOT)}: {line}: {type(exc).__name__}: {exc}")
    assert len(commands) >= 50 and wrong == []


# The words of the commands the docs show that need no model, no network and no terminal: each such
# command runs as written, in a fresh state folder and an empty folder, and exits 0.
NEEDS_NO_MODEL = {"agents", "workflows", "models", "runs", "cache", "clear", "--json", "--version", "--help"}


def test_every_command_in_the_docs_that_needs_no_model_runs(
    run_cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`subagent agents`, `models`, `runs`, `cache`... as a newcomer types them from the README and the
    docs, before any model is on the machine: each exits 0 with no traceback (`models import` fetches and
    `doctor` downloads the default model: not these)."""
    import shlex

    pages = [ROOT / "README.md", *(p for p in sorted(DOCS.glob("*.md")) if p != CLI_PAGE)]
    commands = {
        line
        for page in pages
        for line in shell_commands(page.read_text(encoding="utf-8"))
        if set(shlex.split(line)[1:]) <= NEEDS_NO_MODEL
    }
    heads = {shlex.split(line)[1] for line in commands}
    assert heads >= {"agents", "workflows", "models", "runs", "cache"}, heads
    monkeypatch.chdir(tmp_path)
    failed = []
    for line in sorted(commands):
        code, out, err = run_cli(*shlex.split(line)[1:])
        if code != 0 or "Traceback" in out + err:
            failed.append(f"{line}: exit {code}: {err.strip()[-300:]}")
    assert failed == []
