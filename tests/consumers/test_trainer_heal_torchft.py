"""A heal through real torchft, in one process: two elastic trainers (threads), each with
its own torchft Manager at a real lighthouse. The second joins after the first took three
steps; the quorum heals it with the first one's `Trainer.state_dict()` over torchft's
checkpoint transport, and from then on both train one model."""

import queue
import threading
import time

import pytest
import torch
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks
from dflash.consumers.training.config import TrainConfig

pytestmark = pytest.mark.integration

pytest.importorskip("torchft")

LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                  lr=1e-3, save_every=0, log_position_every=0, stage_batches=False)


class Source:
    """A rank's batches as the broker link gives them: None while nothing came, the end
    once `done` is set and all were handed out."""

    def __init__(self, done: threading.Event):
        self.q: queue.Queue = queue.Queue()
        self.done = done

    def __iter__(self):
        while True:
            try:
                yield self.q.get(timeout=0.2)
            except queue.Empty:
                if self.done.is_set():
                    return
                yield None


def _wait(pred, timeout_s: float, what: str, errors: list):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert not errors, f"a trainer failed while waiting for {what}: {errors[0]!r}"
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.timeout(400)
def test_a_late_replica_is_healed_with_the_running_ones_state_and_both_train_one_model(heads):
    from dflash.broker import lighthouse
    from dflash.consumers.parallel.elastic import ElasticDist, replica_name

    torch.set_num_threads(1)
    lh = lighthouse.start("127.0.0.1", 0, "127.0.0.1", timeout_s=20)
    done, errors, acked, states, dists = threading.Event(), [], {0: [], 1: []}, {}, {}
    sources = {0: Source(done), 1: Source(done)}

    def run(r: int) -> None:
        try:
            dists[r] = d = ElasticDist.join(lighthouse=lh.address, replica=replica_name(r, "heal"), host="127.0.0.1",
                                            device=torch.device("cpu"), rank=r, max_world=1, timeout_s=120,
                                            quorum_timeout_s=120, connect_timeout_s=20)
            states[r] = train(CFG, heads, sources[r], dist=d,
                              hooks=Hooks(on_step=lambda s, ids: acked[r].extend((s, i) for i in ids)))
        except BaseException as e:  # the main thread asserts on it
            errors.append(e)

    batch = iter(random_batch(heads.spec, LAYERS, [12, 9], seed=i, batch_id=f"b{i}", sample_start=2 * i)
                 for i in range(100))
    threads = {r: threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)}
    try:
        with capture_logs() as logs:
            threads[0].start()
            for _ in range(3):
                sources[0].q.put(next(batch))
            _wait(lambda: len(acked[0]) == 3, 240, "the first replica's three steps", errors)
            threads[1].start()
            _wait(lambda: any(e["event"] == "train.healed" and e.get("step") == 3 for e in logs), 240,
                  "the late replica's heal", errors)
            for _ in range(2):  # two steps of both
                for r in (0, 1):
                    sources[r].q.put(next(batch))
            _wait(lambda: len(acked[1]) == 2 and len(acked[0]) == 5, 240, "two steps of both", errors)
            done.set()
            for t in threads.values():
                t.join(120)
        assert not errors, errors
        healed = [e for e in logs if e["event"] == "train.healed" and e.get("step") == 3]
        assert healed and healed[0]["previous_step"] == 0 and healed[0]["record_samples"] == 6
        a, b = states[0], states[1]
        # (a rank whose batch came a quorum late took an empty step meanwhile: >= 5 steps)
        assert a.step == b.step >= 5 and a.samples == b.samples == 3 * 2 + 4 * 2
        for pa, pb in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(pa, pb)  # one model: healed, then every step summed over both
        assert a.record.count() == b.record.count() == 14 and a.record.lineage == b.record.lineage
        assert all(s > 3 for s, _ in acked[1])  # the late one trained only after the heal
    finally:
        done.set()
        for d in dists.values():
            d.close()
        lh.close()
