"""The one line of a dead Ray worker: found through wrappers, named by the run's role, Ray's cause kept short."""

from __future__ import annotations

from mindspeed_rl.workers.deaths import describe_death, find_actor_error

#: Ray 2.60's exit detail of a worker killed by SIGKILL (as measured; the advice after it is dropped).
DETAIL = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
    "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called."
)


def _died(actor_id: bytes) -> BaseException:
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    context = ActorDiedErrorContext(
        class_name="ActorWorker", actor_id=actor_id, pid=4242, node_ip_address="10.0.0.5", error_message=DETAIL
    )
    return ActorDiedError(context)


def test_a_dead_worker_is_named_by_role_node_pid_and_cause() -> None:
    from ray.exceptions import RayActorError, RayTaskError

    dead = _died(bytes(range(16)))
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = dead
    assert find_actor_error(wrapped) is dead
    # A call that waited on a dead actor: Ray's task error carries the actor error as its cause.
    inner = RayActorError(dead.actor_id, DETAIL)
    assert find_actor_error(RayTaskError("update", "traceback", inner)) is inner
    assert find_actor_error(RuntimeError("no Ray in it")) is None
    line = describe_death(dead, {dead.actor_id: "actor worker rank 1 of 2"})
    assert line == (
        "the actor worker rank 1 of 2 (node 10.0.0.5, pid 4242) died: SYSTEM_ERROR: Worker unexpectedly exits "
        "with a connection error code 2. End of file (killed or crashed: kill -9, the out-of-memory killer, "
        "a segfault)"
    )
    assert "\n" not in line
    # A worker the run does not know is named by its class.
    assert describe_death(dead, {}).startswith("the Ray worker ActorWorker (node 10.0.0.5, pid 4242) died: ")
