"""EAGLE draft heads: the head (head.py), its checkpoints (formats.py: vLLM speculators' layout and
the EAGLE authors'), its training data (data.py), training (train.py) and the `train-draft`
recipe (recipe.py). The drafter that runs a head in the engine is drafters/eagle.py."""

from .formats import load_head, save_head
from .head import EagleHead, HeadKV, HeadSpec, eagle3_layers, new_head

__all__ = ["EagleHead", "HeadKV", "HeadSpec", "eagle3_layers", "load_head", "new_head", "save_head"]
