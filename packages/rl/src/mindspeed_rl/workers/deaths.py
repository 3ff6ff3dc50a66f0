"""A Ray worker of the run died: which one, why (as far as Ray knows), in one line.

Ray reports a dead actor as :class:`ray.exceptions.RayActorError` (``ActorDiedError``,
``ActorUnavailableError``), possibly wrapped in the ``RayTaskError`` of a call that waited on
it. :func:`find_actor_error` digs it out of an exception's chain; :func:`describe_death` turns it
into ``the actor worker (rank 0 of 2, node 10.0.0.5, pid 4242) died: <Ray's exit cause>``, using
the driver's map of actor ids to roles (:meth:`~mindspeed_rl.driver.runner.GRPORunner.worker_roles`).
"""

from __future__ import annotations

import re
from typing import Any

#: Parts of Ray's ``ActorDiedError`` text (``ActorDiedErrorContext``), when Ray knows them.
_IP = re.compile(r"^\s*ip: (\S+)$", re.M)
_PID = re.compile(r"^\s*pid: (\d+)$", re.M)
_CLASS = re.compile(r"^\s*class_name: (\S+)$", re.M)
_EXIT_TYPE = re.compile(r"Worker exit type: (\w+)")
_EXIT_DETAIL = re.compile(
    r"Worker exit detail: (.*?)(?: Some common causes| There are some potential root causes| If the process|$)", re.S
)
#: Ray's exit types of a process that ended without saying why (a signal, the OOM killer, a crash).
_KILLED = ("SYSTEM_ERROR", "UNEXPECTED_SYSTEM_EXIT")


def find_actor_error(err: BaseException) -> Any | None:
    """The ``RayActorError`` that caused ``err`` (itself, a cause, a wrapped task's cause), or None."""
    try:
        from ray.exceptions import RayActorError, RayTaskError
    except ImportError:  # Ray absent: nothing of Ray's can have raised
        return None
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RayActorError):
            return e
        if isinstance(e, RayTaskError):
            todo.append(getattr(e, "cause", None))
        todo.extend((e.__cause__, e.__context__))
    return None


def _node_of(actor_id: str | None) -> str | None:
    """The node address of a (dead) actor from Ray's actor table (a GCS lookup); None if not known."""
    if not actor_id:
        return None
    try:
        import ray

        info = ray._private.state.actors(actor_id=actor_id)  # the GCS's record; no dashboard needed
        return (info.get("Address") or {}).get("IPAddress") or None
    except Exception:  # noqa: BLE001 -- a best-effort detail of an error line
        return None


def _cause(text: str) -> str:
    """Ray's exit cause of the worker, short (its exit type and the first sentence of the detail)."""
    kind = _EXIT_TYPE.search(text)
    detail = _EXIT_DETAIL.search(text)
    parts = [kind.group(1)] if kind else []
    if detail:
        parts.append(" ".join(detail.group(1).split()).rstrip(". "))
    if parts:
        killed = (
            " (killed or crashed: kill -9, the out-of-memory killer, a segfault)"
            if kind and kind.group(1) in _KILLED
            else ""
        )
        return ": ".join(parts) + killed
    lines = [line.strip() for line in text.splitlines() if line.strip() and ":" not in line.strip()[:20]]
    return lines[-1].rstrip(".") if lines else "Ray gave no cause"


def describe_death(err: Any, roles: dict[str, str]) -> str:
    """``the <role> (<rank>, node <ip>, pid <pid>) died: <cause>`` for ``RayActorError`` ``err``.

    Args:
        err: the ``RayActorError`` (from :func:`find_actor_error`).
        roles: actor id (hex) -> what the worker is to the run (``actor worker rank 0 of 2``).
    """
    text = str(err)
    actor_id = getattr(err, "actor_id", None)
    role = roles.get(actor_id or "")
    if role is None:
        name = _CLASS.search(text)
        role = f"Ray worker {name.group(1)}" if name else f"Ray actor {actor_id or '(unknown id)'}"
    where = []
    ip = _IP.search(text)
    node = ip.group(1) if ip else _node_of(actor_id)
    where.append(f"node {node or 'unknown'}")
    pid = _PID.search(text)
    if pid:
        where.append(f"pid {pid.group(1)}")
    verb = "is unavailable" if type(err).__name__ == "ActorUnavailableError" else "died"
    return f"the {role} ({', '.join(where)}) {verb}: {_cause(text)}"
