"""What an upgrade does with the checkpoint, decided from the preflight verdict and the reset policy.

Pure: the upgrade operator runs the preflight and the steps; this module holds the rules, so they can
be read (and tested) in one place:

=================  ======================  ===================================================
preflight verdict  reset_policy            decision
=================  ======================  ===================================================
compatible         any                     reuse the checkpoint (same generation)
incompatible       auto, after_preflight   reset: archive, new generation from stored offsets
incompatible       never                   abort before the stop, saying what a reset would do
failed             any                     abort before the stop: the new code is broken, or
                                           could not be judged (``UNJUDGED_KINDS``)
inconclusive,      any                     reuse; if the new version then fails on the
skipped                                    checkpoint, reset only when the policy is ``auto``
=================  ======================  ===================================================
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

RESET_POLICIES = ("auto", "after_preflight", "never")
#: Failure kinds of a dry run that say nothing of the new code: Kafka or the database away, memory, records
#: gone from Kafka.  The upgrade still stops before anything changes, and says what to fix instead of
#: calling the new version broken.
UNJUDGED_KINDS = frozenset({"TRANSIENT", "RESOURCE", "DATA_LOSS"})


class Verdict(StrEnum):
    #: The new code ran one batch on a copy of the checkpoint.
    COMPATIBLE = "compatible"
    #: Spark refused the copy: CHECKPOINT_INCOMPATIBLE, with its error class.
    INCOMPATIBLE = "incompatible"
    #: The new code failed for another reason (user code, config, ...): do not deploy it.
    FAILED = "failed"
    #: No batch ran within the timeout: nothing proven either way.
    INCONCLUSIVE = "inconclusive"
    #: No checkpoint to test against (the job never committed a batch).
    SKIPPED = "skipped"


class Action(StrEnum):
    REUSE = "reuse"
    RESET = "reset"
    ABORT = "abort"


@dataclass(frozen=True)
class Preflight:
    verdict: Verdict
    detail: str
    error_class: str | None = None
    failure_kind: str | None = None
    run_id: str | None = None
    log_path: str | None = None
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict.value}


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str
    #: May a failure of the new version *on the checkpoint* after the start still lead to a reset?
    reset_on_start_failure: bool = False


def check_policy(policy: str) -> str:
    if policy not in RESET_POLICIES:
        raise ValueError(f"reset_policy={policy!r} is not one of {', '.join(RESET_POLICIES)}: 'auto' resets "
                         "whenever Spark refuses the checkpoint, 'after_preflight' only when the preflight "
                         "proved it, 'never' fails instead")
    return policy


def decide(preflight: Preflight, policy: str) -> Decision:
    check_policy(policy)
    verdict = preflight.verdict
    if verdict == Verdict.COMPATIBLE:
        return Decision(Action.REUSE, "the new version ran a batch on a copy of the checkpoint")
    if verdict == Verdict.INCOMPATIBLE:
        if policy == "never":
            return Decision(Action.ABORT, f"the checkpoint is incompatible ({preflight.error_class}) and "
                                          "reset_policy='never'")
        return Decision(Action.RESET, f"the checkpoint is incompatible with the new version "
                                      f"({preflight.error_class})")
    if verdict == Verdict.FAILED and preflight.failure_kind in UNJUDGED_KINDS:
        return Decision(Action.ABORT, f"its preflight could not judge the new version: the dry run ended "
                                      f"{preflight.failure_kind}: {preflight.detail}")
    if verdict == Verdict.FAILED:
        return Decision(Action.ABORT, f"the new version failed its preflight: {preflight.detail}")
    return Decision(Action.REUSE, f"preflight {verdict.value}: {preflight.detail}",
                    reset_on_start_failure=policy == "auto")
