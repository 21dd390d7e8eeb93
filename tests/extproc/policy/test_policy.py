"""Policy files: the model, validation errors located at file:line, and hot reload."""

from __future__ import annotations

import logging
import os
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import extproc
from extproc.policy import (
    DEFAULT_POLICY_PATH,
    Budget,
    Policy,
    PolicyError,
    PolicyStore,
    load_policy,
    parse_policy,
)
from extproc.policy import parse as parse_module
from extproc.yamlfile import LocatedReader, represent

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted((REPO / "policies").glob("*.yaml"))

MINIMAL = """\
tiers:
  - name: fast
    aliases: [high]
    priority: 0
    queue_limit: 10
    queue_deadline_s: 5
  - name: slow
    priority: 20
    queue_limit: 100
    queue_deadline_s: 600
tenants:
  - name: alice
    api_keys: [sk-alice-0001]
    tiers: [fast]
"""


def errors_of(text: str, filename: str = "p.yaml") -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(textwrap.dedent(text), filename)
    return info.value.errors


# --------------------------------------------------------------------------- shipped files


def test_the_repository_ships_default_and_example() -> None:
    assert {p.name for p in SHIPPED} >= {"default.yaml", "example.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_policy_validates(path: Path) -> None:
    policy = load_policy(path)
    assert policy.source == str(path)
    assert len(policy.tiers) >= 3


def test_default_policy_has_the_demo_tenants_and_tiers() -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    assert [t.name for t in policy.tiers] == ["interactive", "api", "batch"]
    assert [t.rank for t in policy.tiers] == [0, 1, 2]
    assert policy.tier("interactive").priority < policy.tier("api").priority
    assert policy.tier("api").priority < policy.tier("batch").priority
    expected = {
        "sk-chat-demo": "chat-app",
        "sk-api-demo": "code-review",
        "sk-batch-demo": "nightly-batch",
    }
    for key, name in expected.items():
        tenant = policy.tenant_for_key(key)
        assert tenant is not None and tenant.name == name
    assert policy.tenant("chat-app").default_tier == "interactive"
    assert policy.tenant("nightly-batch").tiers == ("batch",)
    assert policy.lowest_tier.name == "batch"
    assert {w: policy.tier_for_ask(w).name for w in ("high", "normal", "low", "batch")} == {  # type: ignore[union-attr]
        "high": "interactive",
        "normal": "api",
        "low": "batch",
        "batch": "batch",
    }


def test_packaged_copy_is_the_default_policy() -> None:
    """The wheel ships extproc/default_policy.yaml; it must never drift from policies/."""
    packaged = Path(extproc.__file__).with_name("default_policy.yaml")
    assert packaged.read_bytes() == (REPO / "policies" / "default.yaml").read_bytes()


# --------------------------------------------------------------------------- the model


def test_lookups() -> None:
    policy = parse_policy(MINIMAL, "p.yaml")
    assert policy.tenant_for_key("sk-alice-0001") is policy.tenants[0]
    assert policy.tenant_for_key("SK-ALICE-0001") is None  # keys compare exactly
    assert policy.tenant_for_key("sk-alice-000") is None
    assert policy.tier_for_ask(" HIGH ") is policy.tier("fast")
    assert policy.tier_for_ask("slow") is policy.tier("slow")
    assert policy.tier_for_ask("nope") is None
    assert policy.top_tier(policy.tenants[0]).name == "fast"
    assert policy.lowest_tier.name == "slow"
    with pytest.raises(KeyError):
        policy.tier("nope")


def test_defaults_for_optional_settings() -> None:
    policy = parse_policy(MINIMAL, "p.yaml")
    assert policy.max_body_bytes == 8 * 1024 * 1024
    assert policy.on_escalation == "downgrade"
    assert policy.user_header == "x-user-id"
    assert policy.rules == ()
    tenant = policy.tenants[0]
    assert (tenant.default_tier, tenant.weight) == ("fast", 1.0)
    assert policy.tier("slow").slo_ttft_ms is None


def test_yaml_merge_keys_are_supported() -> None:
    text = MINIMAL.replace(
        "  - name: slow\n    priority: 20\n    queue_limit: 100\n    queue_deadline_s: 600\n",
        "  - &slow {name: slow, priority: 20, queue_limit: 100, queue_deadline_s: 600}\n"
        "  - {<<: *slow, name: slower, priority: 30}\n",
    )
    policy = parse_policy(text, "p.yaml")
    assert policy.tier("slower").queue_limit == 100
    assert policy.tier("slower").priority == 30


# --------------------------------------------------------------------------- validation


def test_yaml_syntax_error_names_file_and_line() -> None:
    errors = errors_of("tiers:\n  - name: a\n    priority: [1, 2\n", "bad.yaml")
    assert len(errors) == 1
    assert errors[0].startswith("bad.yaml:")
    assert "YAML syntax error" in errors[0]
    assert int(errors[0].split(":")[1]) in (3, 4)


def test_empty_file_is_an_error() -> None:
    assert errors_of("# nothing\n") == [
        "p.yaml:1: the policy is empty (it needs at least `tiers` and `tenants`)"
    ]


def test_top_level_must_be_a_mapping_and_needs_tiers_and_tenants() -> None:
    assert errors_of("- 1\n") == ["p.yaml:1: must be a mapping, not a list"]
    errors = errors_of("max_body_bytes: 10\n")
    assert "p.yaml:1: tiers: is required" in errors
    assert "p.yaml:1: tenants: is required" in errors


def test_every_error_in_a_file_is_reported_with_its_line_and_field() -> None:
    text = """\
    max_body_bytes: -5
    on_escalation: shout
    colour: blue
    tiers:
      - name: fast
        priority: high
        queue_limit: -1
        queue_deadline_s: 0
      - name: fast
        priority: 1
        queue_limit: 1
        queue_deadline_s: 1
        slo_ttft_ms: 1.5
    tenants:
      - name: alice
        api_keys: [sk-same-key-1]
        tiers: [fast, turbo]
        default_tier: slow
        weight: 0
      - name: bob
        api_keys: [sk-same-key-1]
        tiers: [fast]
        tier: fast
    rules:
      - name: r1
        match: {path_prefix: /v1/x/}
        tier: warp
    """
    errors = errors_of(text)
    expected = [
        "p.yaml:1: max_body_bytes: must be >= 1, not -5",
        "p.yaml:2: on_escalation: must be 'downgrade' or 'reject', not 'shout'",
        "p.yaml:3: colour: unknown field",
        "p.yaml:6: tiers[0].priority: must be an integer, not a string",
        "p.yaml:7: tiers[0].queue_limit: must be >= 0, not -1",
        "p.yaml:8: tiers[0].queue_deadline_s: must be > 0, not 0",
        "p.yaml:13: tiers[1].slo_ttft_ms: must be an integer, not a number",
        "p.yaml:17: tenants[0].tiers[1]: unknown tier 'turbo'",
        "p.yaml:18: tenants[0].default_tier: 'slow' is not one of this tenant's tiers",
        "p.yaml:19: tenants[0].weight: must be > 0, not 0",
        "p.yaml:21: tenants[1].api_keys[0]: key sk-s… is already used by tenant 'alice'",
        "p.yaml:23: tenants[1].tier: unknown field",
        "p.yaml:27: rules[0].tier: unknown tier 'warp'",
    ]
    for want in expected:
        assert any(e.startswith(want) for e in errors), f"missing {want!r} in:\n" + "\n".join(
            errors
        )
    assert all(e.startswith("p.yaml:") for e in errors)
    assert "sk-same-key-1" not in "\n".join(errors)  # keys are never echoed


def test_duplicate_tier_name_and_alias() -> None:
    text = MINIMAL.replace("    priority: 20", "    aliases: [high]\n    priority: 20")
    errors = errors_of(text)
    assert len(errors) == 1
    assert errors[0].startswith("p.yaml:7: tiers[1].aliases: 'high' is already used by")


def test_duplicate_tenant_names_and_keys_within_a_tenant() -> None:
    text = MINIMAL + (
        "  - name: alice\n    api_keys: [sk-other-0001, sk-other-0001]\n    tiers: [slow]\n"
    )
    errors = errors_of(text)
    assert errors[0].startswith("p.yaml:16: tenants[1].api_keys[1]: sk-o… is listed twice")
    assert len(errors) == 1  # the bad tenant is reported once, not also as a duplicate name
    errors = errors_of(text.replace("[sk-other-0001, sk-other-0001]", "[sk-other-0001]"))
    assert errors == ["p.yaml:15: tenants[1].name: tenant 'alice' is defined twice"]


def test_a_duplicate_among_many_tenants_is_found() -> None:
    """20,000 tenants and one name defined twice: the duplicate is reported where it is.
    The check is a set, not a scan of every tenant read so far (its time: ``python -m
    loadtests.bench.micro``, ``tenants-parse``)."""
    tenants = represent(
        [{"name": f"t{i}", "api_keys": [f"sk-t{i}-key"], "tiers": ["slow"]} for i in range(20_000)]
        + [{"name": "t7", "api_keys": ["sk-again"], "tiers": ["slow"]}]
    )
    reader = LocatedReader("p.yaml")
    read = parse_module._read_tenants(reader, tenants, {"slow": 1})
    assert len(read) == 20_000
    assert reader.errors == ["p.yaml: tenants[20000].name: tenant 't7' is defined twice"]


def test_missing_required_fields_point_at_their_mapping() -> None:
    text = MINIMAL.replace("    queue_limit: 100\n", "")
    assert errors_of(text) == ["p.yaml:7: tiers[1].queue_limit: is required"]


def test_wrong_container_types() -> None:
    text = MINIMAL.replace("    tiers: [fast]\n", "    tiers: fast\n").replace(
        "aliases: [high]", "aliases: {high: 1}"
    )
    errors = errors_of(text)
    assert "p.yaml:3: tiers[0].aliases: must be a list, not a mapping" in errors
    assert "p.yaml:14: tenants[0].tiers: must be a list, not a string" in errors


def test_names_must_be_well_formed() -> None:
    errors = errors_of(MINIMAL.replace("name: fast", "name: Fast Lane"))
    assert errors[0].startswith("p.yaml:2: tiers[0].name: 'Fast Lane' is not a valid name")


def test_rule_validation() -> None:
    text = MINIMAL + textwrap.dedent("""\
        rules:
          - name: a
            match: {path_prefix: v1/batch}
            tier: slow
          - name: b
            match: {}
            tier: slow
          - name: c
            match:
              path_regex: "([unclosed"
              headers: {X-Upper: yes, x-n: 1}
              body: {max_tokens: {gt: many, between: 3}, stream: {present: maybe}}
            tier: slow
          - name: d
            match: {path_prefix: /v1/batch/}
            strip_path_prefix: /v2
          - name: e
            match: {path_prefix: /v1/}
          - name: e
            match: {path_prefix: /v1/}
            tier: slow
          - name: e
            match: {path_prefix: /v1/}
            workload: w
        """)
    errors = errors_of(text)
    expected = [
        "p.yaml:17: rules[0].match.path_prefix: must start with '/'",
        "p.yaml:20: rules[1].match: must test something",
        "p.yaml:24: rules[2].match.path_regex: invalid regular expression",
        "p.yaml:25: rules[2].match.headers.X-Upper: header names must be lower-case",
        "p.yaml:25: rules[2].match.headers.x-n: must be a string (quote numbers and booleans)",
        "p.yaml:26: rules[2].match.body.max_tokens.gt: must be a number, not a string",
        "p.yaml:26: rules[2].match.body.max_tokens.between: unknown field",
        "p.yaml:26: rules[2].match.body.stream.present: must be true or false",
        "p.yaml:30: rules[3].strip_path_prefix: needs match.path_prefix to start with '/v2'",
        "p.yaml:31: rules[4]: does nothing",
        "p.yaml:36: rules[6].name: rule 'e' is defined twice",
    ]
    for want in expected:
        assert any(e.startswith(want) for e in errors), f"missing {want!r} in:\n" + "\n".join(
            errors
        )
    assert len(errors) == len(expected)


def test_not_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(MINIMAL.encode() + b"# caf\xe9\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.errors == [f"{path}:15: the file is not valid UTF-8"]


def test_policy_error_message_lists_every_error() -> None:
    error = PolicyError(["a.yaml:1: x: bad", "a.yaml:2: y: bad"])
    assert str(error) == "invalid policy (2 errors):\na.yaml:1: x: bad\na.yaml:2: y: bad"


# --------------------------------------------------------------------------- rules


def rules_policy(rules_yaml: str) -> Policy:
    return parse_policy(MINIMAL + textwrap.dedent(rules_yaml), "p.yaml")


@pytest.mark.parametrize(
    ("match", "path", "headers", "body", "expected"),
    [
        ("{path_prefix: /v1/batch/}", "/v1/batch/chat/completions", {}, {}, True),
        ("{path_prefix: /v1/batch/}", "/v1/chat/completions?x=/v1/batch/", {}, {}, False),
        ("{path_regex: 'embeddings$'}", "/v1/embeddings?a=1", {}, {}, True),
        ("{headers: {x-w: eval}}", "/", {"x-w": "eval"}, {}, True),
        ("{headers: {x-w: eval}}", "/", {"x-w": "Eval"}, {}, False),
        ("{headers: {x-w: [a, b]}}", "/", {"x-w": "b"}, {}, True),
        ("{headers: {x-w: {present: true}}}", "/", {"x-w": ""}, {}, True),
        ("{headers: {x-w: {present: false}}}", "/", {"x-w": ""}, {}, False),
        ("{headers: {x-w: {regex: '^ev'}}}", "/", {"x-w": "eval"}, {}, True),
        ("{body: {max_tokens: {gt: 10}}}", "/", {}, {"max_tokens": 11}, True),
        ("{body: {max_tokens: {gt: 10}}}", "/", {}, {"max_tokens": 10}, False),
        ("{body: {max_tokens: {gt: 10}}}", "/", {}, {"max_tokens": "99"}, False),
        ("{body: {max_tokens: {gt: 10}}}", "/", {}, {}, False),
        ("{body: {max_tokens: {ge: 10, le: 20}}}", "/", {}, {"max_tokens": 20}, True),
        ("{body: {max_tokens: {ge: 10, lt: 20}}}", "/", {}, {"max_tokens": 20}, False),
        ("{body: {stream: true}}", "/", {}, {"stream": True}, True),
        ("{body: {stream: true}}", "/", {}, {"stream": 1}, False),
        ("{body: {n: 1}}", "/", {}, {"n": True}, False),
        ("{body: {model: [a, b]}}", "/", {}, {"model": "b"}, True),
        ("{body: {model: {regex: '70b'}}}", "/", {}, {"model": "llama-70b"}, True),
        ("{body: {metadata.team: ml}}", "/", {}, {"metadata": {"team": "ml"}}, True),
        ("{body: {metadata.team: ml}}", "/", {}, {"metadata": "ml"}, False),
        ("{body: {user: {present: false}}}", "/", {}, {}, True),
        ("{path_prefix: /v1/, body: {stream: true}}", "/v1/x", {}, {"stream": False}, False),
    ],
)
def test_rule_matching(
    match: str, path: str, headers: dict[str, str], body: dict[str, object], expected: bool
) -> None:
    policy = rules_policy(f"rules:\n  - name: r\n    match: {match}\n    tier: slow\n")
    assert policy.rules[0].match.matches(path, headers, body) is expected


@pytest.mark.parametrize(
    ("strip", "add", "path", "upstream"),
    [
        ("/v1/batch", "/v1", "/v1/batch/chat/completions", "/v1/chat/completions"),
        ("/v1/batch", "/v1", "/v1/batch/completions?x=1", "/v1/completions?x=1"),
        ("/v1/batch/", "/v1", "/v1/batch/completions", "/v1/completions"),
        ("/v1/batch", None, "/v1/batch/completions", "/completions"),
        (None, "/openai", "/v1/batch/completions", "/openai/v1/batch/completions"),
    ],
)
def test_path_rewrite(strip: str | None, add: str | None, path: str, upstream: str) -> None:
    lines = ["rules:", "  - name: r", "    match: {path_prefix: /v1/batch/}"]
    if strip is not None:
        lines.append(f"    strip_path_prefix: {strip}")
    if add is not None:
        lines.append(f"    add_path_prefix: {add}")
    policy = rules_policy("\n".join(lines) + "\n")
    assert policy.rules[0].rewrite(path) == upstream


# --------------------------------------------------------------------------- hot reload


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(MINIMAL)
    return path


def rewrite(path: Path, text: str) -> None:
    """Write and make sure the mtime moves even on coarse-timestamp filesystems."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


def test_store_loads_at_start_and_fails_fast_on_a_bad_file(policy_file: Path) -> None:
    store = PolicyStore(policy_file)
    assert store.current.tier("fast").queue_limit == 10
    policy_file.write_text("tiers: 3\n")
    with pytest.raises(PolicyError):
        PolicyStore(policy_file)


def test_good_change_swaps_and_notifies(policy_file: Path) -> None:
    store = PolicyStore(policy_file)
    seen: list[Policy] = []
    store.on_change(seen.append)
    old = store.current
    rewrite(policy_file, MINIMAL.replace("queue_limit: 10", "queue_limit: 42"))
    assert store.reload() is True
    assert store.current is not old
    assert store.current.tier("fast").queue_limit == 42
    assert seen == [store.current]
    assert store.reload() is False  # nothing changed since


def test_bad_change_keeps_the_old_policy_and_logs(
    policy_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = PolicyStore(policy_file)
    old = store.current
    seen: list[Policy] = []
    store.on_change(seen.append)
    rewrite(policy_file, MINIMAL.replace("queue_limit: 10", "queue_limit: -10"))
    with caplog.at_level(logging.ERROR, logger="fairlane.policy"):
        assert store.reload() is False
    assert store.current is old
    assert seen == []
    [record] = [r for r in caplog.records if r.name == "fairlane.policy"]
    assert record.levelno == logging.ERROR
    assert f"{policy_file}:5: tiers[0].queue_limit: must be >= 0" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="fairlane.policy"):
        os.utime(policy_file, ns=(1, 1))
        assert store.reload() is False  # same bad content: not logged again
    assert caplog.records == []
    rewrite(policy_file, MINIMAL.replace("queue_limit: 10", "queue_limit: 11"))
    assert store.reload() is True  # a fixed file is picked up
    assert store.current.tier("fast").queue_limit == 11


def test_unchanged_file_is_not_reparsed(policy_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PolicyStore(policy_file)
    calls: list[str] = []
    real = parse_module.parse_policy

    def counting(text: str, filename: str = "<policy>") -> Policy:
        calls.append(filename)
        return real(text, filename)

    monkeypatch.setattr(parse_module, "parse_policy", counting)
    assert store.reload() is False  # same stat: not even read
    rewrite(policy_file, MINIMAL)  # touched, same content: read but not parsed
    assert store.reload() is False
    assert calls == []
    rewrite(policy_file, MINIMAL + "\n")
    assert store.reload() is True
    assert len(calls) == 1


def test_a_refusing_listener_rolls_the_swap_back(
    policy_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = PolicyStore(policy_file)
    old = store.current

    def refuses(_: Policy) -> None:
        raise RuntimeError("boom")

    seen: list[Policy] = []
    store.on_change(seen.append)
    store.on_change(refuses)
    rewrite(policy_file, MINIMAL.replace("queue_limit: 10", "queue_limit: 12"))
    with caplog.at_level(logging.ERROR, logger="fairlane.policy"):
        assert store.reload() is False
    assert store.current is old  # nothing committed
    assert [p.tier("fast").queue_limit for p in seen] == [12, 10]  # applied, then rolled back
    assert "refused" in caplog.text
    assert store.reloads["error"] == 1


def test_missing_file_keeps_the_policy(policy_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = PolicyStore(policy_file)
    old = store.current
    policy_file.unlink()
    with caplog.at_level(logging.WARNING, logger="fairlane.policy"):
        assert store.reload() is False
        assert store.reload() is False
    assert store.current is old
    assert len(caplog.records) == 1  # reported once, not on every poll
    policy_file.write_text(MINIMAL.replace("queue_limit: 10", "queue_limit: 13"))
    assert store.reload() is True


def many_tenants(count: int) -> str:
    """MINIMAL with ``count`` more tenants: a policy whose parse takes a while."""
    return MINIMAL + "".join(
        f"  - name: t{i}\n    api_keys: [sk-t{i}-key]\n    tiers: [slow]\n" for i in range(count)
    )


def test_load_and_commit_are_the_two_halves_of_a_reload(
    policy_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``load_if_changed`` reads, parses and validates, and nothing else: no listener runs
    and ``current`` stays, so the service can run it in a thread; ``commit`` swaps."""
    store = PolicyStore(policy_file)
    old = store.current
    seen: list[Policy] = []
    store.on_change(seen.append)
    assert store.load_if_changed() is None  # unchanged: a stat only
    rewrite(policy_file, many_tenants(2))
    loaded = store.load_if_changed()
    assert isinstance(loaded, Policy)
    assert [t.name for t in loaded.tenants] == ["alice", "t0", "t1"]
    assert store.current is old and seen == []  # loaded, not yet in force
    assert store.load_if_changed() is None  # loaded once: not again until the file changes
    assert store.commit(loaded) is True
    assert store.current is loaded and seen == [loaded]
    assert store.reloads == {"ok": 1}
    assert store.commit(None) is False

    rewrite(policy_file, many_tenants(2).replace("tiers: [slow]", "tiers: [slower]", 1))
    refused = store.load_if_changed()
    assert isinstance(refused, PolicyError)
    assert refused.errors == [
        f"{policy_file}:17: tenants[1].tiers[0]: unknown tier 'slower' (tiers are: fast, slow)"
    ]
    assert store.current is loaded and seen == [loaded]
    with caplog.at_level(logging.ERROR, logger="fairlane.policy"):
        assert store.commit(refused) is False
    assert f"{policy_file}:17: tenants[1].tiers[0]" in caplog.text
    assert store.current is loaded and seen == [loaded]
    assert store.reloads == {"ok": 1, "error": 1}


def test_a_load_in_another_thread_leaves_the_listeners_to_the_commit(policy_file: Path) -> None:
    store = PolicyStore(policy_file)
    threads: list[str] = []
    store.on_change(lambda _: threads.append(threading.current_thread().name))
    rewrite(policy_file, many_tenants(1))
    with ThreadPoolExecutor(1, thread_name_prefix="loader") as pool:
        loaded = pool.submit(store.load_if_changed).result(timeout=30)
    assert threads == []
    assert store.commit(loaded) is True
    assert threads == [threading.current_thread().name]
    assert len(store.current.tenants) == 2


# --------------------------------------------------------------------------- scheduling knobs

SCHEDULED = """\
fairness: {flow: user, input_weight: 1, output_weight: 3, default_output_tokens: 128}
backpressure: {scrape_interval_s: 0.05, stale_after_s: 0.5}
tiers:
  - name: fast
    priority: 0
    queue_limit: 10
    queue_deadline_s: 5
    reserved_share: 0.3
    reserved_idle_s: 30
    gate: {max_waiting: 3, max_kv_cache_usage: 0.9, max_itl_ms: null}
  - name: slow
    priority: 20
    queue_limit: 100
    queue_deadline_s: 600
    gate: {max_waiting: 0, max_itl_ms: 150, max_in_flight: 4}
    aging: {seconds_per_rank: 300, max_ranks: 1}
    early_shed_from: 0.8
tenants:
  - name: alice
    api_keys: [sk-alice-0001]
    tiers: [fast]
"""


def test_scheduling_knobs_are_read() -> None:
    policy = parse_policy(SCHEDULED, "s.yaml")
    fast, slow = policy.tiers
    assert fast.reserved_share == 0.3 and fast.reserved_idle_s == 30
    assert slow.reserved_idle_s == 120  # the default
    assert (fast.gate.max_waiting, fast.gate.max_kv_cache_usage, fast.gate.max_itl_s) == (
        3,
        0.9,
        None,
    )
    assert slow.gate.max_waiting == 0 and slow.gate.max_itl_s == pytest.approx(0.15)
    assert slow.gate.max_in_flight == 4
    assert slow.gate.max_kv_cache_usage == 0.95  # left out: the default bound
    assert slow.aging_rate == pytest.approx(1 / 300) and slow.aging_cap == 1
    assert slow.early_shed_from == 0.8
    assert policy.fairness.flow == "user" and policy.fairness.output_weight == 3
    assert policy.fairness.default_output_tokens == 128
    assert policy.backpressure.scrape_interval_s == 0.05


@pytest.mark.parametrize(
    ("old", "new", "line", "field"),
    [
        ("reserved_share: 0.3", "reserved_share: -0.1", 8, "tiers[0].reserved_share"),
        ("reserved_share: 0.3", "reserved_share: 1.5", 8, "tiers[0].reserved_share"),
        (
            "max_kv_cache_usage: 0.9",
            "max_kv_cache_usage: 2",
            10,
            "tiers[0].gate.max_kv_cache_usage",
        ),
        ("max_waiting: 0,", "max_waiting: -1,", 15, "tiers[1].gate.max_waiting"),
        ("max_itl_ms: 150", "max_itl_ms: 0", 15, "tiers[1].gate.max_itl_ms"),
        ("max_in_flight: 4}", "max_in_flight: 4, max_queue: 1}", 15, "tiers[1].gate.max_queue"),
        (
            "{seconds_per_rank: 300, max_ranks: 1}",
            "{max_ranks: 1}",
            16,
            "tiers[1].aging.seconds_per_rank",
        ),
        ("max_ranks: 1}", "max_ranks: -2}", 16, "tiers[1].aging.max_ranks"),
        ("early_shed_from: 0.8", "early_shed_from: 1.2", 17, "tiers[1].early_shed_from"),
        ("flow: user", "flow: team", 1, "fairness.flow"),
        ("stale_after_s: 0.5", "stale_after_s: 0.01", 2, "backpressure.stale_after_s"),
    ],
)
def test_impossible_scheduling_values_name_file_line_and_field(
    old: str, new: str, line: int, field: str
) -> None:
    assert old in SCHEDULED
    errors = errors_of(SCHEDULED.replace(old, new), "s.yaml")
    assert any(e.startswith(f"s.yaml:{line}: {field}") for e in errors), errors


def test_reservations_over_the_whole_fleet_are_rejected() -> None:
    text = SCHEDULED.replace("    aging:", "    reserved_share: 0.8\n    aging:")
    errors = errors_of(text, "s.yaml")
    assert any("reserved_share adds up to 1.1" in e and e.startswith("s.yaml:") for e in errors)


def test_routing_weights_and_hedging_are_read_and_checked() -> None:
    text = SCHEDULED.replace(
        "backpressure:", "routing: {prefix_weight: 3, sticky_margin: 0.1}\nbackpressure:"
    ).replace("    reserved_idle_s: 30\n", "    reserved_idle_s: 30\n    hedge_after_ms: 400\n")
    policy = parse_policy(text, "r.yaml")
    assert policy.routing.prefix_weight == 3 and policy.routing.queue_weight == 1
    assert policy.tiers[0].hedge_after_ms == 400 and policy.tiers[1].hedge_after_ms is None
    errors = errors_of(text.replace("prefix_weight: 3", "prefix_weight: -1"), "r.yaml")
    assert any(e.startswith("r.yaml:2: routing.prefix_weight") for e in errors), errors
    errors = errors_of(text.replace("hedge_after_ms: 400", "hedge_after_ms: 0"), "r.yaml")
    assert any("tiers[0].hedge_after_ms" in e for e in errors), errors
    assert policy.routing.prefix_lookahead == 8  # the default
    looking = text.replace("sticky_margin: 0.1}", "sticky_margin: 0.1, prefix_lookahead: 3}")
    assert parse_policy(looking, "r.yaml").routing.prefix_lookahead == 3
    for bad, why in (("1.5", "must be an integer"), ("-1", "must be >= 0")):
        errors = errors_of(
            looking.replace("prefix_lookahead: 3", f"prefix_lookahead: {bad}"), "r.yaml"
        )
        assert any(e.startswith("r.yaml:2: routing.prefix_lookahead") and why in e for e in errors)


# --------------------------------------------------------------------------- budgets


def test_budgets_are_read_per_tenant_and_per_user() -> None:
    text = MINIMAL + (
        "    budget: {tokens_per_minute: 60000, requests_per_minute: 100, concurrent: 8}\n"
        "    user_budget:\n      tokens_per_minute: 10000\n      concurrent: null\n"
    )
    (alice,) = parse_policy(text, "p.yaml").tenants
    assert alice.budget == Budget(tokens_per_minute=60000, requests_per_minute=100, concurrent=8)
    assert alice.user_budget == Budget(tokens_per_minute=10000)
    (plain,) = parse_policy(MINIMAL + "    budget: null\n", "p.yaml").tenants
    assert plain.budget is None and plain.user_budget is None


def test_budget_errors_name_the_line_and_field() -> None:
    text = MINIMAL + (
        "    budget: {tokens_per_minute: 0, requests: 5}\n"
        "    user_budget: {}\n"
        "  - name: bob\n    api_keys: [sk-bob-0001]\n    tiers: [slow]\n"
        "    budget: {concurrent: 2.5}\n"
    )
    assert errors_of(text) == [
        "p.yaml:15: tenants[0].budget.requests: unknown field (expected one of: "
        "tokens_per_minute, requests_per_minute, concurrent)",
        "p.yaml:15: tenants[0].budget.tokens_per_minute: must be >= 1, not 0",
        "p.yaml:16: tenants[0].user_budget: sets no limit (give tokens_per_minute, "
        "requests_per_minute, concurrent)",
        "p.yaml:20: tenants[1].budget.concurrent: must be an integer, not a number",
    ]
