"""Small typed configs, one per head family (docs/style.md 5). Unknown keys are errors.

Feature indices everywhere are indices into the target's `output_hidden_states` (transformers
convention, checked on transformers 5.24 Llama/Qwen2): 0 = token embeddings, i = output of
decoder block i (= input of block i + 1), L = the *final normed* state, the LM head's input
(`lm_head(hidden_states[L]) == logits`). vLLM's `eagle_aux_hidden_state_layer_ids` are the
decoder layers whose *input* is taken, which is the same number; SGLang counts one lower
(docs/formats.md).

Every config records the `TargetIdentity` it was made for; the target's sizes are read from it
rather than repeated (docs/style.md 12).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..ground.field_types import type_problems
from ..ground.target.identity import TargetIdentity
from .losses import check_loss


def _from_dict(cls, d: dict):
    d = dict(d)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    problems = type_problems(cls, d)
    if problems:
        raise ValueError(f"{cls.__name__}: " + "; ".join(problems))
    if d.get("target") is not None and not isinstance(d["target"], TargetIdentity):
        d["target"] = TargetIdentity.from_dict(d["target"])
    if isinstance(d.get("layer"), dict):
        d["layer"] = _from_dict(DraftLayerShape, d["layer"])
    elif "layer" in d and not isinstance(d["layer"], DraftLayerShape):
        raise ValueError(f"{cls.__name__}: layer: expected a mapping of the draft layer's own fields, got {d['layer']!r}")
    for f in dataclasses.fields(cls):  # JSON gives lists where the dataclass holds tuples
        if f.name in d and isinstance(d[f.name], list):
            d[f.name] = tuple(d[f.name])
    return cls(**d)


class _HeadConfig:
    """Shared behaviour. Subclasses are dataclasses with `kind` and `target` fields."""

    # fields that shape only the training loss, not the weights: a run may change them when it
    # continues from a saved head (TrainConfig.init_from)
    LOSS_FIELDS: ClassVar[tuple[str, ...]] = ()

    if TYPE_CHECKING:  # what every subclass declares (as dataclass fields or properties)
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
        kind: str
        target: TargetIdentity | None

        @property
        def feature_layers(self) -> tuple[int, ...]: ...

    @classmethod
    def from_dict(cls, d: dict):
        return _from_dict(cls, d)

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (TargetIdentity, DraftLayerShape)):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def architecture_diff(self, other: "_HeadConfig") -> list[str]:
        """'field: mine != other' for every field that shapes the weights (all but `target` and
        LOSS_FIELDS); [] when `other`'s weights fit a head built from this config."""
        if type(other) is not type(self) or other.kind != self.kind:
            return [f"kind: {self.kind} != {other.kind}"]
        skip = {"target", *self.LOSS_FIELDS}
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if k not in skip and mine[k] != theirs[k]]

    def _check_kind(self) -> None:
        mine = [name for name, kind in KINDS.items() if kind.config is type(self)]
        if self.kind not in mine:
            raise ValueError(f"{type(self).__name__}.kind must be one of {tuple(mine)}, got {self.kind!r}")

    def _check_chain_loss(self) -> None:
        """loss dpace weighs the draft positions of a chain (heads/losses.py); a head that trains
        one position, by its kind or its settings, has no chain to weigh: refused. The positions
        are the kind's `chain_positions` field (KINDS)."""
        if getattr(self, "loss", None) != "dpace":
            return
        field = KINDS[self.kind].chain_positions
        positions = 1 if field is None else int(getattr(self, field))
        if positions < 2:
            settings = {f.name for f in dataclasses.fields(self)}
            why = f" ({field}: {positions})" if field in settings else ""  # a property (DFlash's block less its pending token): no setting to name
            raise ValueError(f"loss dpace weighs a chain of draft positions; this {self.kind} head trains one{why}: use loss ce")

    def _need_target(self) -> TargetIdentity:
        if self.target is None:
            raise ValueError(f"{type(self).__name__} has no target identity; make it with heads.registry.make_config(kind, target_model, tokenizer)")
        return self.target

    @property
    def hidden_size(self) -> int:
        return self._need_target().hidden_size

    @property
    def vocab_size(self) -> int:
        return self._need_target().vocab_size

    @property
    def final_layer(self) -> int:
        """Index of the final normed hidden state (the LM head's input) in output_hidden_states."""
        return self._need_target().num_layers

    @property
    def train_hidden_layers(self) -> tuple[int, ...]:
        """Every output_hidden_states index `compute_loss` reads from a FeatureBatch: the features,
        plus L, which every kind needs (Medusa/EAGLE-1 features, EAGLE-3 soft targets)."""
        return tuple(sorted(set(self.feature_layers) | {self.final_layer}))


@dataclass
class MedusaConfig(_HeadConfig):
    """Medusa heads (Cai et al. 2024): head k = `num_layers` residual SiLU blocks + an LM head.

    medusa1: frozen target, heads only. medusa2: the trainer also fine-tunes the target with LoRA;
    the adapter is saved in `HEAD_DIR/adapter/` and merged into the target on load.
    """

    LOSS_FIELDS: ClassVar[tuple[str, ...]] = ("loss_decay", "loss", "dpace_alpha")

    kind: str = "medusa1"
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    # False: each head owns a trainable copy of the target LM head (Medusa's own init).
    # True: every head reads through the target's frozen LM head (not saved; far fewer parameters).
    share_lm_head: bool = False
    loss_decay: float = 0.8  # loss = sum_k loss_decay**k * CE_k (Medusa-2's lambda_k = 0.8**k)
    # ce: the decay above; dpace: each position's chain of heads weighted by D-PACE (heads/losses.py)
    loss: str = "ce"
    dpace_alpha: float = 0.5
    target: TargetIdentity | None = None

    def __post_init__(self) -> None:
        self._check_kind()
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 1, got {self.num_heads}, {self.num_layers}")
        if not self.loss_decay > 0:
            raise ValueError(f"loss_decay must be > 0, got {self.loss_decay}")
        if self.loss not in ("ce", "dpace"):
            raise ValueError(f"a {self.kind} head's loss is ce or dpace (its CE is on the data token), got {self.loss!r}")
        check_loss(self.loss, 3.0, self.dpace_alpha)
        self._check_chain_loss()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.final_layer,)  # the final normed hidden state

    needs_last_hidden: ClassVar[bool] = True  # draft_logits reads the final normed hidden state


@dataclass
class HydraConfig(MedusaConfig):
    """Hydra heads (Ankner et al. 2024): Medusa heads made sequentially dependent. Head k also
    reads the embeddings of the tokens between the target's state and the one it predicts, the
    pending token and the k tokens drafted before it (heads/hydra.py). No engine serves them."""

    kind: str = "hydra"


DRAFT_LAYER_CHOICES = ("llama", "target")


@dataclass
class DraftLayerShape:
    """The draft decoder layer's own shape, where it is not what the layer takes from the target:
    None takes the target's sizes, epsilon and RoPE, and SiLU. Set by imports of published heads
    whose producer chose its own (SpecForge's MoE configs' widths; speculators' Gemma heads take
    the verifier's GELU; upstream EAGLE-1 always ran RoPE with base 10000, whatever the target's:
    docs/formats.md). Each config's LAYER_FIELDS are the ones its layer takes: the EAGLE layer has
    the target's epsilon, DFlash's runs SiLU."""

    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str | None = None
    rms_norm_eps: float | None = None
    # transformers' `rope_parameters` (rope_type, rope_theta, scaling fields)
    rope_parameters: dict | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self, own: tuple[str, ...], kind: str) -> None:
        """A ValueError naming the fields set here that a `kind` head's layer does not take."""
        fixed = [f.name for f in dataclasses.fields(self) if f.name not in own and getattr(self, f.name) is not None]
        if fixed:
            raise ValueError(f"a {kind} head's draft layer takes {', '.join(fixed)} from the target or its own design: drop layer.{fixed[0]}")


# the fields of DraftLayerShape the EAGLE draft layer (heads/eagle.py llama_layer_config) takes
DRAFT_OWN_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act")


def _check_draft_layer(draft_layer: str) -> None:
    if draft_layer not in DRAFT_LAYER_CHOICES:
        raise ValueError(f"draft_layer must be one of {DRAFT_LAYER_CHOICES}, got {draft_layer!r}")


@dataclass
class Eagle1Config(_HeadConfig):
    """EAGLE-1 (Li et al. 2024): fc(cat(embed(token_{t+1}), feature_t)) -> one decoder layer.

    The feature is the final normed hidden state (index L); the layer's output is both the predicted
    next feature (SmoothL1) and, through the target's frozen LM head, the next-token logits.
    As in EAGLE's cnets.py and vLLM's llama_eagle.py, the decoder layer's input_layernorm is dropped
    (Identity) unless `input_layernorm` is True.
    """

    LOSS_FIELDS: ClassVar[tuple[str, ...]] = ("feature_weight", "ce_weight", "ce_to_target_dist", "loss", "lk_eta")

    kind: str = "eagle1"
    feature_weight: float = 1.0  # SmoothL1 on the next feature
    ce_weight: float = 0.1  # token CE (EAGLE sec. 4)
    # False: CE against the next data token input_ids[t+2]; True: soft CE against the target's own
    # distribution at t+1 (softmax of lm_head(feature_{t+1})).
    ce_to_target_dist: bool = False
    # the token term's objective, as Eagle3Config.loss; LK losses need ce_to_target_dist
    loss: str = "ce"
    lk_eta: float = 3.0
    input_layernorm: bool = False
    fc_bias: bool = False  # upstream EAGLE trains fc with a bias (its default); vLLM's layout has none
    # The draft decoder layer: "llama" = a Llama layer sized from the target, whatever its family,
    # the layer every engine serves (docs/formats.md "The draft layer per target family");
    # "target" = the target family's own layer class, as speculators' checkpoints for some
    # families hold it (its export refuses wherever no engine serves that family's layer).
    draft_layer: str = "llama"
    layer: DraftLayerShape = field(default_factory=DraftLayerShape)  # its own shape (heads/eagle.py llama_layer_config)
    target: TargetIdentity | None = None

    LAYER_FIELDS: ClassVar[tuple[str, ...]] = DRAFT_OWN_FIELDS + ("rope_parameters",)

    def __post_init__(self) -> None:
        self._check_kind()
        _check_draft_layer(self.draft_layer)
        self.layer.check(self.LAYER_FIELDS, self.kind)
        if self.feature_weight < 0 or self.ce_weight < 0 or self.feature_weight + self.ce_weight == 0:
            raise ValueError("EAGLE-1 loss weights must be >= 0 and not both 0")
        check_loss(self.loss, self.lk_eta)
        self._check_chain_loss()
        if self.loss != "ce" and not self.ce_to_target_dist:
            raise ValueError(f"loss {self.loss} trains toward the target's distribution: set ce_to_target_dist: true")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.final_layer,)

    needs_last_hidden: ClassVar[bool] = False


@dataclass
class MTPConfig(Eagle1Config):
    """A target's own multi-token-prediction layer as a head (DeepSeek-V3's `num_nextn_predict_layers`;
    heads/mtp.py): eh_proj(cat(enorm(embed(token_{t+1})), hnorm(feature_t))) -> a decoder layer of
    the target's own kind (the checkpoint's layer `mtp_layer`) -> its own final norm, scored by
    the target's LM head. Drafts and trains as EAGLE-1 does; by default on the token CE alone, as
    the target was pre-trained. The feature is the final normed state (index L), as vLLM and
    SGLang feed their MTP drafters."""

    kind: str = "mtp"
    feature_weight: float = 0.0
    ce_weight: float = 1.0
    input_layernorm: bool = True
    draft_layer: str = "target"
    mtp_layer: int | None = None  # the checkpoint's layer index of the MTP layer; None: L, after the last decoder layer

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_layer != "target":
            raise ValueError("an MTP head's layer is the target's own (draft_layer: target)")

    @property
    def checkpoint_layer(self) -> int:
        return self.final_layer if self.mtp_layer is None else self.mtp_layer


def default_eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high features as output_hidden_states indices.

    L >= 7: inputs of layers 2, L//2, L-3 (vLLM's and SpecForge's default aux layer ids).
    4 <= L < 7: that formula repeats a layer, and the engines fuse 3 distinct decoder-layer
    outputs 1..L-1 (heads/formats/eagle3.py check_engine_layers), so (1, L//2, L-1).
    L < 4: no 3 distinct such layers exist; the formula clamped to 0..L, which trains and runs
    in drafthead but exports to no engine (training says so at its start)."""
    L = num_layers
    if L >= 7:
        return (2, L // 2, L - 3)
    if L >= 4:
        return (1, L // 2, L - 1)
    return tuple(min(max(i, 0), L) for i in (2, L // 2, L - 3))


def engine_layer_problem(layers: tuple[int, ...], num_layers: int) -> str | None:
    """Why the engines' EAGLE-3 (and the layouts that carry it) cannot take these feature
    indices, or None: they fuse exactly 3 distinct features, ascending, none of them the final
    normed state L (SGLang's ids cannot name index 0 either: heads/formats/common.py ids_from_ours)."""
    layers = tuple(layers)
    if len(layers) != 3:
        return f"the engines' EAGLE-3 fuses exactly 3 features (fc 3H->H); this head has {layers}"
    if list(layers) != sorted(set(layers)):
        return f"the engines fuse features in ascending layer order without repeats; aux_layers {layers} would be reordered there"
    if num_layers in layers:
        return f"aux layer {num_layers} is the final *normed* state here but the unnormed one in the engines"
    return None


@dataclass
class Eagle3Config(_HeadConfig):
    """EAGLE-3 (Li et al. 2025): fc(cat of 3 target features) -> decoder layer over
    cat(norm(embed), norm(hidden)) -> norm -> lm_head over a reduced draft vocabulary, trained with
    training-time test (unroll `ttt_steps` steps on its own hidden states, loss sum decay**i CE_i)."""

    LOSS_FIELDS: ClassVar[tuple[str, ...]] = ("ttt_steps", "ttt_decay", "ttt_ramp", "entropy_ramp", "entropy_start", "loss", "lk_eta", "dpace_alpha")

    kind: str = "eagle3"
    aux_layers: tuple[int, ...] | None = None  # None: default_eagle3_layers(L), filled in when target is set
    draft_vocab_size: int = 8192  # capped at the target vocab when the target is known
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    # progressive TTT: over the first `ttt_ramp` share of training the unroll grows from 1 step
    # to ttt_steps (ttt_depth), so early steps are cheaper; 0: every step unrolls ttt_steps
    ttt_ramp: float = 0.0
    # entropy curriculum (EDSD's easy-to-hard order, heads/eagle3.py entropy_curriculum): over the
    # first `entropy_ramp` share of training only the lowest-entropy share of each batch's labelled
    # positions is trained on, growing from `entropy_start` to all of them; 0: every position always
    entropy_ramp: float = 0.0
    entropy_start: float = 0.5
    # each step's objective (heads/losses.py): ce (soft cross-entropy, KL's gradient), lk_alpha
    # (-log of the acceptance rate) or lk_lambda (KL blended into 1 - acceptance rate by
    # exp(-lk_eta * acceptance rate)), LK losses, arXiv 2602.23881 (docs/training.md); dpace: soft CE
    # with each position's chain of steps weighted by D-PACE instead of ttt_decay (heads/losses.py)
    loss: str = "ce"
    lk_eta: float = 3.0
    dpace_alpha: float = 0.5
    # True: the fused feature is normed (hidden_norm) *before* it becomes the residual; False (ours,
    # SpecForge's, vLLM's research layout): the residual is the un-normed feature (docs/formats.md)
    norm_before_residual: bool = False
    # EAGLE-3.1 / speculators variants (docs/formats.md): norm_before_fc = one RMSNorm over the
    # concatenated [3H] fc input; fc_norm = one RMSNorm per target feature before fc (EAGLE-3.1);
    # norm_output = the *normed* hidden state is fed to the next draft step (EAGLE-3.1)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # the draft layer attends only the last `sliding_window` positions (query included); None: the
    # whole prefix. speculators' trainer makes such heads (window 2048).
    sliding_window: int | None = None
    draft_layer: str = "llama"  # as Eagle1Config.draft_layer
    layer: DraftLayerShape = field(default_factory=DraftLayerShape)  # as Eagle1Config.layer
    target: TargetIdentity | None = None

    LAYER_FIELDS: ClassVar[tuple[str, ...]] = Eagle1Config.LAYER_FIELDS

    def __post_init__(self) -> None:
        self._check_kind()
        _check_draft_layer(self.draft_layer)
        self.layer.check(self.LAYER_FIELDS, self.kind)
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if not self.ttt_decay > 0:
            raise ValueError(f"ttt_decay must be > 0, got {self.ttt_decay}")
        if not 0.0 <= self.ttt_ramp <= 1.0:
            raise ValueError(f"ttt_ramp must be in [0, 1], got {self.ttt_ramp}")
        if not 0.0 <= self.entropy_ramp <= 1.0:
            raise ValueError(f"entropy_ramp must be in [0, 1], got {self.entropy_ramp}")
        if not 0.0 < self.entropy_start <= 1.0:
            raise ValueError(f"entropy_start must be in (0, 1], got {self.entropy_start}")
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        check_loss(self.loss, self.lk_eta, self.dpace_alpha)
        self._check_chain_loss()
        if self.loss == "dpace" and self.entropy_ramp > 0:
            raise ValueError("loss dpace weighs every labelled position's chain of steps: set entropy_ramp: 0")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are two ways to norm fc's input: pick one")
        if self.target is not None:
            L = self.target.num_layers
            if self.aux_layers is None:
                self.aux_layers = default_eagle3_layers(L)
            self.draft_vocab_size = min(self.draft_vocab_size, self.target.vocab_size)
        if self.aux_layers is not None:
            self.aux_layers = tuple(int(i) for i in self.aux_layers)
            if len(self.aux_layers) == 0:
                raise ValueError("aux_layers must not be empty")
            if self.target is not None and any(not 0 <= i <= self.target.num_layers for i in self.aux_layers):
                raise ValueError(f"aux_layers {self.aux_layers} outside 0..{self.target.num_layers}")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        if self.aux_layers is None:
            return default_eagle3_layers(self._need_target().num_layers)
        return self.aux_layers

    needs_last_hidden: ClassVar[bool] = False


@dataclass
class Eagle31Config(Eagle3Config):
    """EAGLE-3.1 (vLLM / EAGLE / TorchSpec, 2026): EAGLE-3 with an RMSNorm on each target feature before
    fc (`fc_norm`) and the *normed* hidden state fed to the next draft step (`norm_output`), which
    keeps deeper draft steps from drifting. Same head module and checkpoint layout as EAGLE-3 plus
    `fc_norm.{i}.weight`; the engines read both flags from the config (docs/formats.md)."""

    kind: str = "eagle31"
    fc_norm: bool = True
    norm_output: bool = True


@dataclass
class PEagleConfig(Eagle3Config):
    """P-EAGLE (parallel drafting; SpecForge, speculators and vLLM, 2026): the EAGLE-3 module plus a
    learned mask-token embedding and a learned stand-in for the target features (`mask_hidden`,
    in the fused-feature space before fc), so that one forward drafts `parallel_depth` tokens:
    the last committed pair predicts the first, and each of `parallel_depth - 1` mask positions
    after it one more (heads/peagle.py). Training keeps every chain at depth 0 and a shrinking
    random share of them deeper: `max(cod_ratio**d, cod_min_ratio)` at depth d (docs/formats.md
    "Parallel drafters"). `mask_token_id` is the target token whose embedding row an engine's
    export carries the learned mask embedding in: pick one the text never uses. `ttt_steps` is
    unused."""

    LOSS_FIELDS: ClassVar[tuple[str, ...]] = ("cod_ratio", "cod_min_ratio", "loss", "lk_eta", "dpace_alpha")

    kind: str = "peagle"
    parallel_depth: int = 4
    mask_token_id: int | None = None
    cod_ratio: float = 0.8
    cod_min_ratio: float = 0.2
    ttt_steps: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.parallel_depth < 1:
            raise ValueError(f"parallel_depth must be >= 1, got {self.parallel_depth}")
        if not (0 < self.cod_min_ratio <= 1 and 0 < self.cod_ratio <= 1):
            raise ValueError(f"cod_ratio and cod_min_ratio must lie in (0, 1], got {self.cod_ratio}, {self.cod_min_ratio}")
        if self.mask_token_id is None:
            raise ValueError(
                "P-EAGLE needs mask_token_id: a target token id the text never uses (its embedding "
                "row carries the learned mask embedding in engine exports)"
            )
        if self.target is not None and not 0 <= self.mask_token_id < self.target.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary (0..{self.target.vocab_size - 1})")


def default_dflash_layers(num_layers: int) -> tuple[int, ...]:
    """DFlash's target features: EAGLE-3's (2, L//2, L-3), so one capture serves both, kept to
    decoder-layer outputs 1..L-1 (the engines take the output of layer i - 1; index 0, the
    embeddings, and L, the final normed state, have no such name) and deduplicated for tiny targets."""
    return tuple(sorted({min(max(i, 1), num_layers - 1) for i in default_eagle3_layers(num_layers)}))


@dataclass
class DFlashConfig(_HeadConfig):
    """DFlash (block diffusion drafting, arXiv 2602.06036): `num_layers` Qwen3-style decoder layers
    whose queries are one block [pending token, mask x (block_size - 1)] and whose keys and values
    are the fused target features of the committed text plus that block, non-causal inside it. One
    forward drafts `block_size - 1` tokens through the target's own embedding and LM head
    (heads/dflash.py). Training: `num_anchors` random blocks per sequence, soft CE against the
    target's distribution at each block position, weighted exp(-(k - 1) / loss_decay_gamma) for
    the k-th drafted token (None: uniform) (docs/formats.md "Parallel drafters").

    `mask_token_id`: the target token whose (frozen) embedding fills the mask positions; the
    engines read it from the checkpoint, so pick one the text never uses."""

    LOSS_FIELDS: ClassVar[tuple[str, ...]] = ("num_anchors", "loss_decay_gamma", "loss", "lk_eta", "dpace_alpha")

    kind: str = "dflash"
    aux_layers: tuple[int, ...] | None = None  # output_hidden_states indices; None: default_dflash_layers(L)
    num_layers: int = 1
    block_size: int = 8
    mask_token_id: int | None = None
    num_anchors: int = 64  # blocks trained per sequence (the reference trainers: 512 on GPUs)
    loss_decay_gamma: float | None = 4.0  # speculators' default; SpecForge's is None (uniform)
    # as Eagle3Config.loss, over the target's whole vocabulary; lk_lambda's weight is one per batch,
    # over every block position together (EAGLE-3 weighs each unroll step on its own); dpace: soft CE
    # under D-PACE's adaptive weights instead of the decay (heads/losses.py dpace_weights)
    loss: str = "ce"
    lk_eta: float = 3.0
    dpace_alpha: float = 0.5  # D-PACE's smoothing q~ = (1 - a) q + a, in (0, 1]; the reference's 0.5
    # the draft layers' own shape (heads/dflash.py dflash_layer_config; the hidden size is always the target's)
    layer: DraftLayerShape = field(default_factory=DraftLayerShape)
    target: TargetIdentity | None = None

    LAYER_FIELDS: ClassVar[tuple[str, ...]] = (
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_parameters",
    )

    def __post_init__(self) -> None:
        self._check_kind()
        self.layer.check(self.LAYER_FIELDS, self.kind)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the pending token and at least one mask), got {self.block_size}")
        if self.num_layers < 1 or self.num_anchors < 1:
            raise ValueError(f"num_layers and num_anchors must be >= 1, got {self.num_layers}, {self.num_anchors}")
        if self.loss_decay_gamma is not None and not self.loss_decay_gamma > 0:
            raise ValueError(f"loss_decay_gamma must be > 0 or None, got {self.loss_decay_gamma}")
        self._check_loss()
        self._check_chain_loss()
        if self.mask_token_id is None:
            raise ValueError(f"{self._name} needs mask_token_id: a target token id the text never uses (its embedding fills the mask positions)")
        if self.target is not None:
            L = self.target.num_layers
            if L < 2:
                raise ValueError(f"{self._name} reads the outputs of decoder layers 1..L-1: the target needs >= 2 layers")
            if self.aux_layers is None:
                self.aux_layers = default_dflash_layers(L)
            if not 0 <= self.mask_token_id < self.target.vocab_size:
                raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary (0..{self.target.vocab_size - 1})")
        if self.aux_layers is not None:
            self.aux_layers = tuple(int(i) for i in self.aux_layers)
            if len(self.aux_layers) == 0:
                raise ValueError("aux_layers must not be empty")
            if self.target is not None and any(not 1 <= i < self.target.num_layers for i in self.aux_layers):
                raise ValueError(
                    f"{self._name} aux_layers {self.aux_layers} must be decoder-layer outputs 1.."
                    f"{self.target.num_layers - 1} (the engines name no other)"
                )

    _name: ClassVar[str] = "DFlash"

    def _check_loss(self) -> None:
        check_loss(self.loss, self.lk_eta, self.dpace_alpha)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        if self.aux_layers is None:
            return default_dflash_layers(self._need_target().num_layers)
        return self.aux_layers

    @property
    def num_drafted(self) -> int:
        """Tokens one block drafts: the mask positions (the pending token's slot predicts nothing)."""
        return self.block_size - 1

    needs_last_hidden: ClassVar[bool] = False


DSPARK_LOSSES = ("dspark", "dpace")


@dataclass
class DSparkConfig(DFlashConfig):
    """DSpark (arXiv 2607.05147): DFlash's backbone whose every block slot drafts, the pending
    token's included (slot k drafts token n + k + 1, so a block of S drafts S tokens), plus two
    small heads (heads/dspark.py):

      Markov head      logits_k = lm_head(h_k) + W2 W1[x_{n+k}]: a rank-`markov_rank` bias from the
                       token before slot k's (the pending token, then each drafted one), so the
                       block drafts left to right at the cost of one [r] x [r, V] product a token
      confidence head  c_k = sigmoid(proj(cat(h_k, W1[x_{n+k}]))): the chance slot k is accepted
                       once every slot before it was; it sizes the verify (num_draft "confidence")

    Loss (`loss: dspark`, the paper's): ce_weight * CE(data token) + l1_weight * ||q - p||_1 +
    confidence_weight * BCE(c, 1 - ||q - p||_1 / 2), each weighted exp(-k / loss_decay_gamma) at
    slot k = 0..S-1; `loss: dpace` weighs the three by D-PACE instead (heads/losses.py)."""

    LOSS_FIELDS: ClassVar[tuple[str, ...]] = DFlashConfig.LOSS_FIELDS + ("ce_weight", "l1_weight", "confidence_weight")

    kind: str = "dspark"
    block_size: int = 7  # DeepSeek's released heads: 7 drafted tokens a block
    loss: str = "dspark"
    markov_rank: int = 256
    confidence_head: bool = True
    confidence_with_markov: bool = True  # the confidence head reads W1[previous token] beside h_k
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0

    _name: ClassVar[str] = "DSpark"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {self.markov_rank}")
        if min(self.ce_weight, self.l1_weight, self.confidence_weight) < 0 or self.ce_weight + self.l1_weight == 0:
            raise ValueError("DSpark's loss weights must be >= 0, with ce_weight or l1_weight above 0")
        if self.confidence_weight > 0 and not self.confidence_head:
            raise ValueError("confidence_weight trains the confidence head: set confidence_head: true or the weight to 0")

    def _check_loss(self) -> None:
        if self.loss not in DSPARK_LOSSES:
            raise ValueError(
                f"a dspark head's loss is one of {', '.join(DSPARK_LOSSES)} (its three terms under the "
                f"decay or under D-PACE's weights), got {self.loss!r}"
            )
        check_loss("ce", self.lk_eta, self.dpace_alpha)

    @property
    def num_drafted(self) -> int:
        return self.block_size


@dataclass(frozen=True)
class HeadKind:
    """One head kind: its config class, the module class that holds its weights, the drafter class
    that drafts with it, and what the rest of the code may ask of it, so that no caller compares
    kind names and a new kind is its own files and one row of KINDS.

    `module` and `drafter` are named, "drafthead.<module path>.<class>", not imported: this table
    stays light enough for the CLI's parser, and heads/ imports nothing above it; heads/registry.py
    imports the module classes and inference/drafters/load.py the drafters (`resolve`)."""

    name: str
    config: type[_HeadConfig]
    module: str  # the nn.Module class of its weights (heads/)
    drafter: str  # the drafter class (inference/drafters/)
    adapts_target: bool = False  # carries a LoRA adapter merged into the target (Medusa-2)
    sizes_itself: bool = False  # sizing "confidence": the drafter estimates acceptance (EAGLE's paths, DSpark's head)
    grows_tree: bool = False  # drafts a best-first tree step by step (depth, branch) rather than a static tree (choices)
    draft_vocab: bool = False  # may draft over a reduced vocabulary (d2t/t2d; heads/draft_vocab.py)
    engine_layer: bool = False  # its draft layer is the engines' Llama layer or the target's (`draft_layer`)
    splits_rows: bool = False  # context_parallel > 1 splits its rows' columns across ranks (heads/context_split.py)
    mlp_heads: bool = False  # one small MLP head per draft position, no decoder layer (`train --plan`'s activation model)
    # the config field counting the draft positions one training chain covers (D-PACE weighs
    # them: loss dpace needs 2 or more); None: the kind trains one position
    chain_positions: str | None = None


_HEADS, _DRAFTERS = "drafthead.heads", "drafthead.inference.drafters"
_MEDUSA = HeadKind(
    "medusa1", MedusaConfig, f"{_HEADS}.medusa.MedusaHead", f"{_DRAFTERS}.head_drafters.MedusaDrafter", mlp_heads=True, chain_positions="num_heads"
)
_EAGLE3 = HeadKind(
    "eagle3",
    Eagle3Config,
    f"{_HEADS}.eagle3.Eagle3Head",
    f"{_DRAFTERS}.head_drafters.EagleDrafter",
    sizes_itself=True,
    grows_tree=True,
    draft_vocab=True,
    engine_layer=True,
    splits_rows=True,
    chain_positions="ttt_steps",
)
# The head kinds: the one table the config, the registry (heads/registry.py), the formats, the
# drafters (inference/drafters/load.py), the drafting settings (drafthead/draft_spec.py) and the
# CLI derive from.
KINDS: dict[str, HeadKind] = {
    k.name: k
    for k in (
        _MEDUSA,
        dataclasses.replace(_MEDUSA, name="medusa2", adapts_target=True),
        dataclasses.replace(
            _MEDUSA, name="hydra", config=HydraConfig, module=f"{_HEADS}.hydra.HydraHead", drafter=f"{_DRAFTERS}.head_drafters.HydraDrafter"
        ),
        HeadKind(
            "eagle1",
            Eagle1Config,
            f"{_HEADS}.eagle.Eagle1Head",
            f"{_DRAFTERS}.head_drafters.EagleDrafter",
            sizes_itself=True,
            grows_tree=True,
            engine_layer=True,
        ),
        _EAGLE3,
        dataclasses.replace(_EAGLE3, name="eagle31", config=Eagle31Config),  # the EAGLE-3 module with fc_norm and norm_output on
        HeadKind(
            "peagle",
            PEagleConfig,
            f"{_HEADS}.peagle.PEagleHead",
            f"{_DRAFTERS}.parallel.ParallelDrafter",
            draft_vocab=True,
            engine_layer=True,
            chain_positions="parallel_depth",
        ),
        HeadKind("dflash", DFlashConfig, f"{_HEADS}.dflash.DFlashHead", f"{_DRAFTERS}.parallel.DFlashDrafter", chain_positions="num_drafted"),
        HeadKind(
            "dspark",
            DSparkConfig,
            f"{_HEADS}.dspark.DSparkHead",
            f"{_DRAFTERS}.parallel.DSparkDrafter",
            sizes_itself=True,
            chain_positions="num_drafted",
        ),
        HeadKind("mtp", MTPConfig, f"{_HEADS}.mtp.MTPHead", f"{_DRAFTERS}.head_drafters.EagleDrafter", sizes_itself=True, grows_tree=True),
    )
}
CONFIG_CLASSES: dict[str, type[_HeadConfig]] = {name: kind.config for name, kind in KINDS.items()}


def head_kind(name: str) -> HeadKind:
    """The kind called `name` (KINDS); an unknown name is a ValueError listing the known ones."""
    if name not in KINDS:
        raise ValueError(f"unknown head kind {name!r} (known: {', '.join(KINDS)})")
    return KINDS[name]


def check_context_parallel(kind: str, loss: str | None, ranks: int) -> None:
    """`context_parallel: ranks` > 1 splits each row's columns across ranks: for kinds that split
    their rows (`splits_rows`), and not under loss dpace, which weighs each position's whole chain
    of unroll steps on one rank. A ValueError in one line otherwise, or for an unknown kind."""
    known = head_kind(kind)
    if ranks <= 1:
        return
    if not known.splits_rows:
        splitters = ", ".join(name for name, k in KINDS.items() if k.splits_rows)
        raise ValueError(f"context_parallel splits the rows of {splitters} heads; {kind} heads do not split theirs: use context_parallel: 1")
    if loss == "dpace":
        raise ValueError("loss dpace weighs each position's chain of unroll steps on one rank: it does not combine with context_parallel > 1")


def resolve(name: str) -> type:
    """The class a KINDS row names ("drafthead.heads.eagle3.Eagle3Head"), imported now."""
    import importlib

    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)


# HydraConfig is a MedusaConfig; Eagle31Config and PEagleConfig are Eagle3Configs
HeadConfig = MedusaConfig | Eagle1Config | Eagle3Config | DFlashConfig


def config_from_dict(d: dict) -> HeadConfig:
    """Dispatch on d['kind']; unknown kinds and unknown keys are errors."""
    kind = d.get("kind")
    if kind not in CONFIG_CLASSES:
        raise ValueError(f"unknown head kind {kind!r} (known: {', '.join(KINDS)})")
    return CONFIG_CLASSES[kind].from_dict(d)
