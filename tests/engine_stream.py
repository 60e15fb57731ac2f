"""An engine-format event publisher (seq from 0, replay buffer): a real EventPublisher standing in
for SGLang's or vLLM's stream where the test needs to choose every event."""

import zmq

from kvcr.drivers.zmq_events import EventPublisher, SeqSource

class FakeEngine:
    """An engine-format publisher (seq from 0, replay buffer), standing in for SGLang/vLLM."""

    def __init__(self, endpoint="tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0"):
        self.ctx = zmq.Context()
        self.pub = EventPublisher(self.ctx, endpoint=endpoint, replay_endpoint=replay,
                                  seq=SeqSource(now_us=0), heartbeat_s=0)
        self.pub.start()

    def send(self, *events):
        return self.pub.publish(events)

    def close(self):
        self.pub.stop()
        self.ctx.term()
