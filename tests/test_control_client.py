"""The control client's wait for a reply: first without sleeping (`spin_s`), never past its timeout."""

import threading
import time

import pytest
import zmq

from kvcr.client import ControlClient
from kvcr.proto import messages as m


@pytest.fixture
def router():
    """A ZMQ ROUTER on loopback; `answer` decides, per request, the reply (None: stay silent)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    state = {"answer": lambda msg: None, "stop": False}

    def serve():
        while not state["stop"]:
            if not sock.poll(20):
                continue
            ident, *_, payload = sock.recv_multipart()
            msg = m.decode(payload)
            reply = state["answer"](msg)
            if reply is not None:
                sock.send_multipart([ident, b"", m.encode(reply, request_id=msg.request_id)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield endpoint, state
    state["stop"] = True
    thread.join(5)
    sock.close()


@pytest.mark.parametrize("spin_s", [0.0, 0.001, 5.0])
def test_a_silent_peer_times_out_at_the_request_timeout_whatever_the_spin(router, spin_s):
    endpoint, _ = router
    with ControlClient(endpoint, timeout_s=0.2, spin_s=spin_s, local=False) as client:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no reply"):
            client.request(m.ReleaseRequest(claim_id=1))
        assert time.monotonic() - started < 4.0  # the 5 s spin is cut at the 0.2 s timeout


@pytest.mark.parametrize("spin_s", [0.0, 0.001, 5.0])
@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_a_reply_is_taken_whether_it_comes_inside_the_spin_or_after_it(router, spin_s, delay_s):
    endpoint, state = router
    state["answer"] = lambda msg: time.sleep(delay_s) or m.Released(live=[True, False])
    with ControlClient(endpoint, timeout_s=5.0, spin_s=spin_s, local=False) as client:
        for _ in range(3):
            assert client.request(m.ReleaseRequest(claim_id=1)).live == [True, False]
