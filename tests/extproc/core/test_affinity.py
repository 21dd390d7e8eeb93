"""Which queued request a freed engine takes: the one reusing the most of its cache."""

from extproc.core.affinity import FEW_ENGINES, Prompts, most_reused
from extproc.core.prefix import PromptBlocks
from extproc.core.scheduler import Entry
from extproc.fleet.backend import Backend, BackendSpec

SYSTEM = "You answer questions about the fleet's invoices, politely and briefly. " * 20


def entry(request_id: str, text: str) -> Entry:
    return Entry(request_id, "api", "t", 1.0, len(text) // 4, 10, 0.0, payload=text)


def prompt(e: Entry) -> PromptBlocks:
    return PromptBlocks(e.payload)


def engines(n: int) -> list[Backend]:
    return [Backend(BackendSpec("127.0.0.1", 9000 + i, "r")) for i in range(n)]


def test_the_entry_whose_prefix_an_engine_holds_goes_before_older_ones() -> None:
    (engine,) = engines(1)
    engine.prefix_cache.record(PromptBlocks(SYSTEM).blocks(engine.block_size))
    window = [entry("new-topic", "something else " * 90), entry("follow-up", SYSTEM + "Q?")]
    assert most_reused(window, [engine], prompt) is window[1]
    # The oldest goes when nothing reuses more than it does by a block.
    same = [entry("a", SYSTEM + "one?"), entry("b", SYSTEM + "two?")]
    assert most_reused(same, [engine], prompt) is same[0]


def test_the_oldest_goes_when_many_engines_have_room_or_none_is_healthy() -> None:
    many = engines(FEW_ENGINES + 1)
    many[-1].prefix_cache.record(PromptBlocks(SYSTEM).blocks(many[-1].block_size))
    window = [entry("new-topic", "something else " * 90), entry("follow-up", SYSTEM + "Q?")]
    assert most_reused(window, many, prompt) is window[0]  # its own pick has the choice
    few = many[-FEW_ENGINES:]
    assert most_reused(window, few, prompt) is window[1]
    for engine in few:
        engine.healthy = False
    assert most_reused(window, few, prompt) is window[0]


def test_prompts_are_kept_until_taken_and_bounded() -> None:
    prompts = Prompts(limit=2)
    made: list[str] = []

    def make(e: Entry) -> PromptBlocks:
        made.append(e.request_id)
        return prompt(e)

    a, b, c = entry("a", "x"), entry("b", "y"), entry("c", "z")
    first = prompts.of(a, make)
    assert prompts.of(a, make) is first and made == ["a"]
    prompts.of(b, make)
    prompts.of(c, make)  # over the limit: a, the least recently used, goes
    assert prompts.pop("a") is None and prompts.pop("c") is not None
    assert prompts.pop("c") is None  # taken once
