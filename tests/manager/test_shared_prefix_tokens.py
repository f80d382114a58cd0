"""`SharedPrefixes.fork_tokens`: the prompt tokens forks take from a prefix's context."""

from __future__ import annotations

from parrot_backend.manager.prefix import Prefix
from parrot_backend.manager.sharing import SharedPrefixes
from parrot_backend.testing.fake_engine import FakeEngine


async def test_fork_tokens_count_each_fork_from_a_prefix_context() -> None:
    engine = FakeEngine()
    sharing = SharedPrefixes({"e0": engine}, clock=lambda: 0.0)
    prompt = list(range(100, 130))
    static, dynamic = Prefix("s", 1, 8), Prefix("d", 3, 20)

    first = await sharing.attach("e0", [static, dynamic], prompt, None, 0)
    # the dynamic prefix is filled on a fork of the static one (8 tokens not filled again),
    # and the call forks from the dynamic one (20)
    assert [(f.parent_id, f.n_tokens) for f in engine.fills] == [
        (None, 8),
        (sharing.context_id("s"), 12),
    ]
    assert (first.context_id, first.n_tokens) == (sharing.context_id("d"), 20)
    assert sharing.fork_tokens["e0"] == 8 + 20

    await sharing.attach("e0", [static, dynamic], prompt, None, 0)  # both already filled
    assert len(engine.fills) == 2
    assert sharing.fork_tokens["e0"] == 8 + 20 + 20
    assert sharing.forks["e0"] == 2


async def test_a_call_with_no_shared_prefix_forks_nothing() -> None:
    sharing = SharedPrefixes({"e0": FakeEngine()}, clock=lambda: 0.0)
    attached = await sharing.attach("e0", [], list(range(10)), None, 0)
    assert attached.context_id is None
    assert sharing.fork_tokens["e0"] == 0
