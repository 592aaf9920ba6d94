import pytest

from cluster.placement import actor_gpu, weight_backend


def test_actors_use_the_gpus_learners_leave_free_round_robin():
    assert [actor_gpu(i, 8, 2) for i in range(8)] == [2, 3, 4, 5, 6, 7, 2, 3]
    assert [actor_gpu(i, 2, 1) for i in range(3)] == [1, 1, 1]


def test_actors_share_gpu_0_when_learners_take_every_gpu():
    assert [actor_gpu(i, 1, 1) for i in range(3)] == [0, 0, 0]
    assert actor_gpu(5, 4, 4) == 0
    with pytest.raises(ValueError):
        actor_gpu(0, 0, 1)


def test_backend_follows_placement():
    assert weight_backend(learner_on_cuda=True, actors_on_cuda=True, n_gpus=1, learners=1) == "cuda_ipc"
    assert weight_backend(learner_on_cuda=True, actors_on_cuda=True, n_gpus=2, learners=1) == "nccl"
    assert weight_backend(learner_on_cuda=True, actors_on_cuda=True, n_gpus=2, learners=2) == "cuda_ipc"
    assert weight_backend(learner_on_cuda=True, actors_on_cuda=False, n_gpus=2, learners=1) == "gloo"
    assert weight_backend(learner_on_cuda=False, actors_on_cuda=False, n_gpus=0, learners=1) == "gloo"
