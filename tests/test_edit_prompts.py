"""The `edits` prompt set (inference/bench/edit_prompts.py): ShareGPT requests for an edit whose reference
answer copies the prompt, each text once, and the rule that picks them."""

from drafthead.inference.bench.edit_prompts import COPIED, EDITS, copied_share, edit_prompts, is_edit
from drafthead.train.data.sources import sharegpt_chats

TEXT = " ".join(f"word{i}" for i in range(120))


def test_the_copied_share_counts_the_answers_4grams_found_in_the_prompt():
    assert copied_share("Fix this: " + TEXT, TEXT) == 1.0
    assert copied_share("Fix this: " + TEXT, "something else entirely, said in other words") == 0.0
    half = " ".join(TEXT.split()[:60]) + " " + " ".join(f"new{i}" for i in range(60))
    assert 0.4 < copied_share(TEXT, half) < 0.55
    assert copied_share(TEXT, "too short") == 0.0


def test_an_edit_asks_near_its_start_holds_a_text_and_is_answered_by_a_copy():
    assert is_edit("Please proofread this email:\n" + TEXT, TEXT)
    assert not is_edit("Tell me about this:\n" + TEXT, TEXT)  # no edit verb
    assert not is_edit(TEXT + " please rewrite it", TEXT)  # the verb comes after the text
    assert not is_edit("Rewrite: short", "short")  # no text to edit
    assert not is_edit("Rewrite this email:\n" + TEXT, "a new text " * 30)  # the answer copies nothing


def test_the_set_is_built_from_the_installed_sharegpt():
    prompts = edit_prompts(sharegpt_chats())
    assert len(prompts) >= 20
    assert len({p.text for p in prompts}) == len(prompts) and all(p.category == EDITS for p in prompts)
    assert [p.id for p in edit_prompts(sharegpt_chats(), 3)] == [p.id for p in prompts[:3]]
    assert COPIED > 0
