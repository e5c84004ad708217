"""genscore sampler: pure-torch logprobs snapshots, candidate gathering, top lists and sampling over [B, V] logits."""

from .params import LogprobsMode, SamplingParams
from .processors import process
from .sampling import sample
from .scoring import RowScores, ScoreOutput, score, to_rows
from .snapshot import snapshot

__all__ = [
    "LogprobsMode",
    "RowScores",
    "SamplingParams",
    "ScoreOutput",
    "process",
    "sample",
    "score",
    "snapshot",
    "to_rows",
]
