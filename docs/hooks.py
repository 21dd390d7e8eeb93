"""mkdocs hooks: the generated reference pages, and checks that the docs say what the code does.

Registered in ``mkdocs.yml`` (``hooks: [docs/hooks.py]``), so ``mkdocs build --strict`` (run by
``scripts/check``) runs all of it:

- **Generated pages.** A page holding one of these markers gets it replaced, at build time:

  - ``<!-- fairlane:cli -->``: every ``fairlane`` subcommand's ``--help``, from the argument
    parsers themselves (``extproc.ops.cli.COMMANDS``, each module's ``add_arguments``);
  - ``<!-- fairlane:metrics -->``: every ``fairlane_*`` metric family the service exports, with
    its type, labels and help text, read from ``extproc/transport/prometheus.py``;
  - ``<!-- fairlane:alerts -->``: the alerts of ``deploy/prometheus/alerts.yml``, then their
    runbooks from ``deploy/prometheus/README.md``.

- **Checks** (a failure stops the build):

  - every ``fairlane SUBCOMMAND --flag`` written in a code span or block names a subcommand
    and a flag its parser has; ``fairlane bench NAME`` a scenario that exists; every
    ``python -m MODULE`` a module that exists, with the flags its parser is given (read from its
    source, no process started); every repository path (``extproc/...``,
    ``deploy/...``) a file or folder that exists. README.md, CONTRIBUTING.md and the load
    tests' READMEs are checked the same way;
  - the policy reference names every field the policy parser accepts, and the deployment
    file reference every field of the deployment file.

- **Figures.** The PNGs of ``loadtests/bench/figures/`` are served as
  ``benchmarks/figures/NAME.png``.

- **Optional pages.** ``benchmarks/peers.md`` and ``benchmarks/internals.md``, and any other
  page under ``docs/benchmarks/`` that ``mkdocs.yml`` does not list, join the end of the
  Benchmarks section of the nav when they exist.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # mkdocs runs from the root, but not always with it on the path
    sys.path.insert(0, str(REPO))

HELP_WIDTH = 100
OPTIONAL_BENCHMARK_PAGES = ("benchmarks/peers.md", "benchmarks/internals.md")
CHECKED_OUTSIDE_DOCS = (
    "README.md",
    "CONTRIBUTING.md",
    "loadtests/README.md",
    "loadtests/bench/README.md",
)


# --------------------------------------------------------------------------- the CLI


@cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    """``fairlane SUBCOMMAND`` -> its parser, built as ``fairlane`` builds it."""
    from extproc.ops.cli import COMMANDS, load

    def formatter(prog: str) -> argparse.HelpFormatter:
        return argparse.HelpFormatter(prog, width=HELP_WIDTH, max_help_position=30)

    built = {}
    for name, (_, help_text) in COMMANDS.items():
        parser = argparse.ArgumentParser(
            prog=f"fairlane {name}", description=help_text, formatter_class=formatter
        )
        try:
            load(name).add_arguments(parser)
        except SystemExit as e:  # a missing extra: load() said which on stderr
            raise PluginError(f"cannot build `fairlane {name}`'s parser (exit {e.code})") from e
        built[name] = parser
    return built


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def cli_reference() -> str:
    from extproc.ops.cli import COMMANDS

    out = []
    for name, parser in parsers().items():
        summary = COMMANDS[name][1]
        out.append(f"## fairlane {name}\n\n{summary[0].upper()}{summary[1:]}.\n")
        out.append(f"```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(out)


# --------------------------------------------------------------------------- metrics

FAMILY_TYPES = {
    "GaugeMetricFamily": "gauge",
    "CounterMetricFamily": "counter",
    "HistogramMetricFamily": "histogram",
    "_counter": "counter",
    "_histogram": "histogram",
    "gauge": "gauge",  # GatewayCollector._backends' helper: backend, region
}


def _labels(node: ast.expr | None, names: dict[str, list[str]]) -> list[str]:
    if node is None:
        return []
    if isinstance(node, ast.Name):
        return list(names[node.id])
    if isinstance(node, ast.List):
        labels: list[str] = []
        for item in node.elts:
            if isinstance(item, ast.Starred) and isinstance(item.value, ast.Name):
                labels += names[item.value.id]
            elif isinstance(item, ast.Constant) and isinstance(item.value, str):
                labels.append(item.value)
            else:
                raise PluginError(f"metrics: a label list the docs cannot read: {ast.dump(node)}")
        return labels
    raise PluginError(f"metrics: labels the docs cannot read: {ast.dump(node)}")


def metric_families() -> list[tuple[str, str, list[str], str]]:
    """(exposed name, type, labels, help) of every ``fairlane_*`` family the collector
    defines, in the order the source defines them."""
    source = REPO / "extproc" / "transport" / "prometheus.py"
    tree = ast.parse(source.read_text())
    names: dict[str, list[str]] = {}
    for statement in tree.body:  # module-level label lists (BACKEND_LABELS)
        if (
            isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
            and isinstance(statement.value, ast.List)
        ):
            with contextlib.suppress(PluginError):
                names[statement.targets[0].id] = _labels(statement.value, {})
    families = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        kind = FAMILY_TYPES.get(func.id if isinstance(func, ast.Name) else "")
        if kind is None or len(node.args) < 2:
            continue
        name, doc = node.args[0], node.args[1]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            continue  # the helpers' own bodies: GaugeMetricFamily(name, doc, ...)
        if not name.value.startswith("fairlane_"):
            continue
        if not (isinstance(doc, ast.Constant) and isinstance(doc.value, str)):
            raise PluginError(f"metrics: {name.value}'s help is not a literal string")
        keywords = {k.arg: k.value for k in node.keywords}
        assert isinstance(func, ast.Name)
        if func.id == "gauge":
            labels = list(names["BACKEND_LABELS"])
        elif func.id in ("_counter", "_histogram"):
            labels = _labels(node.args[2] if len(node.args) > 2 else None, names)
        else:
            labels = _labels(keywords.get("labels"), names)
        exposed = name.value.removesuffix("_total") + "_total" if kind == "counter" else name.value
        families.append((exposed, kind, labels, doc.value))
    if len(families) < 20:
        raise PluginError(f"metrics: only {len(families)} families found in {source}")
    return families


def metrics_reference() -> str:
    rows = ["| metric | type | labels | what it tells |", "|---|---|---|---|"]
    for name, kind, labels, doc in metric_families():
        shown = ", ".join(f"`{label}`" for label in labels) or "-"
        rows.append(f"| `{name}` | {kind} | {shown} | {doc.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------- alerts

PROMETHEUS = REPO / "deploy" / "prometheus"


def _severity(text: str) -> str:
    m = re.fullmatch(
        r'\{\{\s*if eq \$labels\.(\w+) "([^"]+)"\s*\}\}'
        r"(\w+)\{\{\s*else\s*\}\}(\w+)\{\{\s*end\s*\}\}",
        text.strip(),
    )
    return f"{m[3]} for {m[1]} {m[2]}, else {m[4]}" if m else text


def _untemplate(text: str) -> str:
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", r"<\1>", text)
    text = re.sub(r"\{\{\s*\$value[^}]*\}\}", "a share", text)
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _repo_links_as_code(markdown: str, base: Path) -> str:
    """Links to repository files become code spans naming the path; anchors stay links."""

    def replace(m: re.Match[str]) -> str:
        text, target = m[1], m[2]
        if target.startswith(("#", "http://", "https://")):
            return m[0]
        path = (base / target.split("#")[0]).resolve().relative_to(REPO)
        if "/" in text or text.strip("`").endswith((".md", ".yml", ".yaml", ".json")):
            return f"`{path}`"  # the link's text was a path: name the path from the root
        return f"{text} (`{path}`)"

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", replace, markdown)


def alerts_reference() -> str:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = [r for group in rules["groups"] for r in group["rules"] if "alert" in r]
    runbook = (PROMETHEUS / "README.md").read_text()
    sections = re.split(r"(?m)^### ", runbook.split("\n## Alerts\n", 1)[1])
    by_name = {s.split("\n", 1)[0].strip(): s for s in sections[1:]}
    rows = ["| alert | severity | for | fires when |", "|---|---|---|---|"]
    for alert in alerts:
        name = alert["alert"]
        if name not in by_name:
            raise PluginError(f"alert {name} has no runbook section in {PROMETHEUS / 'README.md'}")
        rows.append(
            f"| [{name}](#{name.lower()}) | {_severity(alert['labels']['severity'])} "
            f"| {alert.get('for', '-')} | {_untemplate(alert['annotations']['summary'])} |"
        )
    books = "\n".join(f"### {by_name[a['alert']].rstrip()}\n" for a in alerts)
    return "\n".join(rows) + "\n\n## Runbooks\n\n" + _repo_links_as_code(books, PROMETHEUS)


# --------------------------------------------------------------------------- checks

FENCE = re.compile(r"(?ms)^([ \t]*)(```|~~~)([^\n]*)\n(.*?)^\1\2[ \t]*$")
SHELL = {"", "bash", "sh", "shell", "console"}  # fenced blocks that hold commands, not output
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FAIRLANE = re.compile(  # a command: at the start of a line or span, or after && ; | ( $
    r"(?:^|&&|;|\||\(|\$)\s*(?:[\w.~-]*/)*fairlane\s+([a-z][a-z-]*)((?:\s+[^\s|;&#]+)*)"
)
PYTHON_M = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)")
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:extproc|loadtests|tests|deploy|policies|scripts|envoy|docs)/[\w./*{}<>\[\]-]*)"
)
PLACEHOLDER = re.compile(r"[A-Z]|[*{}\[\]<>]|\.\.\.")


def code_snippets(markdown: str) -> Iterator[str]:
    """Every command-like piece of a page: fenced blocks' lines (continuations joined) and
    inline code spans outside them."""
    for block in FENCE.finditer(markdown):
        if block[3].strip() in SHELL:
            yield from block[4].replace("\\\n", " ").splitlines()
    for span in INLINE.finditer(FENCE.sub("", markdown)):
        yield span[1]


def check_commands(markdown: str, where: str) -> list[str]:
    errors = []
    commands = parsers()
    for snippet in code_snippets(markdown):
        snippet = snippet.replace("\\|", "/")
        for m in FAIRLANE.finditer(snippet):
            sub, rest = m[1], m[2]
            if sub not in commands:
                errors.append(f"{where}: `fairlane {sub}` is no subcommand ({snippet!r})")
                continue
            known = option_strings(commands[sub])
            for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", rest):
                if flag not in known:
                    errors.append(f"{where}: `fairlane {sub}` has no {flag} ({snippet!r})")
            if sub == "bench":
                words = [w for w in rest.split() if not w.startswith("-")]
                name = words[0] if words else ""
                named = name and "/" not in name and not name.endswith((".yaml", ".yml"))
                scenario = REPO / "loadtests" / "scenarios" / f"{name}.yaml"
                if named and not PLACEHOLDER.search(name) and not scenario.exists():
                    errors.append(f"{where}: no scenario {name!r} ({snippet!r})")
        for m in PYTHON_M.finditer(snippet):
            module = m[1]
            if not module.startswith(("extproc", "loadtests")):
                continue
            if module_missing(module):
                errors.append(f"{where}: no module {module} ({snippet!r})")
                continue
            rest = re.split(r"\s(?:\||;|&&|#)\s|\s+python3?\s+-m\s", snippet[m.end() :])[0]
            known = module_flags(module)
            for flag in re.findall(r"(?<![\w-])(--[a-zA-Z][\w-]*)", rest):
                if flag not in known:
                    errors.append(f"{where}: `python -m {module}` has no {flag} ({snippet!r})")
    return errors


@cache
def module_flags(module: str) -> set[str]:
    """The option strings a ``python -m`` module's argument parser is given, read from its
    source (its ``__main__`` and ``__init__`` for a package): no process is started."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    origin = Path(spec.origin)
    files = [origin]
    if origin.name == "__init__.py":
        files.append(origin.with_name("__main__.py"))
    text = "".join(f.read_text() for f in files if f.exists())
    return set(re.findall(r"[\"'](--[a-zA-Z][\w-]*)[\"']", text)) | {"--help"}


@cache
def module_missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def check_paths(markdown: str, where: str) -> list[str]:
    errors = []
    texts = list(code_snippets(markdown))
    texts += re.findall(r"\]\(([^)\s]+)\)", markdown)  # link targets: relative ones too
    for text in texts:
        for path in REPO_PATH.findall(text):
            path = path.rstrip(".,:;)")
            if PLACEHOLDER.search(path) or path.endswith("/..."):
                continue
            if not path.endswith("/") and "." not in path.rsplit("/", 1)[-1]:
                continue  # a bare name may be something else (kubectl's deploy/vllm)
            if not (REPO / path).exists():
                errors.append(f"{where}: {path} does not exist")
    return errors


def check_fields(markdown: str, where: str, fields: dict[str, tuple[str, ...]]) -> list[str]:
    """Every field of every section is written as `name` on the page."""
    spans = {span for span in INLINE.findall(markdown)}
    return [
        f"{where}: the {section} field `{field}` is not documented"
        for section, names in fields.items()
        for field in names
        if field not in spans
    ]


def policy_fields() -> dict[str, tuple[str, ...]]:
    from extproc.policy import parse

    return {
        name.strip("_").removesuffix("_KEYS").lower() or name: value
        for name, value in vars(parse).items()
        if name.startswith("_") and name.endswith("_KEYS") and isinstance(value, tuple)
    } | {"header test": parse._HEADER_OPS, "body test": parse._BODY_OPS}


def deployment_fields() -> dict[str, tuple[str, ...]]:
    from extproc.envoy import deployment, deployment_service

    fields = {
        name.strip("_").removesuffix("_KEYS").lower(): value
        for name, value in vars(deployment).items()
        if name.startswith("_") and name.endswith("_KEYS") and isinstance(value, tuple)
    }
    fields["service"] = deployment_service.SERVICE_KEYS
    fields["service replica"] = deployment_service._REPLICA_KEYS
    return fields


# --------------------------------------------------------------------------- mkdocs events

GENERATED = {
    "<!-- fairlane:cli -->": cli_reference,
    "<!-- fairlane:metrics -->": metrics_reference,
    "<!-- fairlane:alerts -->": alerts_reference,
}
FIELD_PAGES = {
    "reference/policy.md": policy_fields,
    "reference/deployment-file.md": deployment_fields,
}


def _nav_pages(nav: Any) -> Iterator[str]:
    if isinstance(nav, str):
        yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from _nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from _nav_pages(value)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Benchmark pages others add beside the listed ones join the end of the Benchmarks
    section: ``peers.md`` and ``internals.md`` first, then any other, by name."""
    docs = Path(config.docs_dir)
    listed = set(_nav_pages(config.nav))
    extra = sorted(
        (p.relative_to(docs).as_posix() for p in (docs / "benchmarks").glob("*.md")),
        key=lambda page: (page not in OPTIONAL_BENCHMARK_PAGES, page),
    )
    present = [page for page in extra if page not in listed]
    for section in config.nav or []:
        if isinstance(section, dict) and "Benchmarks" in section:
            section["Benchmarks"].extend(present)
    return config


FIGURES = REPO / "loadtests" / "bench" / "figures"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """The benchmark figures kept beside the bench (``loadtests/bench/figures``) are served as
    ``benchmarks/figures/NAME.png``, so the pages show them without a second copy."""
    for png in sorted(FIGURES.glob("*.png")):
        files.append(
            File.generated(config, f"benchmarks/figures/{png.name}", abs_src_path=str(png))
        )
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    where = f"docs/{page.file.src_uri}"
    for marker, render in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    errors = check_commands(markdown, where) + check_paths(markdown, where)
    if page.file.src_uri in FIELD_PAGES:
        errors += check_fields(markdown, where, FIELD_PAGES[page.file.src_uri]())
    if errors:
        raise PluginError("the docs disagree with the code:\n  " + "\n  ".join(errors))
    return markdown


def on_post_build(config: MkDocsConfig, **_: Any) -> None:
    errors = []
    for name in CHECKED_OUTSIDE_DOCS:
        path = REPO / name
        if path.exists():
            text = path.read_text()
            errors += check_commands(text, name) + check_paths(text, name)
    if errors:
        raise PluginError("the docs disagree with the code:\n  " + "\n  ".join(errors))
