import pytest

from cluster.placement import actor_gpu


def test_actors_use_the_gpus_learners_leave_free_round_robin():
    assert [actor_gpu(i, 8, 2) for i in range(8)] == [2, 3, 4, 5, 6, 7, 2, 3]
    assert [actor_gpu(i, 2, 1) for i in range(3)] == [1, 1, 1]


def test_actors_share_gpu_0_when_learners_take_every_gpu():
    assert [actor_gpu(i, 1, 1) for i in range(3)] == [0, 0, 0]
    assert actor_gpu(5, 4, 4) == 0
    with pytest.raises(ValueError):
        actor_gpu(0, 0, 1)


def test_a_call_cut_short_by_our_own_restart_is_not_a_new_death():
    """Seen on the H200: an actor raised, the launcher killed it for a clean restart and queued
    run(); Ray answered "The actor was restarted" a second later, and that was counted as a second
    death (2 of 3 restarts spent on one failure)."""
    from cluster.supervision import RESPAWN_RACE_S, resubmitted_too_early

    restarted = ("The actor 0971 is unavailable: The actor is temporarily unavailable: IOError: The actor was "
                 "restarted. The task may or may not have been executed on the actor.")
    assert resubmitted_too_early(restarted, 1.2)
    assert not resubmitted_too_early(restarted, RESPAWN_RACE_S + 1)  # long after: a real death of its own
    assert not resubmitted_too_early(restarted, float("inf"))  # never restarted by us
    assert resubmitted_too_early("RayActorError: The actor is restarting", float("inf"))
    assert not resubmitted_too_early("RuntimeError: actor-1 failed: ValueError: No available memory", 0.5)


def test_the_call_reaching_a_silent_actor_we_just_killed_is_not_a_new_death():
    """Seen on 2 CPU cores: the launcher SIGKILLed a SIGSTOPped actor and queued run() at once; Ray sent it to the
    dead process before noticing the death and answered "temporarily unavailable" 1.5 s later, counted as a second
    death (with cluster.max_restarts=1 the actor was dropped instead of restarted)."""
    from cluster.supervision import RESPAWN_RACE_S, resubmitted_too_early

    reset = ("The actor 750b is unavailable: The actor is temporarily unavailable: RpcError: RPC error: "
             "recvmsg:Connection reset by peer rpc_code: 14. The task may or may not have been executed on the actor.")
    assert resubmitted_too_early(reset, 1.5)
    assert not resubmitted_too_early(reset, RESPAWN_RACE_S + 1)   # long after our kill: a death of its own
    assert not resubmitted_too_early(reset, float("inf"))          # never killed by us
    assert not resubmitted_too_early("RuntimeError: actor-1 failed: ValueError: No available memory", 0.5)
