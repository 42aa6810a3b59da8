"""Your own admission policy, property-tested with hypothesis, then used in a real run.

The policy: at most ``cap`` groups of one task domain in flight, so a slow domain cannot fill
every slot. It subclasses ``SampleBuffer`` (the staleness buffer: a pure state machine, no I/O)
and keeps its protocol; the test drives it the way the controller does (admit, generate a turn,
finish, take a batch, train) in random orders and checks the cap and the staleness bound.
Run it with ``pytest examples/admission_policy.py``; use the policy with
``rollart.open_cluster(scenario, buffer_class=DomainCapBuffer)``.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.buffer.sample import Sample


class DomainCapBuffer(SampleBuffer):
    """Admission: at most ``cap`` groups of one domain in flight."""

    cap = 1

    def try_start_group(self, group_key, domain="default", alpha=None):
        if self.groups_in_flight_by_domain().get(domain, 0) >= self.cap:
            return None  # admission paused for this domain; the controller picks again
        return super().try_start_group(group_key, domain, alpha)


OPS = st.lists(st.tuples(st.sampled_from(["admit", "turn", "finish", "train"]),
                         st.sampled_from(["math", "game"]), st.integers(0, 7)), max_size=80)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_cap_and_staleness_bound_hold(ops):
    buf = DomainCapBuffer(alpha=1, batch_size=4, group_size=2)
    first_version = {}  # running trajectory -> version of its first generated token
    n = 0
    for op, domain, pick in ops:
        if op == "admit":
            for tid in buf.try_start_group(f"g{n}", domain) or []:
                first_version[tid] = None
            n += 1
        elif op in ("turn", "finish") and first_version:
            tid = sorted(first_version)[pick % len(first_version)]
            verdict = buf.begin_turn(tid, buf.version)
            if verdict == "restart":
                del first_version[tid]
                fresh = buf.restart_trajectory(tid)
                if fresh is not None:
                    first_version[fresh] = None
            elif verdict == "cancel":
                del first_version[tid]
                buf.cancel(tid)
            elif verdict == "continue":
                if first_version[tid] is None:
                    first_version[tid] = buf.version
                    buf.record_tokens(tid, [buf.version])
                if op == "finish":
                    v = first_version.pop(tid)
                    buf.complete(tid, Sample(
                        sample_id=tid, group_key=buf.group_of(tid), token_ids=[1, 2],
                        loss_mask=[0, 1], behaviour_logprobs=[-1.0], versions=[v],
                        reward=1.0))
        elif op == "train":
            batch = buf.take_batch()
            if batch is not None:
                assert all(buf.version - s.min_version <= buf.alpha for s in batch)
                buf.advance_version()
        for tid in buf.drain_restarts():
            first_version[tid] = None
        assert all(k <= DomainCapBuffer.cap for k in buf.groups_in_flight_by_domain().values())
