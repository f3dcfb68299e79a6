"""Run a plain object as a Ray actor so that its errors reach the driver intact.

Ray reports an exception raised in an actor's constructor only as text (`ActorDiedError`), which would
turn a user mistake found while a worker starts (a bad dataset row, a hook path that does not import)
into a traceback. Here the actor's constructor does nothing; `setup()` builds the object, so such an
error travels as a task error whose `cause` is the original exception, and `wait()` re-raises a
`UserError` as itself. `remote_object(cls, ...)` returns a handle whose methods are called exactly
like an actor's: `handle.generate.remote(rollout_id)`.
"""

from __future__ import annotations

from typing import Any

_LABELS: dict[str, str] = {}  # actor id (hex) -> what it is, for the message when it dies
_HOSTED: list[Any] = []  # every RemoteObject made in this process, so a stopping run can end them


def actor_label(actor_id: str | None) -> str | None:
    """What the actor with this id hosts ("the TrainWorker of rank 1", "the RolloutManager"), if made here."""
    return _LABELS.get(actor_id) if actor_id else None


def end_hosted_actors() -> list[int]:
    """`ray.kill` every actor made here (a busy actor does not stop when Ray's node shuts down: it
    would outlive the run); returns the pids they reported, for the caller to make sure they are gone."""
    import ray

    pids = []
    for obj in _HOSTED:
        try:
            pids.append(int(ray.get(obj.ready_ref, timeout=1)))
        except Exception:
            pass  # never started, or its constructor failed: nothing reported
        try:
            ray.kill(obj._handle, no_restart=True)
        except Exception:
            pass
    _HOSTED.clear()
    return pids


class _Host:
    def setup(self, cls: type, args: tuple, kwargs: dict) -> int:
        import os

        self.obj = cls(*args, **kwargs)
        return os.getpid()

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.obj, name)(*args, **kwargs)


class _Method:
    def __init__(self, handle, name: str, options: dict[str, Any] | None = None):
        self._handle, self._name, self._options = handle, name, options

    def options(self, **options: Any) -> "_Method":
        """Ray call options, as on an actor method: `obj.rollout.options(num_returns=2).remote(...)`."""
        return _Method(self._handle, self._name, options)

    def remote(self, *args: Any, **kwargs: Any):
        call = self._handle.call.options(**self._options) if self._options else self._handle.call
        return call.remote(self._name, *args, **kwargs)


class RemoteObject:
    """A Ray actor hosting one object; `obj.method.remote(...)` calls `method` on it."""

    def __init__(self, handle, ready_ref):  # ready_ref resolves to the actor's pid
        self._handle = handle
        self.ready_ref = ready_ref  # resolves once the object is built (or raises its constructor's error)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self._handle, name)


def remote_object(cls: type, *args: Any, actor_options: dict[str, Any] | None = None, **kwargs: Any) -> RemoteObject:
    import ray

    # A host class named after the hosted one, so `ps` and Ray's tools show "ray::TrainWorker.call".
    named = type(cls.__name__, (_Host,), {"__module__": __name__, "__qualname__": cls.__name__})
    host = ray.remote(**(actor_options or {}))(named).remote()
    _LABELS[host._actor_id.hex()] = f"the {cls.__name__}" + (f" of rank {kwargs['rank']}" if "rank" in kwargs else "")
    obj = RemoteObject(host, host.setup.remote(cls, args, kwargs))
    _HOSTED.append(obj)
    return obj


def unwrap_user_error(error: BaseException) -> BaseException | None:
    """The `UserError` inside a Ray task error, if that is what it carries."""
    from ray.exceptions import RayTaskError

    from miles.errors import UserError

    seen = 0
    while error is not None and seen < 5:
        if isinstance(error, UserError) and not isinstance(error, RayTaskError):
            return error
        error = getattr(error, "cause", None)
        seen += 1
    return None
