"""The atheris campaigns' corpora (`make fuzz`, tests/fuzz/) replayed through the same targets:
every input that once reached new code in a decoder still decodes or is refused by name."""

import pytest

from tests.fuzz.targets import TARGETS, corpus

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_corpus_input_decodes_or_is_refused_by_name(name):
    inputs = corpus(name)
    assert inputs, f"tests/fuzz/corpus/{name} is empty: run `make fuzz`"
    for path in inputs:
        TARGETS[name].run(path.read_bytes())


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_targets_seeds_are_accepted(name):
    target = TARGETS[name]
    for data in target.seeds():
        target.decode(data)  # a valid input: no refusal


def test_a_refusal_without_a_message_is_a_finding():
    from tests.fuzz.targets import Finding, Target

    def silent(data):
        raise ValueError("")

    with pytest.raises(Finding, match="ValueError without a message"):
        Target("silent", silent, ValueError, list).run(b"x")
