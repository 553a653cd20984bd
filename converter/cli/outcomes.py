"""Each command's outcome (converter.outcome) from the typed results of what it ran: never from what it printed.

Why here: the command line is where the verbs' results meet; the verdicts and exit codes themselves are decided in
converter.outcome, the proofs summarised by their own reports (`as_proofs()`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from converter.outcome import NOT_ASKED, Outcome, Proofs, Verdict

NOTHING_TO_PROVE = "nothing to prove"


def not_asked(verb: str, reason: str = NOT_ASKED, **fields: Any) -> Outcome:
    """Done, with no proof asked for (`--no-verify`, a dry run, a verb that proves nothing): exit 0."""
    return Outcome(verb, Verdict.NOT_VERIFIED, reason, proof_asked=False, **fields)


def verified(verb: str, report, **fields: Any) -> Outcome:
    """The outcome of a verification that returned (a VerificationReport): its verdict and both proofs."""
    verdict = report.outcome_verdict
    reason = "" if verdict is Verdict.PROVEN else "; ".join(report.problems or report.notes)
    return Outcome(verb, verdict, reason, proofs=report.as_proofs(), **fields)


def proven(verb: str, proofs: Proofs, **fields: Any) -> Outcome:
    """Every proof that ran passed (a failed one raises VerificationFailed instead)."""
    return Outcome(verb, Verdict.PROVEN, proofs=proofs, **fields)


def paths(out: str | Path | None, names: Iterable[str]) -> tuple[str, ...]:
    """The written files as paths: `names` inside the folder `out`, or `out` itself when it is the one file."""
    if out is None:
        return ()
    out = Path(out)
    names = list(names)
    if names == [out.name] and not out.is_dir():
        return (str(out),)
    return tuple(str(out / n) for n in names)
