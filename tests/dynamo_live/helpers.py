"""What the Dynamo frontend tests import besides fixtures: the model and block size the workers
serve, prompts and their full blocks, a request's tenant, and requests that make a worker busy."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

from kvcr.dynamo.local import poll as wait_for  # noqa: F401 (tests import it from here)
from kvcr.text import TextTokenizer

if TYPE_CHECKING:
    from kvcr.demo.procs import Child as DynamoWorker  # conftest.py's DynamoWorker is one
    from kvcr.dynamo.local import Frontend, Probe


BLOCK = 16


MODEL = "kvcr-tiny-l2-h64-s0"  # the worker's name for SMALL_MODEL with seed 0


NAMESPACE = "kvcr"


TOKENIZER = TextTokenizer()  # the kvcr worker's bundled one: Dynamo's frontend tokenizes the same


def prompt(tag: str, words: int = 120) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def full_blocks(text: str) -> int:
    return len(TOKENIZER.encode(text)) // BLOCK


def salted(salt: str | None) -> dict:
    """A completion's fields for a tenant: Dynamo takes its cache salt in `nvext`."""
    return {"nvext": {"cache_salt": salt}} if salt is not None else {}


def first_holder(fe: Frontend, workers: list, probe: Probe, text: str, salt: str | None = None) -> tuple:
    """Send `text` through Dynamo; (the worker it chose, the other one), once Dynamo indexed the pages."""
    fe.complete(text, **salted(salt))
    holder = next(w for w in workers if w.served() == 1)
    wait_for(lambda: holder.held(probe, text, salt).get("host") == full_blocks(text), 10,
             "the prefix in Dynamo's index")
    return holder, next(w for w in workers if w is not holder)


@contextlib.contextmanager
def busy(fe: Frontend, worker: DynamoWorker, prefix: str, salt: str | None = None):
    """A long request sharing `prefix` in flight on `worker` (its holder): Dynamo counts its blocks as
    load, so a short request on the prefix goes to the other worker, with a hint naming this one."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fe.complete(prefix + " " + " ".join(f"tail{i}" for i in range(700)), max_tokens=600, ignore_eos=True,
                        **salted(salt))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: worker.stats()["inflight"] >= 1 or not thread.is_alive(), 60, f"{worker.name} busy")
        assert thread.is_alive(), f"the long request ended before the test ran: {errors}"
        yield
        assert thread.is_alive(), "the long request ended before the test's request was routed: make it longer"
    finally:
        thread.join(300)
    assert not errors, errors
