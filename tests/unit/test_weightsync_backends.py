"""weightsync/backends.py: one rule for `auto`, one table of publisher and subscriber classes."""
from __future__ import annotations

import pytest

from weightsync.backends import BACKENDS, _cls, resolve

pytestmark = pytest.mark.unit


def test_auto_follows_where_processes_sit():
    def auto(**kw):
        return resolve("auto", **kw)

    assert auto(learner_on_cuda=True, actors_on_cuda=True, n_gpus=1, learners=1) == "cuda_ipc"
    assert auto(learner_on_cuda=True, actors_on_cuda=True, n_gpus=2, learners=1) == "nccl"
    assert auto(learner_on_cuda=True, actors_on_cuda=True, n_gpus=2, learners=2) == "cuda_ipc"
    assert auto(learner_on_cuda=True, actors_on_cuda=False, n_gpus=2, learners=1) == "gloo"
    assert auto(learner_on_cuda=False, actors_on_cuda=False, n_gpus=0, learners=1) == "gloo"
    # placement-group bundles never share a GPU: actors are elsewhere, maybe on another node
    assert auto(learner_on_cuda=True, actors_on_cuda=True, n_gpus=1, learners=1, spread=True) == "nccl"
    assert auto(learner_on_cuda=False, actors_on_cuda=True, n_gpus=4, learners=1, spread=True) == "gloo"


def test_a_named_backend_is_kept_and_an_unknown_one_refused():
    assert resolve("gloo", learner_on_cuda=True, actors_on_cuda=True, n_gpus=1, learners=1) == "gloo"
    with pytest.raises(ValueError, match="unknown weight backend 'tcp'"):
        resolve("tcp", learner_on_cuda=False, actors_on_cuda=False, n_gpus=0, learners=1)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_names_real_classes_taking_the_listed_arguments(name):
    import inspect

    for which in (0, 1):
        cls, kw = _cls(name, which)
        params = inspect.signature(cls.__init__).parameters
        assert "timeout_s" in params and all(k in params for k in kw), (name, which, list(params))


def test_a_receive_shortens_the_gil_switch_interval_until_the_version_is_in():
    """While a version arrives the receiving thread gets the GIL within RECEIVE_SWITCH_S at each blocking point
    (an engine loop holds it otherwise for Python's 5 ms); afterwards the interval is what it was, and a process
    that already runs a shorter one keeps it."""
    import sys

    from weightsync import core

    class Sub(core.WeightSubscriber):   # the base's bookkeeping alone: no threads, no Redis
        def __init__(self):
            self._switch = self._since = None

        def _receive_loop(self):
            pass

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        s = Sub()
        s._receiving()
        assert sys.getswitchinterval() == pytest.approx(core.RECEIVE_SWITCH_S)
        s._receiving()   # a second message of the same version: nothing more to save
        s._received()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        s._received()    # idle again: nothing to restore
        assert sys.getswitchinterval() == pytest.approx(0.005)
        sys.setswitchinterval(1e-4)   # already shorter: left alone
        s._receiving()
        s._received()
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    finally:
        sys.setswitchinterval(before)


def test_a_receives_phases_add_up_across_versions():
    import time

    from weightsync import core

    class Sub(core.WeightSubscriber):   # the base's bookkeeping alone: no threads, no Redis
        def __init__(self):
            self.phase_s, self._version_phase_s = {}, {}

        def _receive_loop(self):
            pass

    s = Sub()
    t0 = time.monotonic() - 0.5
    t1 = s._timed("copy", t0)
    s._timed("copy", t1 - 0.25)
    s._timed("ack", t1)
    assert s.phase_s["copy"] == pytest.approx(0.75, abs=0.05) and 0 <= s.phase_s["ack"] < 0.05
    assert s._version_phase_s == s.phase_s   # the version's own, for its log line (reset once it is delivered)


def test_a_cuda_ipc_copy_is_timed_as_the_senders_part_and_its_own_from_one_wait(monkeypatch):
    """The member's one host wait per bucket is split, without a second wait, into `sender` (until its stream passed
    the publisher's writes) and `copy` (the GPU's time between two timed events): the two add up to the wait."""
    import time

    import torch

    from weightsync import cuda_ipc

    order = []

    class Event:   # the GPU's clock: the copy and fingerprints took 20 ms after the stream passed `ready`
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream):
            order.append("record")

        def synchronize(self):
            order.append("wait")
            time.sleep(0.05)

        def elapsed_time(self, other):
            return 20.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    sub = cuda_ipc.CudaIpcSubscriber.__new__(cuda_ipc.CudaIpcSubscriber)
    sub.device, sub.phase_s, sub._version_phase_s = torch.device("cpu"), {}, {}
    src, dst = torch.arange(4.0), torch.zeros(4)
    t0 = time.monotonic()
    end = sub._copy_in(src, dst, lambda: order.append("fingerprint"), t0)
    assert torch.equal(dst, src) and order == ["record", "fingerprint", "record", "wait"]
    assert sub.phase_s["copy"] == pytest.approx(0.02)
    assert sub.phase_s["sender"] + sub.phase_s["copy"] == pytest.approx(end - t0) and sub.phase_s["sender"] >= 0.03
