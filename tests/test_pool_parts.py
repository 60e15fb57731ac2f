"""The parts a PagePool is built from, each on its own: slots, the write queue, recent keys and the
eviction order."""

import pytest

from kvcr.proto.eviction import down_to_watermark, victims
from kvcr.proto.page import Keep, Page, State
from kvcr.proto.recent_keys import RecentKeys
from kvcr.proto.slots import SlotTable
from kvcr.proto.write_queue import WriteQueue

pytestmark = pytest.mark.pure


def ready(key, slot, keep=Keep.NONE):
    page = Page(key, slot, 1, None)
    page.state, page.keep = State.READY, keep
    return page


def test_a_freed_slot_comes_back_under_a_new_generation():
    slots = SlotTable(2)
    (a, gen_a), (b, _) = slots.take(), slots.take()
    assert (a, b) == (0, 1) and slots.num_free == 0
    slots.free(a)
    assert slots.generation(a) != gen_a and slots.take() == (a, gen_a + 2)
    with pytest.raises(IndexError):
        slots.take()


def test_a_quarantined_slot_is_counted_and_never_free_again():
    slots = SlotTable(1)
    slot, _ = slots.take()
    slots.quarantine(slot)
    assert (slots.num_free, slots.num_used, slots.num_quarantined) == (0, 1, 1)


def test_recent_keys_forget_the_oldest_first_and_a_repeat_counts_as_new():
    recent = RecentKeys(2)
    recent.update(["a", "b"])
    recent.add("a")  # "b" is now the oldest
    recent.add("c")
    assert "a" in recent and "c" in recent and "b" not in recent


def test_the_write_queue_hands_out_pages_in_commit_order_and_times_the_oldest():
    queue, pages = WriteQueue(), {k: ready(k, i) for i, k in enumerate("abc")}
    for t, key in enumerate("abc"):
        queue.queue(key, float(t))
    assert queue.oldest(2) == ["a", "b"]
    queue.begin([pages["a"]])
    assert "a" not in queue and queue.is_writing(0) and len(queue) == 3 and queue.oldest_since() == 0.0
    queue.end(0)
    assert queue.discard("b") and not queue.discard("b")
    assert len(queue) == 1 and queue.oldest_since() == 2.0


@pytest.mark.parametrize("dirty, expected", [(False, ["clean", "unkept"]), (True, ["clean", "unkept", "queued"])])
def test_eviction_takes_clean_pages_then_unkept_ones_then_dirty_ones_only_when_asked(dirty, expected):
    pages = {"queued": ready("queued", 0, Keep.DIRTY), "unkept": ready("unkept", 1, Keep.WRITE_FAILED),
             "writing": ready("writing", 2, Keep.DIRTY), "clean": ready("clean", 3, Keep.CLEAN)}
    chosen = victims(list(pages), pages, 4, (), lower=True, writing=lambda slot: slot == 2, dirty=dirty)
    assert [p.key for p in chosen] == expected


def test_the_watermark_stops_at_the_first_dirty_page_and_skips_protected_ones():
    pages = {"a": ready("a", 0, Keep.CLEAN), "b": ready("b", 1, Keep.CLEAN), "c": ready("c", 2, Keep.DIRTY),
             "d": ready("d", 3, Keep.CLEAN)}
    assert [p.key for p in down_to_watermark(list(pages), pages, 4, {"a"})] == ["b"]
