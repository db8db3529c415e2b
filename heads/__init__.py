"""Draft heads: Medusa, EAGLE-1, EAGLE-3; their configs, losses, save/load and export."""

from .batch import FeatureBatch
from .config import Eagle1Config, Eagle3Config, MedusaConfig, config_from_dict, default_eagle3_layers
from .draft_vocab import build_draft_vocab, count_tokens, validate_draft_vocab
from .eagle import Eagle1Head
from .eagle3 import Eagle3Head
from .formats import export_head, import_head
from .identity import HeadTargetMismatch, TargetIdentity, check_compatible, identify_target
from .io import DraftHeadBase
from .files import HeadFormatError
from .medusa import MedusaHead
from .registry import HEAD_CLASSES, build_head, load_head, make_config

__all__ = [
    "FeatureBatch",
    "MedusaConfig",
    "Eagle1Config",
    "Eagle3Config",
    "config_from_dict",
    "default_eagle3_layers",
    "build_draft_vocab",
    "count_tokens",
    "validate_draft_vocab",
    "MedusaHead",
    "Eagle1Head",
    "Eagle3Head",
    "DraftHeadBase",
    "HEAD_CLASSES",
    "TargetIdentity",
    "identify_target",
    "check_compatible",
    "HeadTargetMismatch",
    "HeadFormatError",
    "build_head",
    "load_head",
    "make_config",
    "export_head",
    "import_head",
]
