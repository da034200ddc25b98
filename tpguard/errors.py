"""Errors tpguard raises, and the exit codes the CLI maps them to (docs/diagnose.md, docs/harness.md)."""

from __future__ import annotations

# Exit codes shared by every command.
EXIT_OK = 0
EXIT_DIVERGED = 1  # diagnose: the trace shows a divergence; harness: divergences were recorded
EXIT_BAD_INPUT = 2  # unusable input or arguments: one line on stderr
EXIT_ABORTED = 3  # a guard with policy "abort" stopped every rank at the divergent step
EXIT_TIMEOUT = 4  # a rank stopped reaching the guard; the others gave up waiting
EXIT_INTERNAL = 5  # a tpguard bug (an unexpected exception): one line; TPGUARD_DEBUG=1 re-raises
EXIT_RANK_DIED = 6  # launch: a rank was killed by a signal or crashed (one line names it and the signal);
#                     a harness rank that cannot go on (its trace cannot be written) exits with it too
EXIT_NOTHING_COMPARED = 7  # diagnose: no step was recorded by two or more ranks, so nothing was compared
EXIT_SIGINT = 130  # launch and its ranks: interrupted (Ctrl-C); traces flushed
EXIT_SIGTERM = 143  # launch and its ranks: terminated (SIGTERM); traces flushed


class TPGuardError(Exception):
    """Base class; the message is one line, fit for stderr."""

    exit_code = EXIT_BAD_INPUT


class TraceError(TPGuardError):
    """A trace that cannot be used (not JSON Lines, no header, unknown schema, conflicting runs)."""


class RankDivergenceError(TPGuardError):
    """Raised on every rank at the same step when the guard's policy is "abort"."""

    exit_code = EXIT_ABORTED

    def __init__(self, divergence):
        self.divergence = divergence
        d = divergence
        super().__init__(
            f"tpguard: ranks diverged at step {d.step}, site {d.site}: first differing quantity "
            f"{d.quantity!r}, culprit rank(s) {d.culprit_ranks} (majority {d.majority_ranks})"
        )


class TraceWriteError(TPGuardError):
    """A trace file could not be written (a full disk, a file size limit): the rank stops, and the
    file keeps every complete record written before."""

    exit_code = EXIT_RANK_DIED


class RankTimeoutError(TPGuardError):
    """A rank did not reach the guard's collective within the timeout."""

    exit_code = EXIT_TIMEOUT

    def __init__(self, site: str, step: int, missing: list[int], last_step_by_rank: dict[int, int | None],
                 timeout_s: float, dead: dict[int, str] | None = None, peer_left: bool = False):
        self.site = site
        self.step = step
        self.missing = missing
        self.last_step_by_rank = last_step_by_rank
        self.timeout_s = timeout_s
        self.dead = dict(dead or {})  # rank -> why (killed, crashed or frozen), from the ranks' pulses
        last = ", ".join(f"rank {r}: {s if s is not None else 'none'}" for r, s in sorted(last_step_by_rank.items()))
        if self.dead:
            why = "; ".join(self.dead[r] for r in sorted(self.dead))
            super().__init__(
                f"tpguard: {why}; the guard's all-gather at step {step}, site {site} "
                + ("ended early (a peer closed its connection)" if peer_left else
                   f"did not complete within {timeout_s:g} s") + f" (last step reached: {last})")
            return
        who = f"rank(s) {missing}" if missing else "some rank(s)"
        super().__init__(
            f"tpguard: {who} did not reach step {step} at site {site} within {timeout_s:g} s "
            f"(last step reached: {last})"
        )
