"""The llama.cpp backend (inference/llamacpp/) on SmolLM2-135M as an f32 GGUF made by llama.cpp's
own converter: the tree mask through sequences, the features, exact greedy speculation at batch
1 and ragged batch 3 with every head kind the backend drafts with (all but Medusa-2, which changes
the target), the load policy, a bf16 GGUF, and the sampled law at depth 2.

These need libllama (`make llamacpp`), so they are the `llamacpp` marker's suite, run by
`make test-llamacpp` (docs/testing.md); `make test` runs the backend's pure rules
(tests/test_llamacpp_sequences.py).
"""

from collections import Counter

import pytest
import torch

from drafthead.inference.drafters.settings import StaticTreeSettings, TreeSettings
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.inference.drafters.parallel import DFlashDrafter, ParallelDrafter
from drafthead.inference.engine.drafter import DrafterBase, RootOnlyDrafter
from drafthead.inference.engine.generate import GenerationConfig, generate_batch, speculative_generate
from drafthead.inference.engine.sampling import SamplingConfig, logits_to_probs
from drafthead.inference.engine.tree import DraftTree, chain_parents, node_depths
from tests.stats import chi_square_pvalue

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def smollm2():
    from drafthead.draft_spec import DraftSpec
    from drafthead.inference.llamacpp.convert import target_gguf
    from drafthead.inference.llamacpp.target import LlamaCppTarget
    from drafthead.inference.bench.prompts import encode_chat, load_prompts
    from drafthead.ground.target.load import load_target

    loaded = load_target("smollm2-135m", dtype="float32")
    backend = LlamaCppTarget(target_gguf(loaded.path, "f32"), loaded.model.config, threads=2)
    drafter = DraftSpec(proposer="head").build(loaded, note=lambda line: None).factory()  # the shipped head, its drafting.json
    prompts = [encode_chat(loaded.tokenizer, p)[0] for p in load_prompts("mt-bench", 3)]
    return loaded, backend, drafter, prompts


def plain_outputs(backend, prompts, config) -> list[list[int]]:
    """Each prompt's greedy output from the backend's own plain decoding (our engine, no drafts)."""
    return [speculative_generate(backend, RootOnlyDrafter(), p[None], config).new_tokens[0].tolist() for p in prompts]


def next_logits(backend, seq: list[int]) -> torch.Tensor:
    """[V] the backend's logits for the token after `seq`, from a plain forward of its last token."""
    backend.start([torch.tensor(seq)], (), False, 1)
    return backend.verify([DraftTree(torch.tensor([seq[-1:]]), torch.tensor([-1]))], [len(seq) - 1], False).logits[0, 0]


class RoundByRound(DrafterBase):
    """Drafts nothing, as RootOnlyDrafter, but is not one: the engine runs its rounds one by one."""

    def propose(self) -> DraftTree:
        return DraftTree(self.history[:, -1:], torch.tensor([-1]))


def test_plain_decoding_in_one_library_call_equals_it_round_by_round(smollm2):
    """Batch-1 plain greedy decoding runs as one `greedy_run` (shim.cpp dh_greedy), or calls of
    STREAM_CHUNK tokens while it streams. Both give the engine's round-by-round tokens, stops and
    counts: to the length limit, and to an EOS the output reaches (its 6th token, taken as EOS)."""
    loaded, backend, _, prompts = smollm2
    for p in prompts:
        config = GenerationConfig(max_new_tokens=48, eos_token_ids=(loaded.tokenizer.eos_token_id,))
        rounds = speculative_generate(backend, RoundByRound(), p[None], config)
        whole = speculative_generate(backend, RootOnlyDrafter(), p[None], config)
        heard = []
        streamed = speculative_generate(backend, RootOnlyDrafter(), p[None], config, on_tokens=heard.append)
        assert whole.new_tokens.tolist() == rounds.new_tokens.tolist() == streamed.new_tokens.tolist()
        assert (whole.finish_reason, whole.accepted_lengths) == (rounds.finish_reason, rounds.accepted_lengths)
        assert [len(h) for h in heard] == [16, 16, 16] and sum(heard, []) == rounds.new_tokens[0].tolist()
        eos = int(rounds.new_tokens[0, 5])
        stop = GenerationConfig(max_new_tokens=48, eos_token_ids=(eos,))
        short = speculative_generate(backend, RootOnlyDrafter(), p[None], stop)
        assert short.new_tokens[0].tolist() == speculative_generate(backend, RoundByRound(), p[None], stop).new_tokens[0].tolist()
        assert short.new_tokens[0].tolist()[-1] == eos and short.finish_reason == "eos"


def test_a_tree_forward_gives_each_node_the_logits_of_its_own_path(smollm2):
    """Every node of a branching tree (verified in one llama_decode through the sequences) has the
    logits that a plain chain forward of its root-to-node path gives: the mask is the tree's."""
    loaded, backend, _, prompts = smollm2
    prompt = prompts[0]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5, 5])
    tokens = torch.randint(0, 40000, (1, 9), generator=torch.Generator().manual_seed(0))
    length = prompt.numel() - 1
    backend.start([prompt], (), False, 16)
    tree = backend.verify([DraftTree(tokens, parents)], [length], False).logits[0]
    backend.discard(length)
    depths = node_depths(parents).tolist()
    for node in range(9):
        path, i = [], node
        while i >= 0:
            path.insert(0, i)
            i = int(parents[i])
        chain = backend.verify([DraftTree(tokens[:, path], chain_parents(len(path) - 1))], [length], False).logits[0]
        backend.discard(length)
        assert len(path) == depths[node] + 1
        # forwards of 9 and of len(path) tokens round differently (by ~1e-2 on SmolLM2); a wrong mask
        # moves logits by whole units
        torch.testing.assert_close(tree[node], chain[-1], atol=5e-2, rtol=0)
        assert int(tree[node].argmax()) == int(chain[-1].argmax())


def test_features_are_the_targets_layer_inputs(smollm2):
    """The layer inputs llama.cpp returns are transformers' hidden_states[i] of the same tokens."""
    loaded, backend, _, prompts = smollm2
    prompt = prompts[1]
    hidden = backend.start([prompt], (2, 15, 27), False, 4)
    with torch.inference_mode():
        ref = loaded.model(prompt[None, :-1], output_hidden_states=True).hidden_states
    for layer in (2, 15, 27):
        # two engines in fp32 round apart elementwise; the whole state agrees to ~1e-4
        error = (hidden[layer][0] - ref[layer][0]).norm() / ref[layer][0].norm()
        assert error < 1e-3, (layer, float(error))


@pytest.mark.parametrize("drafter_name", ["eagle3-head", "prompt-lookup"])
def test_greedy_speculation_equals_the_backends_plain_decoding(smollm2, drafter_name):
    from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter

    loaded, backend, head, prompts = smollm2
    drafter = head if drafter_name == "eagle3-head" else PromptLookupDrafter(length=4)
    config = GenerationConfig(max_new_tokens=40, eos_token_ids=(loaded.tokenizer.eos_token_id,))
    plain = plain_outputs(backend, prompts, config)
    for p, expected in zip(prompts, plain):
        result = speculative_generate(backend, drafter, p[None], config)
        assert result.new_tokens[0].tolist() == expected
    batch = generate_batch(backend, drafter, prompts, config)  # ragged: three prompt lengths
    assert len({p.numel() for p in prompts}) == 3
    assert [r.new_tokens[0].tolist() for r in batch.rows] == plain
    assert batch.num_forwards < sum(len(t) for t in plain)  # it did speculate


def test_sampled_tokens_follow_the_targets_law_at_depth_two(smollm2):
    """Three sampled tokens (top-3 at each step: 27 outcomes) through the backend, ten rows a
    batch with prompt lookup's trees (the text repeats, so drafts of two tokens are accepted
    whole): their joint law is the target's, enumerated from the backend's own plain forwards."""
    from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter

    loaded, backend, _, _ = smollm2
    head = PromptLookupDrafter(length=3)
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    text = "one two three four. one two three four. one two three four. one two"
    prompt = torch.tensor(loaded.tokenizer(text)["input_ids"])

    def probs(seq: list[int]) -> torch.Tensor:
        return logits_to_probs(next_logits(backend, seq), sampling)

    start = prompt.tolist()
    exact = {}
    p1 = probs(start)
    for a in p1.nonzero().flatten().tolist():
        p2 = probs(start + [a])
        for b in p2.nonzero().flatten().tolist():
            p3 = probs(start + [a, b])
            for c in p3.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    runs, copies = 1500, 10
    counts, deep = Counter(), 0
    ids = prompt[None].repeat(copies, 1)
    for run in range(runs // copies):
        out = speculative_generate(
            backend, head, ids, GenerationConfig(max_new_tokens=3, sampling=sampling, seed=run), attention_mask=torch.ones_like(ids)
        )
        for row in out.rows:
            counts[tuple(row.new_tokens[0].tolist())] += 1
            deep += row.accepted_lengths[0] == 3
    assert deep > 0  # some first rounds accepted a depth-2 path whole
    assert chi_square_pvalue(counts, exact, runs) > 1e-3


def test_the_widest_tree_fit_allows_still_verifies_after_rows_leave(smollm2):
    """Leaf sequences start after every row the batch began with, so once rows have left, the
    tree `fit` allows the one row left (a star of 300 leaves, cut to what fits) still verifies."""
    _, backend, _, prompts = smollm2
    backend.start(prompts, (), False, 8)
    backend.select_rows([2], [prompts[2].numel() - 1])
    star = DraftTree(torch.full((1, 301), 11), torch.tensor([-1] + [0] * 300))
    tree = backend.cut_to_capacity(star, 1)
    assert 1 < tree.num_nodes < star.num_nodes
    logits = backend.verify([tree], [prompts[2].numel() - 1], False).logits
    assert logits.shape == (1, tree.num_nodes, backend.vocab_size)


def test_the_final_normed_state_is_the_targets(smollm2):
    """Asked for the final normed state (key -1), the backend returns llama.cpp's token
    embeddings output: transformers' hidden_states[-1] of the same tokens, prefill and verify."""
    loaded, backend, _, prompts = smollm2
    prompt = prompts[1]
    hidden = backend.start([prompt[:-4]], (2, 30), True, 8)
    tree = DraftTree(prompt[None, -5:-1], chain_parents(3))
    verified = backend.verify([tree], [prompt.numel() - 5], True).hidden_states
    backend.discard(prompt.numel() - 5)
    with torch.inference_mode():
        ref = loaded.model(prompt[None, :-1], output_hidden_states=True).hidden_states[-1][0]
    ours = torch.cat([hidden[-1][0], verified[-1][0]])
    assert set(hidden) == {2, 30, -1} and ours.shape == ref.shape
    assert torch.equal(hidden[30], hidden[-1])  # hidden state L (30 layers) is the same state
    # fp32 engines round apart (~1e-3 per token after 30 layers); the un-normed residual or
    # another token's state is off by whole units
    assert (ours - ref).norm() / ref.norm() < 1e-3
    assert ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 1e-2


@pytest.mark.parametrize("kind", ["medusa1", "hydra", "eagle1"])
def test_heads_on_the_final_normed_state_decode_exactly(smollm2, kind):
    """Medusa-1, Hydra and EAGLE-1 read the final normed state: on the backend (untrained heads,
    so drafts are verified and mostly rejected) the greedy output is the backend's plain output,
    at batch 1 and in the ragged batch of 3."""
    from drafthead.heads.registry import build_head, make_config
    from drafthead.inference.drafters.head_drafters import HydraDrafter, MedusaDrafter

    loaded, backend, _, prompts = smollm2
    torch.manual_seed(0)
    head = build_head(make_config(kind, loaded.model, None, name="tiny"), loaded.model).eval()
    drafter = (
        {"medusa1": MedusaDrafter, "hydra": HydraDrafter}[kind](head, StaticTreeSettings(num_draft=6))
        if kind != "eagle1"
        else EagleDrafter(head, TreeSettings(num_draft=6))
    )
    # Medusa and Hydra ask for it as the last state, EAGLE-1 as hidden state L
    assert drafter.needs_last_hidden or drafter.feature_layers == (loaded.model.config.num_hidden_layers,)
    config = GenerationConfig(max_new_tokens=16, eos_token_ids=(loaded.tokenizer.eos_token_id,))
    plain = plain_outputs(backend, prompts, config)
    single = speculative_generate(backend, drafter, prompts[0][None], config)
    assert single.new_tokens[0].tolist() == plain[0]
    assert sum(single.drafted) > 0  # its trees were verified, not skipped
    batch = generate_batch(backend, drafter, prompts, config)
    assert [r.new_tokens[0].tolist() for r in batch.rows] == plain


# the heads beside the shipped EAGLE-3 one that read the target's layer inputs: head options on
# SmolLM2 (mask id 16: a token with a trained embedding row) and the drafter each runs under
LAYER_INPUT_KINDS = {
    "eagle31": ({"draft_vocab_size": 4096}, lambda head: EagleDrafter(head, TreeSettings(num_draft=8, depth=3, branch=2))),
    "peagle": ({"draft_vocab_size": 4096, "parallel_depth": 3, "mask_token_id": 16}, lambda head: ParallelDrafter(head)),
    "dflash": ({"block_size": 4, "mask_token_id": 16}, lambda head: DFlashDrafter(head)),
}


@pytest.mark.parametrize("kind", sorted(LAYER_INPUT_KINDS))
def test_heads_on_layer_inputs_decode_exactly_with_accepted_drafts(smollm2, kind):
    """EAGLE-3.1, P-EAGLE and DFlash draft from llama.cpp's layer inputs: their greedy output is
    the backend's plain output at batch 1 and in the ragged batch of 3 with their own trees
    (untrained heads: mostly rejected), and again with the trees steered to the backend's own
    continuation (tests/oracle.py), so that paths of depth >= 2 are accepted at batch 1 and the
    three rows accept different lengths: the cache keeps accepted nodes, the drafters catch up."""
    from drafthead.heads.registry import build_head, make_config
    from tests.oracle import assert_accepts_and_stays_exact
    from tests.tiny import left_padded

    loaded, backend, _, prompts = smollm2
    options, drafter_of = LAYER_INPUT_KINDS[kind]
    torch.manual_seed(0)
    config = make_config(kind, loaded.model, None, name="untrained", **options)
    head = build_head(config, loaded.model, token_counts=torch.arange(loaded.model.config.vocab_size)).eval()
    settings = lambda n: GenerationConfig(max_new_tokens=n, eos_token_ids=(loaded.tokenizer.eos_token_id,))  # noqa: E731
    plain = plain_outputs(backend, prompts, settings(24))
    assert speculative_generate(backend, drafter_of(head), prompts[0][None], settings(24)).new_tokens[0].tolist() == plain[0]
    batch = generate_batch(backend, drafter_of(head), prompts, settings(24))
    assert [r.new_tokens[0].tolist() for r in batch.rows] == plain
    ids, mask = left_padded(prompts)
    assert_accepts_and_stays_exact(
        backend, lambda: drafter_of(head), prompts[0][None], plain[0], prompts, plain, ids, mask, 24, 24, settings, vocab=backend.vocab_size
    )


def test_the_load_policy_drafts_when_it_pays_and_decodes_plainly_when_not(smollm2):
    """`GenerationConfig(sizing="policy")` on the backend, with costs injected (tests/test_policy.py
    `InjectedCosts`), so the choice depends on the rule, not on this machine. The shipped head's
    trees are steered to the backend's own continuation (tests/oracle.py), so drafts are accepted
    and drafting pays where it is cheap: where verifying more tokens costs nothing and drafting
    little (FLAT), every round drafts; where drafting a row costs as much as verifying 16 more
    tokens (STEEP, batch 3), rounds decode plainly between probes. Every row is the backend's
    plain output either way."""
    from tests.oracle import OracleDrafter, known_continuation
    from tests.policy_checks import FLAT, STEEP, InjectedCosts, under

    loaded, backend, head, prompts = smollm2

    def settings(policy, drafter=None):
        return under(policy, backend, drafter, max_new_tokens=24, eos_token_ids=(loaded.tokenizer.eos_token_id,))

    plain = plain_outputs(backend, prompts, settings(None))
    continuation = known_continuation([p.tolist() + out for p, out in zip(prompts, plain)])
    pays = InjectedCosts(FLAT, probe_every=3, draft_per_row=0.0005)
    drafter = OracleDrafter(head, continuation, backend.vocab_size)
    out = generate_batch(backend, drafter, prompts, settings(pays, drafter))
    assert [r.new_tokens[0].tolist() for r in out.rows] == plain
    assert pays.drafted and all(pays.drafted), pays.decisions  # no plain round
    costly = InjectedCosts(STEEP, probe_every=3, draft_per_row=0.05)
    drafter = OracleDrafter(head, continuation, backend.vocab_size)
    out = generate_batch(backend, drafter, prompts, settings(costly, drafter))
    assert [r.new_tokens[0].tolist() for r in out.rows] == plain
    assert costly.drafted.count(False) > len(costly.drafted) // 2 and any(costly.drafted), costly.decisions


def test_a_bf16_gguf_parts_from_its_plain_output_only_on_near_ties(smollm2):
    """On llama.cpp's bf16 GGUF of the target (its converter's `--outtype bf16`, what `--dtype
    bfloat16` runs) the shipped head's greedy output equals the backend's plain output up to the
    first token where they part, if any; there the backend's own logits for the shared prefix put
    the two tokens within a near-tie (inference/bench/run.py NEAR_TIE_GAP), since a bf16 forward
    of one token and of several round apart. Drafts are accepted: the head did speculate."""
    from drafthead.inference.bench.run import NEAR_TIE_GAP
    from drafthead.inference.llamacpp.convert import target_gguf
    from drafthead.inference.llamacpp.target import LlamaCppTarget

    loaded, _, head, prompts = smollm2
    backend = LlamaCppTarget(target_gguf(loaded.path, "bf16"), loaded.model.config, threads=2)
    config = GenerationConfig(max_new_tokens=32, eos_token_ids=(loaded.tokenizer.eos_token_id,))
    plain = plain_outputs(backend, prompts, config)
    batch = generate_batch(backend, head, prompts, config)
    assert batch.num_forwards < sum(len(t) for t in plain)  # it did speculate
    for prompt, want, row in zip(prompts, plain, batch.rows):
        got = row.new_tokens[0].tolist()
        part = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if part is None:
            assert len(got) == len(want)
            continue
        logits = next_logits(backend, prompt.tolist() + want[:part]).float()
        assert abs(float(logits[want[part]] - logits[got[part]])) <= NEAR_TIE_GAP, (part, want[part], got[part])
    backend.close()


def test_demo_on_the_llama_cpp_backend_verifies_with_libllama(capsys):
    """`demo --backend llama.cpp` runs libllama's forward against plain decoding on the same
    backend (it once took the flag and ran torch), with row invariance, a torch-kernel mode, off."""
    from drafthead.cli import main

    assert main(["demo", "--backend", "llama.cpp", "--dtype", "float32", "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert "llama.cpp backend: ggml's kernels" in err and "llama.cpp backend: the target as a f32 GGUF" in err
    assert "plain (llama.cpp backend):" in out


@pytest.mark.parametrize("streams", [True, False], ids=["streams", "unified"])
@pytest.mark.parametrize("drafter_name", ["eagle3-head", "prompt-lookup"])
def test_rows_joining_between_rounds_equal_the_backends_plain_decoding(smollm2, drafter_name, streams):
    """Continuous batching as `drafthead serve` runs it (inference/engine/decoder.py): rows join at
    different rounds and leave when done, each on a KV stream of its own (streams: trees cut to
    chains, rows moved down to sequences 0..B - 1 as others leave) or in one unified cache; every
    row is its prompt's plain output."""
    from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
    from drafthead.inference.engine.decoder import Decoder, DecoderSettings, RowSettings
    from drafthead.inference.engine.drafter import fork_drafter
    from drafthead.inference.engine.stopping import StopRules

    loaded, backend, head, prompts = smollm2
    drafter = head if drafter_name == "eagle3-head" else PromptLookupDrafter(length=4)
    eos = (loaded.tokenizer.eos_token_id,)
    lengths = (40, 12, 30)
    plain = [o for o in plain_outputs(backend, prompts, GenerationConfig(max_new_tokens=40, eos_token_ids=eos))]
    refs = [o[:n] for o, n in zip(plain, lengths)]  # each prompt asks for its own count: rows leave at different rounds
    decoder = Decoder(backend, DecoderSettings(max_len=2048, device=torch.device("cpu")), drafter.feature_layers, drafter.needs_last_hidden)
    schedule = {0: [0], 3: [1], 5: [2], 40: [1]}  # prompt 1 joins again after every row has left
    rows = []
    with torch.inference_mode():
        decoder.open(4, 4 * 1024, streams)
        for step in range(200):
            for i in schedule.get(step, []):
                settings = RowSettings(SamplingConfig(), StopRules(eos, (), lengths[i]))
                rows += [(i, row) for row in decoder.join([prompts[i]], [fork_drafter(drafter)], [settings], lengths[i])]
            if not decoder.active and step > max(schedule):
                break
            decoder.step()
    assert [row.emitted for _, row in rows] == [refs[i] for i, _ in rows]
    assert sum(len(row.accepted_lengths) for _, row in rows) < sum(len(row.emitted) for _, row in rows)  # it speculated


def test_streams_give_each_row_the_logits_and_features_of_the_unified_cache(smollm2):
    """A round of chains of different lengths over three rows: each row on its own stream (the
    chains padded to one length) gets the logits and feature-layer inputs the unified cache gives
    it, in the rows' order, also after a row left and the last row's stream moved down."""
    _, backend, _, prompts = smollm2
    layers = (2, 15, 29)
    chains = [DraftTree(torch.tensor([[5, 6, 7, 8]]), chain_parents(3)), DraftTree(torch.tensor([[9]]), chain_parents(0))]
    chains.append(DraftTree(torch.tensor([[10, 11]]), chain_parents(1)))

    def round_of(streams: bool, leave: bool):
        backend.open(3, 3 * 1024, layers, False, streams)
        backend.join(prompts)
        lengths = [p.numel() - 1 for p in prompts]
        rows, trees = [0, 1, 2], chains
        if leave:
            backend.select_rows([0, 2], [lengths[0], lengths[2]])
            rows, trees, lengths = [0, 2], [chains[0], chains[2]], [lengths[0], lengths[2]]
        out = backend.verify([backend.cut_to_capacity(t, len(trees)) for t in trees], lengths, True)
        return {b: (out.logits[k, : trees[k].num_nodes], [out.hidden_states[i][k, : trees[k].num_nodes] for i in layers]) for k, b in enumerate(rows)}

    for leave in (False, True):
        unified, streams = round_of(False, leave), round_of(True, leave)
        for b in unified:
            # ggml picks kernels by the batch's shape: fp32 results round apart by ~1e-2 at most
            assert (streams[b][0] - unified[b][0]).abs().max() < 0.05, (leave, b)
            assert (streams[b][0].argmax(-1) == unified[b][0].argmax(-1)).all(), (leave, b)
            for got, want in zip(streams[b][1], unified[b][1]):
                assert (got - want).norm() / want.norm() < 1e-3, (leave, b)


def test_the_serving_engine_sizes_rounds_on_the_llamacpp_target(smollm2):
    """`drafthead serve --backend llama.cpp --sizing policy`: the load policy times the llama.cpp
    target's own forward, and a job's greedy answer is the backend's plain output."""
    from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
    from drafthead.inference.serve.engine import EngineSettings, Job, ServingEngine

    loaded, backend, _, prompts = smollm2
    eos = (loaded.tokenizer.eos_token_id,)
    # before the engine starts: its thread owns the backend's context until it stops
    plain = plain_outputs(backend, prompts[:1], GenerationConfig(max_new_tokens=24, eos_token_ids=eos))[0]
    engine = ServingEngine(
        backend, PromptLookupDrafter(), EngineSettings(max_batch=2, max_len=2048, kv_cells=2 * 2048), eos_token_ids=eos, decode=str, sizing="policy"
    )
    assert engine.decoder.settings.policy is not None
    engine.start()
    try:
        job = Job(prompts[0].tolist(), SamplingConfig(), 24)
        engine.submit(job)
        tokens = []
        while (event := job.events.get(timeout=300))[0] == "tokens":
            tokens += event[1]
        assert event[0] == "done" and tokens == plain
    finally:
        engine.stop(5)
