"""AR greedy with several steps per verifier call (`core.interfaces.GreedySession.step_greedy`).

The same steps, tokens and stats as `draft_verify_loop` with an empty draft: each call asks the
verifier for a run of plain AR steps (`VerifyStep.greedy_steps`), so a remote verifier costs one
round trip per run instead of one per token. Runs are the session's `max_greedy_steps` long, after
its `first_greedy_runs` (a streaming request's: 1, then 4 steps, so its first token comes as soon
as without runs). With `copy_k`, IAD the same way: each run's forwards verify drafts copied from the
source on the verifier's side (`core.interfaces.CopyRunSession`), the same tokens in fewer forwards.
"""

from __future__ import annotations

import time

from core.interfaces import GreedySession
from decoding.policies.loop import DecodeStats, OnTokens, Output, PrefixSync, run_plain_steps


def greedy_loop(
    session: GreedySession,
    top_k: int,
    max_new_tokens: int,
    eos_id: int,
    stats: DecodeStats,
    on_tokens: OnTokens | None = None,
    prefix: list[int] | None = None,
    logprobs: list[float] | None = None,
    copy_k: int = 0,
) -> list[int]:
    """Decode until EOS or max_new_tokens (`draft_verify_loop`'s contract, with no draft; `logprobs`
    as `LoopOptions.logprobs`); `copy_k` > 0: runs of copy drafts of at most that many tokens
    (`session` a `CopyRunSession`)."""
    output = Output(list(prefix or []), logprobs, eos_id, max_new_tokens, stats, on_tokens)
    out = output.ids
    sync = PrefixSync()
    first_runs = session.first_greedy_runs
    runs = 0
    while True:
        chunk = first_runs[runs] if runs < len(first_runs) else session.max_greedy_steps
        steps = max(1, min(chunk, session.max_greedy_steps, max_new_tokens - len(out)))
        runs += 1
        t0 = time.perf_counter()
        result = run_plain_steps(session, out, sync, steps, top_k, stats, copy_k)
        stats.verifier_time_s += time.perf_counter() - t0
        if output.commit_run(result):
            return out
