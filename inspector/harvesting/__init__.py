"""Activation harvests for training sparse autoencoders, probes and steering vectors: a corpus run
prefill-only through the compiled engine, one or a few hooks' rows delivered to disk
(``harvest_to_disk``: safetensors shards, or a dataset SAELens trains from) or in memory as shuffled
batches (``harvest``: an iterator, with ``for_saelens`` for a SAELens trainer; also ``inspector.harvest``)."""

from .corpus import Corpus, CorpusError
from .packing import pack
from .run import HarvestSpec
from .store import Harvest, harvest, harvest_to_disk

__all__ = ["Corpus", "CorpusError", "Harvest", "HarvestSpec", "harvest", "harvest_to_disk", "pack"]
