"""The driver's one way to wait on actors: `wait(refs, what, timeout)` — `ray.get` with a timeout and a
sentence that says what it waited for; a dead actor becomes `ActorDied` naming it, a `UserError`
raised inside an actor comes back as itself."""

from __future__ import annotations

import time

from miles.errors import StepFailed

ACTOR_START_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 3600.0


def wait(refs, what: str, timeout: float = STEP_TIMEOUT_S):
    """`ray.get` with a timeout and a message that says what was being waited for."""
    import ray

    from miles.ray.actor_death import ActorDied, describe
    from miles.ray.hosting import unwrap_user_error

    try:
        if isinstance(refs, list) and len(refs) > 1:
            _first_error_first(refs, timeout)
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise StepFailed(f"timed out after {timeout:.0f} s waiting for {what}") from None
    except ray.exceptions.RayActorError as e:
        raise ActorDied(describe(e, what)) from None
    except ray.exceptions.RayTaskError as e:
        user_error = unwrap_user_error(e)
        if user_error is not None:
            raise user_error from None
        raise


def _first_error_first(refs: list, timeout: float) -> None:
    """Wait for `refs` one by one as they finish, so a rank that died is reported at once instead of
    after its peers time out in a collective it will never join."""
    import ray

    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError()
        done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
        ray.get(done)
