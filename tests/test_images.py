"""Images in the prompt of a vision-language target (ground/target/media.py; docs/families.md
"Images in the prompt"): tiny random Gemma-3, Qwen2.5-VL and Qwen3-VL targets with random images.

Greedy output equals transformers' own generate() given the same images, at batch 1 and for a
ragged batch of 3 whose rows hold images of different grids and one text-only prompt, with prompt
lookup and a draft model, and steered to accept depth >= 2 with rows of different lengths
(tests/oracle.py). The images change the output (decoding without them gives other tokens). A
tree's logits equal a plain forward over the prompt, its image and the path, and the controls
take out each mechanism: Qwen's rope delta, Gemma's image token types.
"""

from __future__ import annotations

import pytest
import torch

from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.ground.target import media
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.torch_target import TorchTarget
from drafthead.inference.engine.tree import DraftTree, chain_parents
from tests.oracle import assert_accepts_and_stays_exact
from tests.tiny import MULTIMODAL, image_prompt, left_padded, plain_greedy_with_images, repetitive_prompt, tiny_causal_lm

V, NEW = 96, 16
FAMILIES = sorted(MULTIMODAL)
TREE = [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]


def ragged_rows(family: str):
    """Three prompts: an image of 4x4 patches, a text-only one, an image of 2x4 patches (Qwen)."""
    rows = [
        image_prompt(family, text=2, seed=2),
        (repetitive_prompt(V, length=8, seed=3)[0], None),
        image_prompt(family, text=10, seed=10, grid=(1, 2, 4)),
    ]
    return [p for p, _ in rows], [im for _, im in rows]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_an_image_in_the_prompt_equals_plain_greedy(family):
    target = tiny_causal_lm(family, vocab=V, layers=4)
    prompt, images = image_prompt(family)
    reference = plain_greedy_with_images(target, prompt, images, NEW)
    without = speculative_generate(target, PromptLookupDrafter(length=4), prompt[None], GenerationConfig(max_new_tokens=NEW))
    assert without.new_tokens[0].tolist() != reference  # the image matters to the output
    prompts, row_images = ragged_rows(family)
    references = [plain_greedy_with_images(target, p, im, NEW) for p, im in zip(prompts, row_images)]
    ids, mask = left_padded(prompts)
    draft = tiny_causal_lm("llama", vocab=V, seed=7, layers=2)
    for drafter_of in (lambda: PromptLookupDrafter(length=4), lambda: DraftModelDrafter(draft, choices=TREE)):
        result = speculative_generate(target, drafter_of(), prompt[None], GenerationConfig(max_new_tokens=NEW), images=images)
        assert result.new_tokens[0].tolist() == reference
        batched = speculative_generate(target, drafter_of(), ids, GenerationConfig(max_new_tokens=NEW), attention_mask=mask, images=row_images)
        assert [row.new_tokens[0].tolist() for row in batched.rows] == references
    assert_accepts_and_stays_exact(
        target,
        lambda: DraftModelDrafter(draft, choices=TREE),
        prompt[None],
        reference,
        prompts,
        references,
        ids,
        mask,
        NEW,
        NEW,
        lambda new: GenerationConfig(max_new_tokens=new),
        images=images,
        batch_images=row_images,
    )


def _tree_logits(target, prompts, row_images, paths):
    """The engine's verify logits [B, N, V] for a chain per row (its root, the prompt's last token,
    then `paths[b]`), after a prefill with the images."""
    backend = TorchTarget(target)
    with torch.no_grad():
        backend.start(prompts, (), False, images=row_images)
        trees = [DraftTree(torch.tensor([[int(p[-1])] + path]), chain_parents(len(path))) for p, path in zip(prompts, paths)]
        return backend.verify(trees, [p.numel() - 1 for p in prompts], False).logits


def _full_logits(target, prompt, images, path):
    """A plain forward over prompt + path with the images: logits at the prompt's last token and the path's."""
    kwargs = {"pixel_values": images.pixel_values}
    ids = torch.cat([prompt, torch.tensor(path)])[None]
    types = media.token_types(target.config, ids)
    if images.image_grid_thw is not None:
        kwargs.update(image_grid_thw=images.image_grid_thw, mm_token_type_ids=types)
    else:
        kwargs["token_type_ids"] = types.long()
    with torch.no_grad():
        return target(input_ids=ids, **kwargs).logits[0, prompt.numel() - 1 :]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_after_an_image_equal_a_plain_forward(family, monkeypatch):
    target = tiny_causal_lm(family, vocab=V, layers=4)
    prompts, row_images = ragged_rows(family)
    prompts, row_images = [prompts[0], prompts[2]], [row_images[0], row_images[2]]
    paths = [[5, 6, 7], [8, 9, 10]]
    logits = _tree_logits(target, prompts, row_images, paths)
    for b, (p, im, path) in enumerate(zip(prompts, row_images, paths)):
        torch.testing.assert_close(logits[b, : len(path) + 1], _full_logits(target, p, im, path), atol=1e-5, rtol=1e-4)

    # controls: without Qwen's rope delta, or without Gemma's image token types, the logits move
    if media.uses_mrope(target):
        real = media.prefill_inputs
        monkeypatch.setattr(
            "drafthead.inference.engine.torch_target.prefill_inputs", lambda *a: (real(*a)[0], torch.zeros(len(a[1]), dtype=torch.long))
        )
    else:
        real = media.prefill_inputs
        monkeypatch.setattr(
            "drafthead.inference.engine.torch_target.prefill_inputs",
            lambda *a: ({k: v for k, v in real(*a)[0].items() if k != "token_type_ids"}, real(*a)[1]),
        )
    wrong = _tree_logits(target, prompts, row_images, paths)
    gap = max(
        float((wrong[b, : len(path) + 1] - _full_logits(target, p, im, path)).abs().max())
        for b, (p, im, path) in enumerate(zip(prompts, row_images, paths))
    )
    assert gap > 1e-3, gap


def test_images_that_do_not_fit_the_prompt_are_refused_in_one_line():
    target = tiny_causal_lm("qwen2_5_vl", vocab=V, layers=2)
    prompt, images = image_prompt("qwen2_5_vl")
    text = repetitive_prompt(V, length=8)[0]
    cases = [
        (text, images, "has images and no image tokens"),
        (prompt, None, "image tokens and no images"),
        (torch.cat([prompt, prompt[3:5]]), images, "ends with an image token"),
    ]
    for ids, im, message in cases:
        with pytest.raises(ValueError, match=message):
            speculative_generate(target, PromptLookupDrafter(), ids[None], GenerationConfig(max_new_tokens=2), images=[im])
    with pytest.raises(ValueError, match="takes no images"):
        speculative_generate(tiny_causal_lm("llama", vocab=V), PromptLookupDrafter(), text[None], GenerationConfig(max_new_tokens=2), images=[images])


# ---------------------------------------------------------------------------------------------
# Features and training on rows with images
# ---------------------------------------------------------------------------------------------


def _layer_inputs(model, ids, kwargs):
    """Every decoder layer's real input [B, T, H], from forward pre-hooks: the ground truth the
    recorded hidden states must equal."""
    layers = model.get_decoder().layers
    seen = {}
    hooks = [
        layer.register_forward_pre_hook(lambda mod, args, kw, i=i: seen.__setitem__(i, (args or (kw["hidden_states"],))[0]), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_features_of_rows_with_images_are_each_layers_input_and_the_prefills(family):
    """The capture forward runs the vision tower: features at and after the image differ from the
    same ids without it. Each index i is layer i's real input, Qwen3-VL's deepstack included (which
    transformers' recorded states miss), and equals what the engine's prefill gives the drafters."""
    from drafthead.train.capture.features import collate, target_features

    target = tiny_causal_lm(family, vocab=V, layers=4)
    prompts, row_images = ragged_rows(family)
    samples = [{"input_ids": p, "loss_mask": torch.ones_like(p, dtype=torch.bool), "images": im} for p, im in zip(prompts, row_images)]
    batch = collate(samples)
    layers = (1, 2, 3, 4)
    feats = target_features(target, batch.input_ids, batch.attention_mask, layers, images=batch.images)
    text_only = target_features(target, batch.input_ids, batch.attention_mask, layers)
    n = prompts[0].numel()
    assert float((feats[2][0, :n] - text_only[2][0, :n]).abs().max()) > 1e-3  # the image is seen

    truth = _layer_inputs(target, batch.input_ids[:1, :n], media.forward_inputs(target, batch.input_ids[:1, :n], batch.images[:1]))
    for i in (1, 2, 3):
        torch.testing.assert_close(feats[i][0, :n], truth[i][0], atol=1e-5, rtol=1e-4)

    backend = TorchTarget(target)
    with torch.no_grad():
        hidden = backend.start(prompts, layers, False, images=row_images)
    for b, p in enumerate(prompts):
        for i in (1, 2, 3):
            torch.testing.assert_close(hidden[i][b, : p.numel() - 1], feats[i][b, : p.numel() - 1], atol=1e-5, rtol=1e-4)


def test_negative_control_qwen3_vl_recorded_states_miss_the_deepstack():
    """Without putting the deepstack back, index 1 is not layer 1's input at the image tokens."""
    target = tiny_causal_lm("qwen3_vl", vocab=V, layers=4)
    prompt, images = image_prompt("qwen3_vl")
    kwargs = media.forward_inputs(target, prompt[None], [images])
    with torch.no_grad():
        recorded = target(input_ids=prompt[None], **kwargs, output_hidden_states=True).hidden_states
    truth = _layer_inputs(target, prompt[None], kwargs)
    assert float((recorded[1][0] - truth[1][0]).abs().max()) > 1e-3


KINDS = {
    "medusa1": {"num_heads": 2},
    "hydra": {"num_heads": 2},
    "eagle1": {},
    "eagle3": {"draft_vocab_size": 64, "ttt_steps": 2, "aux_layers": (1, 2, 3)},
    "eagle31": {"draft_vocab_size": 64, "ttt_steps": 2, "aux_layers": (1, 2, 3)},
    "peagle": {"draft_vocab_size": 64, "parallel_depth": 3, "mask_token_id": V - 5, "aux_layers": (1, 2, 3)},
    "dflash": {"block_size": 4, "mask_token_id": V - 5, "num_anchors": 4},
    "dspark": {"block_size": 4, "mask_token_id": V - 5, "num_anchors": 4, "markov_rank": 8},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_head_kind_trains_on_rows_with_images_and_decodes_exactly(family, kind):
    """Three optimizer steps on features captured with the images give finite losses; the head
    then drafts for prompts with images at B=1 and ragged B=3, with its own drafts and steered to
    accept depth >= 2 and ragged lengths, and the output stays the target's. (Medusa-2 adapts the
    target on text rows only: refused in one line, tests/test_images.py below.)"""
    import math

    from drafthead.heads.registry import build_head, make_config
    from drafthead.inference.drafters.load import head_drafter
    from drafthead.train.capture.features import OnlineFeaturizer, collate

    target = tiny_causal_lm(family, vocab=V, layers=4)
    torch.manual_seed(0)
    head = build_head(
        make_config(kind, target, None, name=f"tiny-{family}", **KINDS[kind]), target, token_counts=torch.arange(V), dtype=torch.float32
    )
    prompts, row_images = ragged_rows(family)
    samples = [{"input_ids": p, "loss_mask": torch.arange(p.numel()) >= p.numel() // 2, "images": im} for p, im in zip(prompts, row_images)]
    batch = OnlineFeaturizer(target, head.config.train_hidden_layers)(collate(samples))
    head.train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss, _ = head.compute_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
    head.eval()

    prompt, images = image_prompt(family)
    reference = plain_greedy_with_images(target, prompt, images, NEW)
    references = [plain_greedy_with_images(target, p, im, NEW) for p, im in zip(prompts, row_images)]
    ids, mask = left_padded(prompts)
    own = speculative_generate(target, head_drafter(head), prompt[None], GenerationConfig(max_new_tokens=NEW), images=images)
    assert own.new_tokens[0].tolist() == reference  # the head's own drafts
    batched = speculative_generate(target, head_drafter(head), ids, GenerationConfig(max_new_tokens=NEW), attention_mask=mask, images=row_images)
    assert [row.new_tokens[0].tolist() for row in batched.rows] == references
    assert_accepts_and_stays_exact(
        target,
        lambda: head_drafter(head),
        prompt[None],
        reference,
        prompts,
        references,
        ids,
        mask,
        NEW,
        NEW,
        lambda new: GenerationConfig(max_new_tokens=new),
        images=images,
        batch_images=row_images,
    )


# ---------------------------------------------------------------------------------------------
# Chats with images: records -> the target's processor -> training (train/data/image_chats.py)
# ---------------------------------------------------------------------------------------------


def write_image_chats(folder, n: int = 8):
    """LLaVA-style records (an `image` path beside the file, `<image>` in the first human turn, or
    none: LLaVA's default place), their PNG images random 40x56 pictures, and one text-only record."""
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    records = []
    for i in range(n):
        name = f"img{i}.png"
        Image.fromarray((rng.random((40, 56, 3)) * 255).astype("uint8")).save(folder / name)
        ask = "<image>\nWhat is in this picture?" if i % 2 else "Describe the picture."
        records.append(
            {
                "id": f"c{i}",
                "image": name,
                "conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": f"A picture of noise, number {i}."}],
            }
        )
    records.append({"id": "text", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]})
    records.append({"id": "bad", "image": "missing.png", "conversations": [{"from": "human", "value": "<image> x"}, {"from": "gpt", "value": "y"}]})
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_image_chats_are_formatted_by_the_targets_processor_and_train(tmp_path):
    """Each image becomes the processor's tokens (begin, 4 image tokens, end) in the user turn; the
    labels are the answers' tokens, as for the same chat without the image; a record whose image
    file is missing is dropped and counted; the trainer's online features see the pixels; a head
    trains with finite losses and decodes the target's output for a prompt with an image."""
    import math

    from drafthead.heads.batch import FeatureBatch  # noqa: F401  (the batch type the trainer builds)
    from drafthead.inference.drafters.load import load_head_drafter
    from drafthead.ground.target.load import load_target
    from drafthead.train.data.chat_format import format_conversation
    from drafthead.train.loop.config import TrainConfig
    from drafthead.train.data.image_chats import load_processor, prompt_images
    from drafthead.train.loop.run import token_samples
    from tests.conftest import save_tiny_vlm
    from tests.tiny_training import train_three_steps

    folder = save_tiny_vlm(tmp_path / "vlm")
    chats = write_image_chats(tmp_path)
    config = TrainConfig.from_dict(
        dict(
            target=str(folder),
            head={"kind": "eagle3", "draft_vocab_size": 64, "ttt_steps": 2},
            report_to="none",
            output_dir=str(tmp_path / "run"),
            data={"source": "json", "path": str(chats), "max_length": 256, "eval_fraction": 0.0},
        )
    )
    loaded = load_target(folder)
    samples = token_samples(config, loaded.tokenizer)
    assert samples.source_report.dropped_conversations == {"image_missing": 1}
    assert len(samples.dataset) == 9
    processor = load_processor(str(folder))
    image_id = loaded.model.config.image_token_index
    for i in range(8):
        sample = samples.dataset[i]
        ids = sample["input_ids"]
        assert int((ids == image_id).sum()) == 4 and sample["images"].pixel_values.shape == (1, 3, 28, 28)
        text = format_conversation(
            loaded.tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": f"A picture of noise, number {i}."}], 256
        )
        labelled = [int(t) for t, m in zip(text.input_ids, text.loss_mask) if m]
        assert ids[sample["loss_mask"]].tolist() == labelled  # the answer's tokens, nothing of the image
        torch.testing.assert_close(sample["images"].pixel_values, prompt_images(processor, [str(tmp_path / f"img{i}.png")]).pixel_values)
    assert "images" not in samples.dataset[8]  # the text-only record

    result, losses = train_three_steps(
        folder, loaded, {"kind": "eagle3", "draft_vocab_size": 64, "ttt_steps": 2}, chats, tmp_path / "run", "tiny-vlm", max_length=256
    )
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    drafter, target = load_head_drafter(result.final_dir, loaded.model, loaded.tokenizer, target_name="tiny-vlm")
    sample = samples.dataset[1]
    first_label = int(sample["loss_mask"].nonzero()[0])
    prompt = sample["input_ids"][:first_label]
    reference = plain_greedy_with_images(target, prompt, sample["images"], NEW)
    out = speculative_generate(target, drafter, prompt[None], GenerationConfig(max_new_tokens=NEW), images=sample["images"])
    assert out.new_tokens[0].tolist() == reference


def test_chats_with_images_are_refused_in_one_line_where_not_built(tmp_path):
    """Streaming (no processor), a target folder without one, Medusa-2's joint training: each
    refused in one line before any step."""
    from drafthead.ground.target.load import load_target
    from drafthead.train.data.chat_format import format_row
    from drafthead.train.loop.config import ConfigError
    from drafthead.train.data.image_chats import load_processor
    from tests.conftest import save_tiny_vlm
    from tests.tiny_training import train_three_steps

    folder = save_tiny_vlm(tmp_path / "vlm")
    with pytest.raises(ConfigError, match="medusa2 adapts the target on text rows"):
        train_three_steps(
            folder,
            load_target(folder),
            {"kind": "medusa2", "num_heads": 2},
            write_image_chats(tmp_path),
            tmp_path / "run",
            "tiny-vlm",
            max_length=256,
        )

    row = {"id": "a", "messages": [{"role": "user", "content": "<image> x"}, {"role": "assistant", "content": "y"}], "images": ["/nonexistent.png"]}
    with pytest.raises(ValueError, match="has images: they need the target's processor"):
        format_row(None, row, 64)
    from tests.conftest import save_tiny_target

    with pytest.raises(ValueError, match="has no processor that loads|has no image processor"):
        load_processor(str(save_tiny_target(tmp_path / "llama")))


def test_generate_command_answers_a_prompt_with_an_image(tmp_path, capsys):
    """`drafthead generate --image`: the target's processor renders the image before the prompt's
    text; the printed answer is the target's own greedy answer with that image, and a missing
    image file is one line before any model loads."""
    import numpy as np
    from PIL import Image

    from drafthead import cli
    from drafthead.ground.target.load import load_target
    from drafthead.train.data.image_chats import encode_image_prompt, load_processor
    from tests.conftest import save_tiny_vlm

    folder = save_tiny_vlm(tmp_path / "vlm")
    picture = tmp_path / "pic.png"
    Image.fromarray((np.random.default_rng(1).random((30, 30, 3)) * 255).astype("uint8")).save(picture)
    code = cli.main(
        [
            "generate",
            "--target",
            str(folder),
            "--image",
            str(picture),
            "--prompt",
            "What is this?",
            "--proposer",
            "prompt-lookup",
            "--max-new-tokens",
            "12",
            "--dtype",
            "float32",
            "--threads",
            "1",
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    loaded = load_target(folder)
    ids, images = encode_image_prompt(load_processor(str(folder)), "What is this?", [str(picture)])
    assert int((ids == loaded.model.config.image_token_index).sum()) == 4
    reference = plain_greedy_with_images(loaded.model, ids[0], images, 12)
    eos = loaded.tokenizer.eos_token_id
    reference = reference[: reference.index(eos)] if eos in reference else reference  # the command stops at EOS
    text = loaded.tokenizer.decode(reference, skip_special_tokens=True)
    assert text.strip() and out == text + "\n", (out, text)

    code = cli.main(["generate", "--target", str(folder), "--image", str(tmp_path / "none.png"), "--prompt", "x"])
    _, err = capsys.readouterr()
    assert code == 2 and "no image file at" in err.strip().splitlines()[-1]
